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


def test_on_a_terminal_progress_is_a_bar_each_step_and_elsewhere_a_line_every_few_seconds():
    import io

    from linnet.history import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    steps = [Step(i, 2.0 / i, 0.1, 100, 50.0, 1e-3, 0.5, 1.5 if i == 2 else None) for i in (1, 2, 3)]
    terminal, log = Terminal(), io.StringIO()
    for stream in (terminal, log):
        progress = Progress(3, 0, every_seconds=60, stream=stream)
        for step in steps:
            progress(step)
    shown = terminal.getvalue()
    assert shown.count("\r[") == 3 and shown.startswith("\r[########................] step 1/3  loss 2.0000  grad norm")
    assert shown.count("\n") == 2  # the evaluated step and the last keep their lines
    assert [line.split("  ")[0] for line in log.getvalue().splitlines()] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "held-out loss 1.5000" in log.getvalue().splitlines()[1]
