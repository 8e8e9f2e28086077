"""What a training run reports: the median step the examples print, whatever was left to run."""

import pytest

from linnet.history import History, Step

pytestmark = pytest.mark.quick


def steps(*seconds: float) -> list[Step]:
    return [Step(i + 1, 1.0, s, 8, 8.0, 1e-3) for i, s in enumerate(seconds)]


def test_the_median_step_leaves_out_the_compiling_steps_when_there_are_others():
    assert History(steps(30.0, 2.0, 1.0, 3.0, 1.0)).median_seconds() == 1.0
    assert History(steps(30.0, 2.0)).median_seconds() == 16.0  # a short (resumed) run: every step it took
    assert History(steps(), resumed_from=40).median_seconds() is None  # resumed at its last step: none taken
