"""Weights built straight into their parts for linnet.jax.train (conftest.py asks
XLA for four CPU devices): random ones drawn as the unsharded model draws them,
bit for bit at any number of devices; a sharded checkpoint read by each device's
range alone; the parts training leaves, saved a group at a time without the
model being made whole; and evaluate over parts, which builds them once for train."""

from __future__ import annotations

import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import Mesh
from safetensors.torch import load_file

from hf_models import BASE, LLAMA3_SCALING, load_hf, save_hf_llama, write_card
from linnet import nest
from linnet.jax import shard
from linnet.data.packing import Example, pack
from linnet.hf.read import SliceReader

jax_train = importlib.import_module("linnet.jax.train")  # the module: linnet.jax.train is also the function

ROW = 32
TOKENS = np.random.default_rng(2).integers(0, 211, (1, ROW)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama written by transformers in files of at most 100KB, with an index."""
    card = save_hf_llama(tmp_path_factory.mktemp("weights"), num_key_value_heads=2, max_shard_size="100KB")
    folder = card.parent / "hf"
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) > 2
    return card


def load(card, weights="random", batch: int = 1):
    return nest.load(card, backend="jax_source", numerics="exact", cast_dtype=True, weights=weights, seed=0,
                     generics={"Batch": batch, "MaxSeq": ROW, "T": "f32"})


def mesh(devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("data",))


def check_parts(model_whole, parts, devices: int) -> None:
    """Each device holds exactly its range of each group's flat buffer, as the whole model's weights give it."""
    layouts = shard.group_layouts(model_whole.checked, devices)
    params = model_whole.params
    for decl, index, _ in shard.group_specs(model_whole.checked, model_whole.specs()):
        layout = layouts[decl.name]
        expected = np.asarray(shard.flatten(shard.part_at(params, decl.key, index), layout))
        part = shard.part_at(parts, decl.key, index)
        assert part.dtype == jnp.float32 and part.shape == (layout.total,)
        assert len(part.addressable_shards) == devices
        for piece in part.addressable_shards:
            np.testing.assert_array_equal(np.asarray(piece.data), expected[piece.index])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("devices", [1, 2, 3, 4])  # 3: every group padded
def test_random_parts_are_the_unsharded_draw(tmp_path, tied, devices):
    card = write_card(tmp_path, {**BASE, "num_key_value_heads": 2, "tie_word_embeddings": tied}, LLAMA3_SCALING,
                      repo="no-weights: random ones are drawn")
    lazy = load(card)
    parts = shard.parts_from_source(lazy, shard.group_layouts(lazy.checked, devices), mesh(devices))
    assert lazy.weight_source is not None  # built from where the weights come from, never read whole
    check_parts(load(card), parts, devices)


@pytest.fixture
def readers(monkeypatch) -> list:
    """Every SliceReader that building parts makes, from here on."""
    made = []

    class CountingReader(SliceReader):
        def __init__(self, files):
            super().__init__(files)
            made.append(self)

    monkeypatch.setattr(shard, "SliceReader", CountingReader)
    return made


@pytest.mark.parametrize("devices", [1, 3, 4])
def test_checkpoint_parts_read_each_range_once(checkpoint, readers, devices):
    lazy = load(checkpoint, weights=None)
    layouts = shard.group_layouts(lazy.checked, devices)
    parts = shard.parts_from_source(lazy, layouts, mesh(devices))
    check_parts(load(checkpoint, weights=None), parts, devices)
    model_bytes = 4 * sum(int(np.prod(spec.shape)) for spec in lazy.specs())  # stored in f32
    largest_group = 4 * max(layout.extent for layout in layouts.values())
    (reader,) = readers
    # Each device reads the rows that cover its range: a row more at either end, never the whole model.
    assert model_bytes <= reader.bytes_read <= model_bytes + devices * largest_group


def rows(count: int) -> list:
    rng = np.random.default_rng(7)
    examples = [Example.prompted(rng.integers(0, 211, 8).tolist(), rng.integers(0, 211, 6).tolist())
                for _ in range(4 * count)]
    return list(pack(examples, ROW))[:count]


def test_trained_parts_stay_parts_and_save_a_group_at_a_time(checkpoint, tmp_path):
    model = load(checkpoint, weights=None)
    parts, _ = jax_train.train(model, rows(2), optimizer=optax.adamw(1e-2), steps=1, mesh=mesh(2),
                               on_step=lambda step: None)
    assert isinstance(model.weight_source, shard.ShardedWeights) and model.weight_source.parts is parts
    assert parts["layers"][0].shape == (shard.group_layouts(model.checked, 2)["Layer"].total,)
    model.save_weights(tmp_path / "trained", dtype=jnp.float32, max_shard_size="100KB")
    assert isinstance(model.weight_source, shard.ShardedWeights)  # saving did not make it whole
    index = json.loads((tmp_path / "trained" / "model.safetensors.index.json").read_text())
    saved = {}
    for file in sorted(set(index["weight_map"].values())):
        saved.update(load_file(tmp_path / "trained" / file))
    whole = dict(model.named_weights())  # asked for whole: gathered, group by group
    assert model.weight_source is None and saved.keys() == whole.keys()
    for name, weight in whole.items():
        np.testing.assert_array_equal(saved[name].numpy(), np.asarray(weight), err_msg=name)


def test_parts_saved_untrained_give_transformers_the_same_logits(checkpoint, tmp_path):
    from transformers import LlamaForCausalLM

    model = load(checkpoint, weights=None)
    jax_train.train(model, [], optimizer=optax.adamw(1e-2), steps=0, mesh=mesh(3))  # built into parts, no step
    model.save_weights(tmp_path / "saved", dtype=jnp.float32, max_shard_size="100KB")
    saved = LlamaForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = load_hf(checkpoint)(input_ids=torch.from_numpy(TOKENS).long()).logits
        actual = saved.eval()(input_ids=torch.from_numpy(TOKENS).long()).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(model.logits(TOKENS)), expected.numpy(), rtol=1e-4, atol=1e-5)


def test_trained_parts_move_to_another_mesh_a_group_at_a_time(tmp_path):
    card = write_card(tmp_path, {**BASE, "num_key_value_heads": 2}, LLAMA3_SCALING, repo="no-weights: random")
    model = load(card)
    parts, _ = jax_train.train(model, rows(4), optimizer=optax.adamw(1e-2), steps=1, mesh=mesh(4),
                               on_step=lambda step: None)
    assert shard.parts_from_source(model, shard.group_layouts(model.checked, 4), mesh(4)) is parts  # kept as they are
    moved = shard.parts_from_source(model, shard.group_layouts(model.checked, 3), mesh(3))
    check_parts(model, moved, 3)  # against the trained weights, gathered whole


def evaluate_whole(model, batches) -> float:
    """evaluate on one device, the weights gathered or read whole first."""
    assert model.params and model.weight_source is None
    return jax_train.evaluate(model, batches)


@pytest.mark.parametrize("batch", [1, 2])
def test_evaluate_builds_parts_over_every_device_and_keeps_them(tmp_path, batch):
    card = write_card(tmp_path, {**BASE, "num_key_value_heads": 2}, LLAMA3_SCALING, repo="no-weights: random")
    held_out = rows(7)  # the last global batch of 4 x batch rows is filled with rows of zero weight
    model = load(card, batch=batch)
    loss = jax_train.evaluate(model, held_out)
    assert not model._params and isinstance(model.weight_source, shard.ShardedWeights)  # never read whole
    assert model.weight_source.mesh == Mesh(np.array(jax.devices()), ("data",))
    assert loss == pytest.approx(evaluate_whole(load(card, batch=batch), held_out), rel=1e-5)
    assert jax_train.evaluate(model, held_out) == loss  # again over the parts it kept


def test_evaluate_then_train_builds_the_parts_once(checkpoint, readers):
    model, batches = load(checkpoint, weights=None), rows(8)
    first_step = jax_train.evaluate(model, batches[:4])
    _, history = jax_train.train(model, batches, optimizer=optax.adamw(1e-2), steps=2, mesh=mesh(4),
                                 on_step=lambda step: None)
    assert len(readers) == 1  # train started from the parts evaluate built
    assert history.steps[0].loss == pytest.approx(first_step, rel=1e-5)
    trained = jax_train.evaluate(model, batches)
    assert isinstance(model.weight_source, shard.ShardedWeights) and not model._params
    assert trained == pytest.approx(evaluate_whole(model, batches), rel=1e-5)  # model.params gathers them


def test_evaluate_after_training_runs_over_the_training_mesh(tmp_path):
    card = write_card(tmp_path, {**BASE, "num_key_value_heads": 2}, LLAMA3_SCALING, repo="no-weights: random")
    model, batches = load(card, batch=2), rows(5)
    jax_train.train(model, batches, optimizer=optax.adamw(1e-2), steps=1, mesh=mesh(2), on_step=lambda step: None)
    trained = jax_train.evaluate(model, batches)
    assert model.weight_source.mesh == mesh(2) and not model._params
    assert trained == pytest.approx(evaluate_whole(model, batches), rel=1e-5)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("seq", [4096, 2050])
def test_the_fast_loss_equals_the_exact_one_without_the_rows_f32_logits(recompute, seq):
    """The fast numerics' loss over 4 chunks of 1024 positions (or 3 of 684, the last padded by two), in
    both forms (each chunk's gradients
    made in the forward, or each chunk recomputed in the backward, as train runs it with remat): the
    loss and both gradients of the exact form (f32 inputs: 1e-5), the loss alone undifferentiated too,
    and XLA's scratch memory for its gradient (the CPU's compiler) below one row's f32 logits, where the
    exact form's holds more than two."""
    from linnet.emit import prims_jax

    def chunked(*inputs):
        return prims_jax.cross_entropy_chunked(*inputs, recompute=recompute)

    keys = jax.random.split(jax.random.key(0), 4)
    width, vocab = 32, 500
    hidden = jax.random.normal(keys[0], (2, seq, width), jnp.float32)
    head = jax.random.normal(keys[1], (vocab, width), jnp.float32) * 0.1
    targets = jax.random.randint(keys[2], (2, seq), 0, vocab)
    weights = (jax.random.uniform(keys[3], (2, seq)) > 0.3).astype(jnp.float32)

    def value_and_grads(loss):
        return jax.jit(jax.value_and_grad(lambda h, w: loss(h, w, targets, weights), argnums=(0, 1)))

    exact, (exact_hidden, exact_head) = value_and_grads(prims_jax.cross_entropy)(hidden, head)
    fast, (fast_hidden, fast_head) = value_and_grads(chunked)(hidden, head)
    np.testing.assert_allclose(fast, exact, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(chunked)(hidden, head, targets, weights), exact, rtol=1e-5)
    for got, want in [(fast_hidden, exact_hidden), (fast_head, exact_head)]:
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    # In bf16 (the compute dtype), as close to the f32 gradients as autodiff of the exact form in bf16
    # (measured: 3.15e-3 and 3.08e-3 for the hidden states, 3.14e-3 and 3.01e-3 for the head).
    low = [x.astype(jnp.bfloat16) for x in (hidden, head)]
    _, exact_low = value_and_grads(prims_jax.cross_entropy)(*low)
    _, fast_low = value_and_grads(chunked)(*low)
    for got, baseline, want in zip(fast_low, exact_low, (exact_hidden, exact_head)):
        error = np.linalg.norm(got.astype(np.float32) - want) / np.linalg.norm(want)
        assert got.dtype == jnp.bfloat16
        assert error < 1.25 * np.linalg.norm(baseline.astype(np.float32) - want) / np.linalg.norm(want)
    logits_bytes = 2 * seq * vocab * 4

    def scratch(loss):
        return value_and_grads(loss).lower(hidden, head).compile().memory_analysis().temp_size_in_bytes

    # Measured: 49.2 MB (three rows of f32 logits) against 13.6 MB in one pass, 14.4 MB recomputed (a few
    # chunks' logits), which stays about so at twice the row (98.4 MB against 14.7 and 16.5 MB).
    if seq == 4096:  # (a row of three chunks holds about a row's logits in a few chunks': 8.9 MB against 8.2)
        assert scratch(prims_jax.cross_entropy) > 2 * logits_bytes and scratch(chunked) < logits_bytes


def test_the_recomputed_loss_carries_no_sum_through_a_loop():
    """The form train runs under remat sums the chunks' head gradients from a stack, with no loop carrying
    the sum: a carried sum (f32 or bf16) makes XLA keep every layer's gradient to the optimizer's update
    (docs/design/jax_speed.md). The one-pass form carries its sum (quicker without remat), which this reads
    too, so the walk sees loops."""
    from linnet.emit import prims_jax

    hidden, head = jnp.zeros((2, 4096, 32), jnp.bfloat16), jnp.zeros((500, 32), jnp.bfloat16)
    targets, weights = jnp.zeros((2, 4096), jnp.int32), jnp.ones((2, 4096))

    def carries(recompute):  # the number of carried values of each loop in the loss's value and gradients
        def loss(h, w):
            return prims_jax.cross_entropy_chunked(h, w, targets, weights, recompute=recompute)

        def walk(jaxpr):
            for equation in jaxpr.eqns:
                if equation.primitive.name == "scan":  # lax.map and lax.scan
                    yield equation.params["num_carry"]
                elif equation.primitive.name == "while":  # a loop that carries by nature
                    yield "while"
                for param in equation.params.values():
                    for inner in param if isinstance(param, (list, tuple)) else [param]:
                        inner = getattr(inner, "jaxpr", inner)
                        if hasattr(inner, "eqns"):
                            yield from walk(inner)

        return list(walk(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, head).jaxpr))

    assert carries(False) == [1]  # the head's gradient, summed chunk by chunk
    assert carries(True) == [0, 0]  # the loss's chunks, then their gradients: nothing carried
