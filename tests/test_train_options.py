"""train's options of a fine-tuning run, in PyTorch and JAX. accumulate= and max_grad_norm=: over 2 Gloo
ranks, 3 rows a rank a step, clipped at a norm the gradients exceed, equals one unsharded process that
trains the same 6 rows a step as one batch (the token-weighted mean of their losses) and calls
torch.nn.utils.clip_grad_norm_: the same losses, the same norms as Step.grad_norm, the same final weights,
resumed mid-way on other ranks too, and in JAX over 4 devices. eval_every= puts the held-out loss after
those steps in the Step. AdamW's eps is raised to 1e-3: at its default an element whose gradient is near
zero moves a full step either way, and rounding picks the way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run
from hf_models import write_tied_card
from linnet import nest
from linnet.data.packing import Example, pack
from linnet.torch.train import row_tensors

ROW, STEPS, ACCUMULATE, WORLD, MAX_NORM = 64, 3, 3, 2, 0.05
OPTIMIZER = dict(lr=3e-3, weight_decay=0.1, eps=1e-3)


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return write_tied_card(tmp_path_factory.mktemp("card"))


def rows(rows_a_step: int = ACCUMULATE * WORLD) -> list:
    """The run's rows, in the order the global batches take them: step s takes rows [6s, 6s + 6)."""
    rng = np.random.default_rng(5)
    examples = [Example.prompted(rng.integers(0, 211, rng.integers(3, 20)).tolist(),
                                 rng.integers(0, 211, rng.integers(2, 15)).tolist()) for _ in range(300)]
    taken = list(pack(examples, ROW))[: STEPS * rows_a_step]
    assert len(taken) == STEPS * rows_a_step
    return taken


def load(card):
    return nest.load(card, numerics="exact", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, device="cpu",
                     cast_dtype=True, trainable=True, weights="random", seed=0, entry="loss_packed")


def sharded_run(rank: int, world: int, card, step_in_backward: bool | None, hold_gradients: bool = False):
    from linnet.torch import fully_shard
    from linnet.torch.collectives import gathered_weights
    from linnet.torch.train import train

    torch.set_num_threads(1)
    model = fully_shard(load(card))
    optimizer = torch.optim.AdamW(list(model.parameters()), **OPTIMIZER)
    history = train(model, iter(rows()[rank::world]), optimizer=optimizer, steps=STEPS, accumulate=ACCUMULATE,
                    max_grad_norm=MAX_NORM, step_in_backward=step_in_backward, hold_gradients=hold_gradients,
                    on_step=lambda s: None)
    weights = {name: tensor.numpy().copy() for name, tensor in gathered_weights(model, torch.float32)}
    return [s.loss for s in history.steps], [s.grad_norm for s in history.steps], weights


def one_batch_run(card, rows_a_step: int = ACCUMULATE * WORLD, start: Path | None = None):
    """The reference: one process, the whole model, each step's rows as one batch (its weights first saved
    in `start`, if given)."""
    torch.set_num_threads(1)
    model = load(card)
    if start is not None:
        model.save_weights(start, dtype=torch.float32)
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(parameters, **OPTIMIZER)
    losses, norms, taken = [], [], rows(rows_a_step)
    for step in range(STEPS):
        batch = taken[step * rows_a_step:(step + 1) * rows_a_step]
        weights = [float(row.weights.sum()) for row in batch]
        loss = sum(model.loss_packed(*row_tensors(row)) * weight for row, weight in zip(batch, weights)) / sum(weights)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(parameters, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {name: tensor.detach().numpy().copy() for name, tensor in model.named_weights()}


@pytest.fixture(scope="module")
def reference(card):
    return one_batch_run(card)


@pytest.mark.parametrize("step_in_backward, hold_gradients", [(None, False), (False, False), (None, True)],
                         ids=["default", "step-after", "held"])
def test_accumulated_clipped_training_equals_one_batch_in_one_process(card, reference, step_in_backward,
                                                                      hold_gradients):
    """held: the rows but the last of each step hold their whole gradients, reduce-scattered once."""
    losses, norms, weights = run(sharded_run, WORLD, card, step_in_backward, hold_gradients, timeout=300)[0]
    expected_losses, expected_norms, expected_weights = reference
    assert min(expected_norms) > MAX_NORM  # every step clips
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-5)
    assert weights.keys() == expected_weights.keys()
    for name, expected in expected_weights.items():
        np.testing.assert_allclose(weights[name], expected, rtol=0, atol=1e-5 * np.abs(expected).max(), err_msg=name)


def test_step_in_backward_is_refused_where_a_step_needs_the_whole_gradient(card):
    from linnet.torch.train import train

    model = load(card)
    optimizer = torch.optim.AdamW(list(model.parameters()), fused=True)
    for options, reason in ((dict(accumulate=2), "accumulate > 1 needs every row's gradient"),
                            (dict(max_grad_norm=1.0), "max_grad_norm needs the norm over every part")):
        with pytest.raises(ValueError, match=f"step_in_backward=True\\): {reason}"):
            train(model, iter(rows()), optimizer=optimizer, steps=1, step_in_backward=True, **options)


@pytest.mark.parametrize("options, message", [
    (dict(accumulate=0), r"train\(accumulate=0\): rows a rank takes a step"),
    (dict(accumulate=1.5), r"train\(accumulate=1.5\)"),
    (dict(max_grad_norm=0.0), r"train\(max_grad_norm=0.0\): a finite norm above 0"),
    (dict(max_grad_norm=float("nan")), r"train\(max_grad_norm=nan\)"),
])
def test_bad_settings_are_named(card, options, message):
    from linnet.torch.train import train

    model = load(card)
    with pytest.raises(ValueError, match=message):
        train(model, iter(rows()), optimizer=torch.optim.AdamW(list(model.parameters())), steps=1, **options)


def test_a_run_too_short_of_rows_for_its_accumulation_names_how_many(card):
    from linnet.torch.train import train

    model = load(card)
    with pytest.raises(ValueError, match="ran out of rows at step 2 of 3: give every rank at least 9 rows"):
        train(model, iter(rows()[:5]), optimizer=torch.optim.AdamW(list(model.parameters())), steps=3,
              accumulate=3, on_step=lambda s: None)


def leg(rank: int, world: int, card, folder: str, steps: int, accumulate: int):
    """Steps up to `steps` of the run whose checkpoints `folder` holds, `accumulate` rows a rank a step."""
    from linnet.torch import fully_shard
    from linnet.torch.collectives import gathered_weights
    from linnet.torch.train import train

    torch.set_num_threads(1)
    model = fully_shard(load(card))
    optimizer = torch.optim.AdamW(list(model.parameters()), **OPTIMIZER)
    history = train(model, iter(rows()[rank::world]), optimizer=optimizer, steps=steps, accumulate=accumulate,
                    max_grad_norm=MAX_NORM, checkpoint=folder, checkpoint_every=1, on_step=lambda s: None)
    weights = {name: tensor.numpy().copy() for name, tensor in gathered_weights(model, torch.float32)}
    return history.resumed_from, [s.loss for s in history.steps], [s.grad_norm for s in history.steps], weights


@pytest.mark.parametrize("first, then", [(2, 1), (1, 3)], ids=["2-to-1", "1-to-3"])
def test_an_accumulated_run_resumed_mid_way_on_other_ranks_equals_one_batch(card, reference, tmp_path, first, then):
    """The global batch stays 6 rows, 3 a rank on 2 ranks, 6 on 1, 2 on 3: a checkpoint after step 1 resumes
    on the other number of ranks to the reference's steps 2 and 3."""
    folder = str(tmp_path / "run")
    resumed_from, losses, norms, _ = run(leg, first, card, folder, 1, 6 // first, timeout=300)[0]
    assert resumed_from == 0 and len(losses) == 1
    resumed_from, losses, norms, weights = run(leg, then, card, folder, STEPS, 6 // then, timeout=300)[0]
    expected_losses, expected_norms, expected_weights = reference
    assert resumed_from == 1
    np.testing.assert_allclose(losses, expected_losses[1:], rtol=1e-5)
    np.testing.assert_allclose(norms, expected_norms[1:], rtol=1e-5)
    for name, expected in expected_weights.items():
        np.testing.assert_allclose(weights[name], expected, rtol=0, atol=1e-5 * np.abs(expected).max(), err_msg=name)


def test_jax_accumulated_clipped_training_over_four_devices_equals_one_batch(card, tmp_path):
    """linnet.jax.train, 2 batches of 4 devices a step, against PyTorch's one process on the same 8 rows a
    step, from the same weights. Two frameworks' f32 kernels round differently: 1e-4."""
    import jax
    import optax
    from jax.sharding import Mesh
    from safetensors.numpy import load_file

    from linnet.jax import train as jax_train

    expected_losses, expected_norms, expected_weights = one_batch_run(card, 8, start=tmp_path / "start")
    model = nest.load(card, backend="jax_source", entry="loss_packed", numerics="exact", cast_dtype=True,
                      generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, weights=tmp_path / "start")
    optimizer = optax.adamw(OPTIMIZER["lr"], eps=OPTIMIZER["eps"], weight_decay=OPTIMIZER["weight_decay"])
    _, history = jax_train(model, rows(8), optimizer=optimizer, steps=STEPS, mesh=Mesh(np.array(jax.devices()[:4]),
                           ("data",)), accumulate=2, max_grad_norm=MAX_NORM, on_step=lambda s: None)
    assert min(expected_norms) > MAX_NORM
    np.testing.assert_allclose([s.loss for s in history.steps], expected_losses, rtol=1e-4)
    np.testing.assert_allclose([s.grad_norm for s in history.steps], expected_norms, rtol=1e-4)
    model.save_weights(tmp_path / "trained", dtype=jax.numpy.float32)
    weights = load_file(tmp_path / "trained" / "model.safetensors")
    assert weights.keys() == expected_weights.keys()
    for name, expected in expected_weights.items():
        np.testing.assert_allclose(weights[name], expected, rtol=0, atol=1e-4 * np.abs(expected).max(), err_msg=name)


def evaluated(rank: int, world: int, card, steps: int, eval_every: int | None):
    from linnet.torch import fully_shard
    from linnet.torch.train import evaluate, train

    torch.set_num_threads(1)
    model = fully_shard(load(card))
    optimizer = torch.optim.AdamW(list(model.parameters()), **OPTIMIZER)
    held_out = rows()[-2:]
    options = dict(eval_rows=held_out[rank::world], eval_every=eval_every) if eval_every else {}
    history = train(model, iter(rows()[rank::world]), optimizer=optimizer, steps=steps, on_step=lambda s: None,
                    **options)
    return [s.held_out_loss for s in history.steps], evaluate(model, held_out[rank::world])


def test_the_held_out_loss_every_few_steps_is_that_after_those_steps(card):
    during, after = run(evaluated, WORLD, card, 3, 2, timeout=300)[0]
    assert during[0] is None and during[2] == pytest.approx(after, rel=1e-6)  # step 3: the last
    _, after_two = run(evaluated, WORLD, card, 2, None, timeout=300)[0]
    assert during[1] == pytest.approx(after_two, rel=1e-6)


def test_jax_evaluates_the_held_out_loss_every_few_steps(card, tmp_path):
    import jax
    import optax
    from jax.sharding import Mesh

    from linnet.jax import evaluate, train as jax_train

    def trained(steps, eval_every):
        model = nest.load(card, backend="jax_source", entry="loss_packed", numerics="exact", cast_dtype=True,
                          generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, weights="random", seed=0)
        options = dict(eval_rows=rows()[-2:], eval_every=eval_every) if eval_every else {}
        _, history = jax_train(model, rows(), optimizer=optax.adamw(1e-3), steps=steps, on_step=lambda s: None,
                               mesh=Mesh(np.array(jax.devices()[:2]), ("data",)), **options)
        return [s.held_out_loss for s in history.steps], evaluate(model, rows()[-2:])

    during, after = trained(3, 2)
    assert during[0] is None and during[2] == pytest.approx(after, rel=1e-6)
    assert during[1] == pytest.approx(trained(2, None)[1], rel=1e-6)
