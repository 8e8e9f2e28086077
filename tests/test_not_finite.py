"""A run whose loss or weights stop being finite stops at that step, on every rank, and destroys nothing:
no checkpoint holding inf or nan is written, none of the good ones is pruned for one, the folder resumes
from the last good step to the losses of a run that never diverged, and save_weights writes no such
weights. In PyTorch (two ranks over Gloo, the optimizer stepping in the backward) and in JAX (two devices)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run

from linnet import nest
from linnet.data.packing import Example, Row, pack
from linnet.errors import NotFinite, UserError

ROW = 64
STEPS = 6
LR = 3e-3
LIMIT_S = 600


def rows(count: int) -> list[Row]:
    rng = np.random.default_rng(3)
    examples = [Example.prompted(rng.integers(6, 200, rng.integers(3, 12)).tolist(),
                                 rng.integers(6, 200, rng.integers(2, 8)).tolist()) for _ in range(30 * count)]
    packed = list(pack(examples, ROW))
    assert len(packed) >= count
    return packed[:count]


def diverging_from(step: int):
    """A learning-rate factor that is 1 until `step` and inf from its update on (LambdaLR's counter is 0-based)."""
    return lambda counted: 1.0 if counted + 1 < step else math.inf


def checkpoints(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("step-*"))


# PyTorch


def torch_run(rank: int, world: int, folder: str, steps: int, diverge_at: int | None, every: int):
    """Trains tiny-llama sharded over `world` ranks; returns (losses by step, resumed_from) or the error it raised."""
    from linnet.torch import fully_shard, train

    model = nest.load("tiny-llama", numerics="exact", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"},
                      cast_dtype=True, trainable=True, weights="random", entry="loss_packed")
    fully_shard(model)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, eps=1e-6)
    schedule = None if diverge_at is None else torch.optim.lr_scheduler.LambdaLR(optimizer, diverging_from(diverge_at))
    data = rows(world * STEPS)[rank::world]
    try:
        history = train(model, iter(data), optimizer=optimizer, steps=steps, schedule=schedule,
                        on_step=lambda s: None, checkpoint=folder, checkpoint_every=every)
    except UserError as error:
        return type(error).__name__, str(error)
    return {s.step: s.loss for s in history.steps}, history.resumed_from


def test_torch_a_diverging_run_stops_saves_nothing_bad_and_resumes_from_the_last_good_step(tmp_path):
    whole, _ = run(torch_run, 2, str(tmp_path / "whole"), STEPS, None, 2, timeout=LIMIT_S)[0]
    folder = tmp_path / "diverged"
    # lr is inf from step 4's update on: step 4's loss is finite but its weights are not, so the checkpoint
    # of step 4 is refused, and step 5's loss is nan.
    stopped = run(torch_run, 2, str(folder), STEPS, 4, 2, timeout=LIMIT_S)
    for kind, message in stopped:
        assert kind in ("NotFinite", "UserError"), message
        assert "step 4 is not saved" in message and "inf or nan" in message, message
    assert checkpoints(folder) == ["step-00000002"]
    resumed = run(torch_run, 2, str(folder), STEPS, None, 2, timeout=LIMIT_S)[0]
    assert resumed[1] == 2 and list(resumed[0]) == [3, 4, 5, 6]
    for step, loss in resumed[0].items():
        assert loss == pytest.approx(whole[step], rel=1e-5), (step, loss, whole[step])


def test_torch_a_nan_loss_stops_every_rank_at_its_step_keeping_both_good_checkpoints(tmp_path):
    folder = tmp_path / "ckpt"
    run(torch_run, 2, str(folder), 4, None, 2, timeout=LIMIT_S)
    assert checkpoints(folder) == ["step-00000002", "step-00000004"]
    # lr is inf from step 5's update on (after the resume at 4): step 6's loss is nan, before its checkpoint.
    stopped = run(torch_run, 2, str(folder), STEPS, 5, 3, timeout=LIMIT_S)
    for kind, message in stopped:
        assert kind == "NotFinite", message
        assert message.startswith("step 6: the loss is nan") and f"{folder} resumes from step 4" in message, message
    assert checkpoints(folder) == ["step-00000002", "step-00000004"]


def test_save_weights_refuses_weights_that_are_not_finite_and_keeps_the_folder(tmp_path):
    model = nest.load("tiny-llama", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, cast_dtype=True,
                      trainable=True, weights="random", entry="loss_packed")
    out = model.save_weights(tmp_path / "out")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with torch.no_grad():
        next(iter(model.parameters()))[0] = float("nan")
    with pytest.raises(NotFinite, match=r"no weights are written to .*out.*holds inf or nan in bfloat16"):
        model.save_weights(tmp_path / "out")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


# JAX


def jax_run(folder: Path, steps: int, diverge_at: int | None, every: int):
    import jax
    import optax
    from jax.sharding import Mesh

    from linnet.jax import train

    model = nest.load("tiny-llama", backend="jax_source", entry="loss_packed", numerics="exact", cast_dtype=True,
                      generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, weights="random", seed=0)
    last_good = steps if diverge_at is None else diverge_at - 1  # a schedule either way: its count is state
    optimizer = optax.adamw(lambda count: jax.numpy.where(count < last_good, LR, jax.numpy.inf), eps=1e-6)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    _, history = train(model, iter(rows(2 * STEPS)), optimizer=optimizer, steps=steps, mesh=mesh,
                       on_step=lambda s: None, checkpoint=str(folder), checkpoint_every=every)
    return {s.step: s.loss for s in history.steps}, history.resumed_from


def test_jax_a_diverging_run_stops_saves_nothing_bad_and_resumes_from_the_last_good_step(tmp_path):
    whole, _ = jax_run(tmp_path / "whole", STEPS, None, 2)
    folder = tmp_path / "diverged"
    with pytest.raises(NotFinite, match="step 4 is not saved: after its update .* hold inf or nan"):
        jax_run(folder, STEPS, 4, 2)
    assert checkpoints(folder) == ["step-00000002"]
    resumed, resumed_from = jax_run(folder, STEPS, None, 2)
    assert resumed_from == 2 and list(resumed) == [3, 4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole[step], rel=1e-5), (step, loss, whole[step])
    nan_folder = tmp_path / "nan"
    jax_run(nan_folder, 4, None, 2)
    with pytest.raises(NotFinite, match=f"step 6: the loss is nan.*{nan_folder} resumes from step 4"):
        jax_run(nan_folder, STEPS, 5, 3)
    assert checkpoints(nan_folder) == ["step-00000002", "step-00000004"]
