"""linnet.jax.train over meshes of 1, 2 and 4 CPU devices (conftest.py asks
XLA for four): fully sharded training equals unsharded single-device
training on the same global batch, step by step (weights never read whole
are drawn into parts and stay parts; weights read whole come back whole); it
equals PyTorch's training from the same card; checkpoints resume exactly, on
another mesh too; and the trained weights load in transformers."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import Mesh

from hf_models import BASE, LLAMA3_SCALING, write_card
from linnet import nest
from linnet.jax import shard
from linnet.data.packing import Example, pack

jax_train = importlib.import_module("linnet.jax.train")  # the module: linnet.jax.train is also the function

ROW = 64
STEPS = 4
LR = 3e-3
EPS = 1e-6  # as tests/test_fully_shard.py: Adam's floor, so ~1e-9 gradients of unseen tokens do not take full steps
ROOT = Path(__file__).resolve().parents[1]


def rows(count: int, seed: int = 7) -> list:
    rng = np.random.default_rng(seed)
    examples = [Example.prompted(rng.integers(0, 211, rng.integers(3, 20)).tolist(),
                                 rng.integers(0, 211, rng.integers(2, 15)).tolist()) for _ in range(40 * count)]
    packed = list(pack(examples, ROW))
    assert len(packed) >= count
    return packed[:count]


@pytest.fixture(scope="module", params=["tied", "untied"])
def card(request, tmp_path_factory):
    """Tiny Llamas whose groups (211 x 80 embedding, 80-wide norms) split unevenly over the devices."""
    config = {**BASE, "num_key_value_heads": 2, "tie_word_embeddings": request.param == "tied"}
    return write_card(tmp_path_factory.mktemp("card"), config, LLAMA3_SCALING, repo="no-weights: random ones are drawn")


def load(card, batch: int = 1, dtype: str = "f32", numerics: str = "exact", weights="random"):
    return nest.load(card, backend="jax_source", entry="loss_packed", numerics=numerics, cast_dtype=True,
                     generics={"Batch": batch, "MaxSeq": ROW, "T": dtype}, weights=weights, seed=0)


def mesh(devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("data",))


def adamw():
    return optax.adamw(LR, eps=EPS, weight_decay=0.01)


def reference(card, batches: list, rows_a_step: int, dtype: str = "f32", steps: int = STEPS, optimizer=None):
    """Unsharded training on one device: the loss is the weighted mean over the step's rows."""
    model = load(card, dtype=dtype)
    loss_packed = model.functions["loss_packed"]
    optimizer = optimizer or adamw()

    def global_loss(params, chunk):
        losses = [loss_packed(params, *(jnp.asarray(a)[None] for a in row)) for row in chunk]
        weights = [jnp.sum(jnp.asarray(row[4])) for row in chunk]
        return sum(loss * w for loss, w in zip(losses, weights)) / sum(weights)

    @jax.jit
    def step(params, state, chunk):
        loss, gradients = jax.value_and_grad(global_loss)(params, chunk)
        updates, state = optimizer.update(gradients, state, params)
        return optax.apply_updates(params, updates), state, loss

    params, state, losses = model.params, optimizer.init(model.params), []
    for index in range(steps):
        chunk = [(r.tokens, r.targets, r.positions, r.segments, r.weights)
                 for r in batches[index * rows_a_step:(index + 1) * rows_a_step]]
        params, state, loss = step(params, state, chunk)
        losses.append(float(loss))
    return params, losses


def relative_error(actual, expected) -> float:
    """‖actual − expected‖ / ‖expected‖ over a whole tensor (tests/test_fully_shard.py says why not elementwise)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def flat_weights(params) -> dict:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def assert_same_weights(actual, expected, tolerance):
    actual, expected = flat_weights(actual), flat_weights(expected)
    assert actual.keys() == expected.keys()
    worst = max((relative_error(actual[k], expected[k]), k) for k in expected)
    assert worst[0] < tolerance, f"{worst[1]} differs by {worst[0]:.2e}"


@pytest.mark.parametrize("devices,batch,scan",
                         [(1, 1, False), (2, 2, False), (3, 1, False), (4, 1, False), (3, 1, True)])
def test_sharded_training_equals_one_device(card, devices, batch, scan):  # 3: every group padded
    batches = rows(STEPS * devices * batch)
    expected_params, expected_losses = reference(card, batches, devices * batch)
    model = load(card, batch=batch)
    params, history = jax_train.train(model, batches, optimizer=adamw(), steps=STEPS, mesh=mesh(devices),
                                      remat=False, scan_layers=scan, on_step=lambda step: None)
    # f32 throughout: only the order of the sums differs (per device, then reduce-scattered), and XLA's
    # fusions. The gradients of one step agree to 1e-6 (the untied card, one device, scanned layers
    # against the reference's loop); AdamW's per-element steps grow that to 2.1e-5 in the embedding by
    # the fourth step, hence 5e-5 for the weights.
    np.testing.assert_allclose([s.loss for s in history.steps], expected_losses, rtol=1e-5)
    assert params is model.weight_source.parts  # drawn straight into parts, and left so
    assert_same_weights(model.params, expected_params, 5e-5)  # gathered whole when asked


@pytest.mark.parametrize("shape,numerics,scan,remat", [((2, 2), "exact", False, True), ((4, 1), "exact", False, True),
                                                     ((2, 2), "fast", True, True), ((2, 2), "fast", False, False)])
def test_a_replicated_mesh_trains_as_one_device(card, shape, numerics, scan, remat):
    """A ("replicate", "shard") mesh (a machine a replica, across machines): each replica holds every part,
    split over its own devices, and the gradients are summed across replicas; also with the fast loss
    (without remat the one-pass form, whose own gradient rule must sum the head's across replicas), and
    the layers scanned."""
    batches = rows(STEPS * 4)
    expected_params, expected_losses = reference(card, batches, 4)
    model = load(card, numerics=numerics)
    two_axes = Mesh(np.array(jax.devices()[:4]).reshape(shape), ("replicate", "shard"))
    params, history = jax_train.train(model, batches, optimizer=adamw(), steps=STEPS, mesh=two_axes,
                                      scan_layers=scan, remat=remat, on_step=lambda step: None)
    np.testing.assert_allclose([s.loss for s in history.steps], expected_losses, rtol=1e-5)
    assert all(part.sharding.spec == jax.sharding.PartitionSpec("shard") for part in jax.tree.leaves(params))
    assert_same_weights(model.params, expected_params, 5e-5)


def test_weights_read_whole_stay_parts_after_training(card):
    """No device holds the whole model after train: weights read whole are split into parts, and
    left so (evaluate runs over their mesh); model.params gathers them whole only when asked."""
    model = load(card)
    groups = set(model.params)  # read whole
    params, _ = jax_train.train(model, rows(2), optimizer=adamw(), steps=1, mesh=mesh(2), on_step=lambda step: None)
    assert params is model.weight_source.parts and params.keys() == groups
    assert all(len(part.sharding.device_set) == 2 for part in jax.tree.leaves(params))
    assert np.isfinite(jax_train.evaluate(model, rows(2))) and model.weight_source.parts is params  # sharded
    assert model.params["layers"][0]["q_proj"].shape == (80, 80)


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_remat_recomputes_the_same_step(card, numerics):
    """With the fast numerics remat also recomputes the loss's chunks in the backward, where without it
    their gradients are made in the forward (prims_jax.cross_entropy_chunked): the steps agree."""
    batches = rows(STEPS * 4)
    kept = jax_train.train(load(card, numerics=numerics), batches, optimizer=adamw(), steps=STEPS, mesh=mesh(4),
                           remat=False, on_step=lambda step: None)[1]
    recomputed = jax_train.train(load(card, numerics=numerics), batches, optimizer=adamw(), steps=STEPS, mesh=mesh(4),
                                 remat=True, on_step=lambda step: None)[1]
    np.testing.assert_allclose([s.loss for s in recomputed.steps], [s.loss for s in kept.steps], rtol=1e-6)


def test_remat_binds_the_recomputed_loss(card):
    import inspect

    model = load(card, numerics="fast")
    layouts = shard.group_layouts(model.checked, shard.shards(mesh(2)))

    def loss_source(remat):
        loss_packed = jax_train._sharded_loss_packed(model, layouts, "data", remat)
        return inspect.getsource(loss_packed.__globals__["cross_entropy"])

    assert "def cross_entropy(hidden, head, targets, weights, recompute=True):" in loss_source(True)
    assert "def cross_entropy(hidden, head, targets, weights, recompute=False):" in loss_source(False)


def test_the_attention_kernel_chosen_on_the_host_trains_as_the_devices_choice(card, monkeypatch):
    """On a GPU `train` picks the fast attention's kernel from each step's rows on the host (no lax.switch in
    the step): one step function a kernel met, compiled when first met, and the same training. Here, as a
    GPU would, on the CPU, whose attention is XLA's whichever is chosen; tests/test_gpu_jax.py checks on a
    GPU that the host's choice is the switch's."""
    from linnet.emit import prims_jax

    rng = np.random.default_rng(3)
    one_document = list(pack([Example.prompted(rng.integers(0, 211, 30).tolist(), rng.integers(0, 211, 34).tolist())
                              for _ in range(4)], ROW))
    assert all(row.is_one_document() for row in one_document)
    batches = one_document[:2] + rows(2) + one_document[2:]  # steps of two rows: causal, packed, causal
    expected = jax_train.train(load(card, numerics="fast"), batches, optimizer=adamw(), steps=3, mesh=mesh(2),
                               on_step=lambda step: None)[1]
    chosen, compiled, step_function = [], [], jax_train._step_function
    monkeypatch.setattr(jax_train, "_attention_kernel",
                        lambda model, mesh, segments: chosen.append(prims_jax.rows_kernel(segments)) or chosen[-1])
    monkeypatch.setattr(jax_train, "_step_function", lambda *a, **k: compiled.append(a[-1]) or step_function(*a, **k))
    history = jax_train.train(load(card, numerics="fast"), batches, optimizer=adamw(), steps=3, mesh=mesh(2),
                              on_step=lambda step: None)[1]
    assert chosen == [0, 1, 0] and compiled == [0, 1]
    np.testing.assert_array_equal([s.loss for s in history.steps], [s.loss for s in expected.steps])
    model = load(card, numerics="fast")
    layouts = shard.group_layouts(model.checked, shard.shards(mesh(2)))
    import inspect

    attention = jax_train._sharded_loss_packed(model, layouts, "data", False, kernel=2).__globals__["attention"]
    assert "def attention(q, k, v, mask, kernel=2):" in inspect.getsource(attention)


def test_remat_wraps_the_layer_in_jax_checkpoint():
    def layer(x):
        return jnp.sin(x) * 2

    def jaxpr(remat):
        return str(jax.make_jaxpr(jax.grad(lambda x: shard.checkpointed(remat, layer, x)))(1.0))

    assert "checkpoint" in jaxpr(True) or "remat" in jaxpr(True)
    assert "checkpoint" not in jaxpr(False) and "remat" not in jaxpr(False)


def test_bf16_sharded_training_follows_bf16_reference(card):
    steps = 8
    batches = rows(4) * steps  # the same four rows each step: the loss falls far, and any error in the
    optimizer = optax.adamw(1e-2, eps=EPS)
    _, expected = reference(card, batches, 4, dtype="bf16", steps=steps, optimizer=optimizer)  # gradients shows
    history = jax_train.train(load(card, dtype="bf16", numerics="fast"), batches, optimizer=optimizer, steps=steps,
                              mesh=mesh(4), on_step=lambda step: None)[1]
    losses = [s.loss for s in history.steps]
    # Both compute in bf16 from f32 masters, but the reference sums the rows' bf16 weight
    # gradients in bf16 inside one backward, where the sharded step reduce-scatters each
    # device's in f32; and "fast" attention is another kernel than "exact". Each costs
    # about bf16's epsilon (2^-8) in the gradients, which Adam carries into the weights:
    # the losses stay within 3%, while they fall by far more than that.
    assert losses[-1] < 0.7 * losses[0]
    np.testing.assert_allclose(losses, expected, rtol=3e-2)


def test_jax_equals_pytorch_training_from_the_same_card(card, tmp_path):
    from linnet.torch.train import train as torch_train

    torch_model = nest.load(card, backend="torch", entry="loss_packed", numerics="exact", cast_dtype=True,
                            trainable=True, generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, weights="random", seed=0)
    torch_model.save_weights(tmp_path / "start", dtype=torch.float32)
    batches = rows(STEPS)
    optimizer = torch.optim.AdamW(torch_model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    expected = torch_train(torch_model, iter(batches), optimizer=optimizer, steps=STEPS, on_step=lambda step: None)
    jax_model = load(card, weights=tmp_path / "start")
    _, history = jax_train.train(jax_model, batches, optimizer=adamw(), steps=STEPS, mesh=mesh(1),
                                 on_step=lambda step: None)
    # Two frameworks' f32 kernels (matmul blocking, softmax, rsqrt) round differently.
    np.testing.assert_allclose([s.loss for s in history.steps], [s.loss for s in expected.steps], rtol=1e-4)


def test_checkpoint_resumes_exactly(card, tmp_path):
    batches = rows(STEPS * 4)
    straight = jax_train.train(load(card), batches, optimizer=adamw(), steps=STEPS, mesh=mesh(4),
                               on_step=lambda step: None)
    # Stopped after step 2 (saved at the end: no checkpoint_every), then the same call for all the steps.
    jax_train.train(load(card), batches, optimizer=adamw(), steps=2, mesh=mesh(4), on_step=lambda step: None,
                    checkpoint=tmp_path / "run")
    params, resumed = jax_train.train(load(card), batches, optimizer=adamw(), steps=STEPS, mesh=mesh(4),
                                      on_step=lambda step: None, checkpoint=tmp_path / "run")
    assert resumed.resumed_from == 2 and [s.step for s in resumed.steps] == [3, 4]
    np.testing.assert_array_equal([s.loss for s in resumed.steps], [s.loss for s in straight[1].steps[2:]])
    assert_same_weights(params, straight[0], 1e-7)


def test_layers_are_scanned_as_one_stacked_array(card, monkeypatch):
    """With an elementwise optimizer the step runs the layers by lax.scan over one [Layers, part] array
    (what over_layers is handed), and learns what the loop of one part a layer learns; the parts come
    back a flat array a layer. Adafactor (its moments factored per array) keeps the loop."""
    handed = []
    over_layers = shard.over_layers
    monkeypatch.setattr(shard, "over_layers",
                        lambda one_layer, x, layers: handed.append(layers) or over_layers(one_layer, x, layers))
    batches = rows(STEPS * 2)
    scanned_model = load(card)
    scanned = jax_train.train(scanned_model, batches, optimizer=adamw(), steps=STEPS, mesh=mesh(2), scan_layers=True,
                              on_step=lambda step: None)
    layers = scanned[0]["layers"]
    assert [getattr(handed_layers, "shape", None) for handed_layers in handed] == [(2, layers[0].shape[0] // 2)]
    assert isinstance(layers, list) and all(part.ndim == 1 and len(part.sharding.device_set) == 2 for part in layers)
    handed.clear()
    looped_model = load(card)
    looped = jax_train.train(looped_model, batches, optimizer=adamw(), steps=STEPS, mesh=mesh(2), scan_layers=False,
                             on_step=lambda step: None)
    assert handed and all(isinstance(layers, list) for layers in handed)
    np.testing.assert_allclose([s.loss for s in scanned[1].steps], [s.loss for s in looped[1].steps], rtol=1e-5)
    assert_same_weights(scanned_model.params, looped_model.params, 5e-5)


def test_only_optimizers_that_update_each_layer_alike_are_scanned():
    parts = {"embedding": jnp.zeros(8), "layers": [jnp.zeros(8), jnp.zeros(8), jnp.zeros(8)]}
    assert jax_train.layers_separable(adamw(), parts)
    assert jax_train.layers_separable(optax.chain(optax.clip(1.0), optax.sgd(0.1, momentum=0.9)), parts)
    assert not jax_train.layers_separable(optax.adafactor(1e-2), parts)  # factored moments: rows of the stack
    assert not jax_train.layers_separable(optax.lamb(1e-2), parts)  # a trust ratio an array
    assert jax_train.layers_separable(optax.chain(optax.clip_by_global_norm(1.0), adamw()), parts)  # one norm of all


def test_a_checkpoint_resumes_in_the_other_layer_form(card, tmp_path):
    """A checkpoint holds an array a layer whichever form the run held (so those written before the
    layers were scanned load): saved by a loop, resumed scanned, and the other way, the losses of one run."""
    batches = rows(STEPS * 2)
    straight = jax_train.train(load(card), batches, optimizer=adamw(), steps=STEPS, mesh=mesh(2), scan_layers=False,
                               on_step=lambda step: None)[1]
    for first, then in [(False, True), (True, False)]:
        folder = tmp_path / f"run-{first}"
        jax_train.train(load(card), batches, optimizer=adamw(), steps=2, mesh=mesh(2), scan_layers=first,
                        on_step=lambda step: None, checkpoint=folder)
        resumed = jax_train.train(load(card), batches, optimizer=adamw(), steps=STEPS, mesh=mesh(2), scan_layers=then,
                                  on_step=lambda step: None, checkpoint=folder)[1]
        assert resumed.resumed_from == 2
        np.testing.assert_allclose([s.loss for s in resumed.steps], [s.loss for s in straight.steps[2:]], rtol=1e-5)


def test_checkpoint_resumes_on_another_mesh(card, tmp_path):
    """Saved on 4 devices of 3 rows, resumed on 3 devices of 4: the same global batch, every part re-padded,
    the optimizer's moments with them, and the data position counted in rows, not steps."""
    batches = rows(12 * 5)
    straight = jax_train.train(load(card, batch=3), batches, optimizer=adamw(), steps=5, mesh=mesh(4),
                               on_step=lambda step: None)
    jax_train.train(load(card, batch=3), batches, optimizer=adamw(), steps=2, mesh=mesh(4), on_step=lambda step: None,
                    checkpoint=tmp_path / "run")
    jax_train.train(load(card, batch=4), batches, optimizer=adamw(), steps=4, mesh=mesh(3), on_step=lambda step: None,
                    checkpoint=tmp_path / "run")
    params, last = jax_train.train(load(card, batch=3), batches, optimizer=adamw(), steps=5, mesh=mesh(4),
                                   on_step=lambda step: None, checkpoint=tmp_path / "run")
    assert last.resumed_from == 4
    np.testing.assert_allclose(last.steps[0].loss, straight[1].steps[4].loss, rtol=1e-5)
    assert_same_weights(params, straight[0], 1e-5)


def test_checkpoints_of_the_other_framework_are_refused(card, tmp_path):
    from linnet.torch.train import train as torch_train

    batches = rows(2)
    jax_train.train(load(card), batches, optimizer=adamw(), steps=1, mesh=mesh(1), on_step=lambda step: None,
                    checkpoint=tmp_path / "jax")
    torch_model = nest.load(card, entry="loss_packed", cast_dtype=True, trainable=True, weights="random",
                            generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"})
    with pytest.raises(ValueError, match="written by a JAX run; a PyTorch run resumes only from its own"):
        torch_train(torch_model, iter(batches), optimizer=torch.optim.AdamW(torch_model.parameters()), steps=2,
                    checkpoint=tmp_path / "jax", on_step=lambda step: None)
    torch_train(torch_model, iter(batches), optimizer=torch.optim.AdamW(torch_model.parameters()), steps=1,
                checkpoint=tmp_path / "torch", on_step=lambda step: None)
    with pytest.raises(ValueError, match="written by a PyTorch run; a JAX run resumes only from its own"):
        jax_train.train(load(card), batches, optimizer=adamw(), steps=2, mesh=mesh(1), checkpoint=tmp_path / "torch")


def test_bf16_optimizer_state_is_checkpointed(card, tmp_path):
    optimizer = optax.adamw(LR, eps=EPS, mu_dtype=jnp.bfloat16)
    batches = rows(3 * 2)
    straight = jax_train.train(load(card), batches, optimizer=optimizer, steps=3, mesh=mesh(2),
                               on_step=lambda step: None)[1]
    jax_train.train(load(card), batches, optimizer=optimizer, steps=2, mesh=mesh(2), on_step=lambda step: None,
                    checkpoint=tmp_path / "run")
    resumed = jax_train.train(load(card), batches, optimizer=optimizer, steps=3, mesh=mesh(2),
                              on_step=lambda step: None, checkpoint=tmp_path / "run")[1]
    assert resumed.steps[0].loss == straight.steps[2].loss


def test_corrupt_checkpoint_is_passed_over(card, tmp_path):
    batches = rows(STEPS)
    jax_train.train(load(card), batches, optimizer=adamw(), steps=2, mesh=mesh(1), on_step=lambda step: None,
                    checkpoint=tmp_path / "run", checkpoint_every=1)
    state = tmp_path / "run" / "step-00000002" / "array-00000.npy"
    state.write_bytes(state.read_bytes()[:-100])  # truncated, as by a full disk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, history = jax_train.train(load(card), batches, optimizer=adamw(), steps=3, mesh=mesh(1),
                                     on_step=lambda step: None, checkpoint=tmp_path / "run", checkpoint_every=100)
    assert history.resumed_from == 1
    assert any("step-00000002" in str(w.message) and "truncated" in str(w.message) for w in caught)


def test_trained_weights_load_in_transformers(card, tmp_path):
    from transformers import LlamaForCausalLM

    model = load(card)
    batches = rows(STEPS * 2)
    jax_train.train(model, batches, optimizer=adamw(), steps=STEPS, mesh=mesh(2), on_step=lambda step: None)
    model.save_weights(tmp_path / "trained", dtype=jnp.float32)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(3)
    document = Example.prompted(rng.integers(0, 211, 12).tolist(), rng.integers(0, 211, 9).tolist())
    (alone,) = pack([document], ROW)  # one document, then padding of zero weight
    span = slice(0, alone.filled)
    with torch.no_grad():
        logits = hf(torch.from_numpy(alone.tokens[span]).long()[None]).logits[0].double()
    losses = torch.nn.functional.cross_entropy(logits, torch.from_numpy(alone.targets[span]).long(), reduction="none")
    weights = torch.from_numpy(alone.weights[span]).double()
    expected = float((losses * weights).sum() / weights.sum())
    assert jax_train.evaluate(model, [alone]) == pytest.approx(expected, rel=1e-4)


def test_errors_name_the_problem(card, tmp_path):
    batches = rows(4)
    two_axes = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match=r"of two named \('replicate', 'shard'\) .* got axes \('data', 'model'\)"):
        jax_train.train(load(card), batches, optimizer=adamw(), steps=1, mesh=two_axes)
    uncast = nest.load(card, backend="jax_source", entry="loss_packed",
                       generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, weights="random")
    with pytest.raises(ValueError, match="cast_dtype=True"):
        jax_train.train(uncast, batches, optimizer=adamw(), steps=1, mesh=mesh(1))
    model = load(card)
    with pytest.raises(ValueError, match="ran out at step 2 of 3"):
        jax_train.train(model, batches, optimizer=adamw(), steps=3, mesh=mesh(4), on_step=lambda step: None)
    assert model.params["layers"][0]["q_proj"].shape == (80, 80)  # whole weights again, trained one step
    assert np.isfinite(jax_train.evaluate(model, batches))

    def evaluate_while_training(step):
        jax_train.evaluate(model, batches)

    with pytest.raises(RuntimeError, match="evaluate: test-llama's weights are parts of a running linnet.jax.train"):
        jax_train.train(model, batches, optimizer=adamw(), steps=1, mesh=mesh(4), on_step=evaluate_while_training)
    outside = rows(1)[0]
    outside.tokens = outside.tokens.copy()
    outside.tokens[5] = 999
    with pytest.raises(ValueError, match=r"step 1, row 0: tokens\[5\] = 999 is not a token id .* 211"):
        jax_train.train(load(card), [outside], optimizer=adamw(), steps=1, mesh=mesh(1))
    with pytest.raises(ValueError, match=r"evaluate, row 0: tokens\[5\] = 999"):
        jax_train.evaluate(load(card), [outside])
    with pytest.raises(ValueError, match="MaxSeq 64"):
        jax_train.train(load(card), list(pack([Example.prompted([1, 2], [3])], 32)), optimizer=adamw(), steps=1,
                        mesh=mesh(1))


def test_sft_jax_example_runs_offline(tmp_path):
    """At the path the first README gave it (examples/07-fsdp/, a link to examples/sft/)."""
    command = [sys.executable, "examples/07-fsdp/sft_jax.py", "--card", "tiny-llama", "--data",
               "examples/sft/data/tasks.jsonl", "--tokens", "256", "--steps", "5", "--lr", "3e-3",
               "--out", str(tmp_path / "weights")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "positions/s on 4 devices" in result.stdout and "held-out loss" in result.stdout
    assert (tmp_path / "weights" / "model.safetensors").exists()


def test_an_optimizer_state_not_shaped_as_the_parts_trains_and_resumes(card, tmp_path):
    optimizer = optax.adafactor(1e-2)  # on flat parts: placeholder statistics of shape (1,) beside each moment
    batches = rows(3 * 4)
    straight = jax_train.train(load(card), batches, optimizer=optimizer, steps=3, mesh=mesh(4),
                               on_step=lambda step: None)[1]
    jax_train.train(load(card), batches, optimizer=optimizer, steps=2, mesh=mesh(4), on_step=lambda step: None,
                    checkpoint=tmp_path / "run")
    resumed = jax_train.train(load(card), batches, optimizer=optimizer, steps=3, mesh=mesh(4),
                              on_step=lambda step: None, checkpoint=tmp_path / "run")[1]
    assert resumed.steps[0].loss == straight.steps[2].loss
