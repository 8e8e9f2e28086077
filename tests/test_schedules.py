"""Learning-rate schedules (linnet.schedules): after the warm-up, transformers' get_scheduler's for the same
name, step for step; PyTorch's LambdaLR and the optax schedule give the same rates; bad settings are named."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from linnet.jax.train import lr_schedule as jax_schedule
from linnet.schedules import lr_factor
from linnet.torch.train import lr_schedule as torch_schedule

pytestmark = pytest.mark.quick

STEPS = 20


def rates_of(scheduler, optimizer) -> list[float]:
    rates = []
    for _ in range(STEPS + 1):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)


@pytest.mark.parametrize("name, transformers_name, floor", [
    ("constant", "constant_with_warmup", 0.0), ("linear", "linear", 0.0), ("cosine", "cosine", 0.0),
    ("cosine", "cosine_with_min_lr", 0.1)])
@pytest.mark.parametrize("warmup", [0, 4])
def test_after_the_warmup_each_is_transformers_schedule_of_that_name(name, transformers_name, floor, warmup):
    from transformers import get_scheduler

    theirs_optimizer, mine_optimizer = optimizer(), optimizer()
    kwargs = {"min_lr_rate": floor} if transformers_name == "cosine_with_min_lr" else None
    theirs = rates_of(get_scheduler(transformers_name, theirs_optimizer, num_warmup_steps=warmup,
                                    num_training_steps=STEPS, scheduler_specific_kwargs=kwargs), theirs_optimizer)
    mine = rates_of(torch_schedule(mine_optimizer, name, warmup, STEPS, floor), mine_optimizer)
    np.testing.assert_allclose(mine[warmup:], theirs[warmup:], rtol=1e-12, atol=1e-15)
    # The warm-up rises to the peak from above 0: (step + 1) / (warmup + 1) of it.
    np.testing.assert_allclose(mine[:warmup], [0.5 * (step + 1) / (warmup + 1) for step in range(warmup)])


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_pytorch_and_jax_give_the_same_rates(name):
    mine_optimizer = optimizer()
    torch_rates = rates_of(torch_schedule(mine_optimizer, name, 3, STEPS, 0.2), mine_optimizer)
    schedule = jax_schedule(0.5, name, 3, STEPS, 0.2)
    np.testing.assert_allclose([float(schedule(jnp.int32(step))) for step in range(STEPS + 1)], torch_rates, rtol=1e-6)


@pytest.mark.parametrize("args, message", [
    (("cosnie", 1, 10, 0.0), "schedule 'cosnie': one of constant, linear, cosine"),
    (("linear", 11, 10, 0.0), "the schedule needs 0 <= warmup <= steps, got warmup=11, steps=10"),
    (("linear", 1, 10, 1.5), "the schedule's floor is a fraction of the peak learning rate, from 0 to 1, got 1.5"),
])
def test_bad_settings_are_named(args, message):
    with pytest.raises(ValueError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        lr_factor(*args)
