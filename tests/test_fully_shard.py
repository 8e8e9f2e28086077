"""fully_shard over Gloo at world sizes 1 to 4: training equals unsharded
single-process training on the same global batch, step by step."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from distributed import run
from hf_models import write_tied_card, write_untied_card
from linnet import nest
from linnet.data.packing import Example, pack
from linnet.torch.train import row_tensors

ROW = 64
STEPS = 5
LR = 3e-3
# AdamW's floor under sqrt(v): 1e-8 lets ~1e-9 gradients of unseen tokens take full steps (see relative_error)
EPS = 1e-6


def rows(world: int) -> list:
    """STEPS global batches of `world` rows each, rank-strided: rows[step * world + rank]."""
    rng = np.random.default_rng(7)
    examples = [Example.prompted(rng.integers(0, 211, rng.integers(3, 20)).tolist(),
                                 rng.integers(0, 211, rng.integers(2, 15)).tolist())
                for _ in range(60 * world)]
    packed = list(pack(examples, ROW))
    assert len(packed) >= STEPS * world
    return packed[: STEPS * world]


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    """A tiny tied Llama whose groups (211 x 80 embedding, 80-wide norms) split unevenly over 3 and 4 ranks."""
    return write_tied_card(tmp_path_factory.mktemp("card"))


def load(card, batch: int = 1, compile: str | None = None, device: str = "cpu"):
    return nest.load(card, numerics="exact", generics={"Batch": batch, "MaxSeq": ROW, "T": "f32"}, device=device,
                     cast_dtype=True, trainable=True, weights="random", seed=0, compile=compile, entry="loss_packed")


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """‖actual − expected‖ / ‖expected‖ over a whole tensor. Element by element
    would be the wrong bar: AdamW divides each gradient by its own running
    magnitude, so an element whose gradient is ~1e-9 (a token no row holds)
    moves by a full learning-rate step whatever rounding its gradient got from
    the order of the sums, which differs between one process and several."""
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def reference(card, world: int, device: str = "cpu") -> tuple[list[float], dict]:
    """Unsharded, one process: each step the whole global batch (world rows) as one batch. The weights
    come back on the CPU."""
    model = load(card, batch=world, device=device)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    data = rows(world)
    losses = []
    for step in range(STEPS):
        batch = data[step * world:(step + 1) * world]
        stack = row_tensors(batch, device)
        loss = model.loss_packed(*stack)  # the token-weighted mean over the global batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {name: t.detach().cpu().clone() for name, t in model.named_weights()}


def sharded_training(rank: int, world: int, card, compile: str | None, recompute: str, prefetch: int = 1,
                     reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True):
    from linnet.torch import fully_shard
    from linnet.torch.shard import gathered_weights
    from linnet.torch.train import train

    model = fully_shard(load(card, compile=compile), recompute=recompute, prefetch=prefetch, reduce_dtype=reduce_dtype,
                        reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    history = train(model, iter(rows(world)[rank::world]), optimizer=optimizer, steps=STEPS, on_step=lambda s: None)
    weights = {name: tensor.numpy() for name, tensor in gathered_weights(model, torch.float32)}
    return [s.loss for s in history.steps], weights, model.sharding.layouts


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_training_equals_single_process(card, world):
    expected_losses, expected_weights = reference(card, world)
    results = run(sharded_training, world, card, None, "gather", timeout=300)
    for losses, weights, _ in results:
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        assert weights.keys() == expected_weights.keys()
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name].numpy()) < 1e-5, name
    if world > 2:  # the groups do not split evenly: the parts carry padding
        assert any(layout.total > layout.extent for layout in results[0][2].values())


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """The same Llama with a head of its own: sharded, its embedding is looked up, not gathered."""
    return write_untied_card(tmp_path_factory.mktemp("untied"))


@pytest.mark.parametrize("world, compile", [(2, None), (3, None), (4, None), (2, "inductor")])
def test_a_looked_up_embedding_trains_as_single_process(untied, world, compile):
    """The table's rows are summed in another order than one process sums them (a ~3e-7 relative
    difference in its gradient: the next test), which AdamW's per-element steps grow to ~1.6e-5 over
    five steps at world 3. The table's difference changes the next steps' activations, so the layers'
    weights differ too: v_proj's by 1.7e-5 at world 4 on an AMD EPYC's CPU kernels. All held to 5e-5."""
    expected_losses, expected_weights = reference(untied, world)
    for losses, weights, _ in run(sharded_training, world, untied, compile, "gather", timeout=600):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name].numpy()) < 5e-5, name


def table_gradient(rank: int, world: int, card) -> np.ndarray:
    """This rank's part of the table's gradient after one step of linnet.torch.train (the optimizer is stopped)."""
    from linnet.torch import fully_shard
    from linnet.torch.train import train

    model = fully_shard(load(card))
    captured = []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            captured.append(next(iter(model.parameters())).grad.detach().clone())  # the embedding's part: first

    train(model, iter(rows(world)[rank::world]), optimizer=Capture(list(model.parameters()), lr=0.0), steps=1,
          on_step=lambda s: None)
    return captured[0].numpy()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_looked_up_tables_gradient_is_single_process_one(untied, world):
    model = load(untied, batch=world)
    batch = rows(world)[:world]
    model.loss_packed(*row_tensors(batch)).backward()
    expected = dict(model.named_weights())["model.embed_tokens.weight"].grad.reshape(-1).numpy()
    parts = np.concatenate(run(table_gradient, world, untied, timeout=300))[:expected.size]
    assert relative_error(parts, expected) < 1e-6


def looked_up(rank: int, world: int, rows: int, width: int, part_size: int):
    """`lookup` on a table of rows x width laid out in parts of part_size: each rank's rows, and its
    part's gradient, against what the whole table gives."""
    import torch.distributed as dist

    from linnet.sharding.schedule import Schedule
    from linnet.sharding.layout import GroupLayout
    from linnet.torch.collectives import Sharding, _lookup

    layout = GroupLayout("Embedding", ("embed_tokens",), ((rows, width),), (0,), world * part_size, part_size)
    sharding = Sharding(dist.group.WORLD.group_name, rank, world, {"Embedding": layout}, "gather", torch.float32,
                        torch.float32, Schedule())
    table = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width) + 1
    flat = torch.cat([table.reshape(-1), torch.zeros(layout.total - rows * width)])
    part = flat[rank * part_size:(rank + 1) * part_size].clone().requires_grad_()
    tokens = [torch.tensor([[r % rows, rows - 1, rows - 1, 0]], dtype=torch.int32) for r in range(world)]  # repeats
    scales = [torch.randn(1, 4, width, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    found = _lookup(sharding, tokens[rank], part, "Embedding", "embed_tokens")
    (found * scales[rank]).sum().backward()
    whole = table.clone().requires_grad_()
    sum(((whole[t.long()] * g).sum() for t, g in zip(tokens, scales))).backward()  # every rank's loss
    expected = torch.cat([whole.grad.reshape(-1) / world, torch.zeros(layout.total - rows * width)])
    return (torch.equal(found, table[tokens[rank].long()]),
            torch.allclose(part.grad, expected[rank * part_size:(rank + 1) * part_size], atol=1e-6))


@pytest.mark.parametrize("rows, width, part_size", [(4, 3, 5), (3, 4, 8)])
def test_lookup_reads_rows_across_parts_and_returns_the_mean_gradient(rows, width, part_size):
    """Parts that end mid-row (4 x 3 in parts of 5), and a part of padding alone (3 x 4 in parts of 8, at
    3 ranks the last holds none of the table); repeated tokens; the gradient of the mean of the ranks' losses."""
    assert run(looked_up, 3, rows, width, part_size) == [(True, True)] * 3


@functools.cache
def eager_gather_training(card):
    return run(sharded_training, 2, card, None, "gather", timeout=300)


@pytest.mark.parametrize("compile, recompute", [("inductor", "gather"), (None, "full"), (None, "matmuls"),
                                               ("inductor", "matmuls")])
def test_compiled_and_other_recompute_policies_equal_eager_gather(card, compile, recompute):
    eager = eager_gather_training(card)
    other = run(sharded_training, 2, card, compile, recompute, timeout=600)
    np.testing.assert_allclose(other[0][0], eager[0][0], rtol=1e-5)
    for name, tensor in other[0][1].items():
        assert relative_error(tensor, eager[0][1][name]) < 1e-5, name


@pytest.mark.parametrize("compile", [None, "inductor"])
@pytest.mark.parametrize("world", [1, 2])
def test_gathers_kept_for_the_backward_train_as_gathered_again(card, world, compile):
    """reshard_after_forward=False keeps each layer's gathered weights for its backward: the same training,
    under every recompute policy (the same arithmetic: eager, to the bit)."""
    for recompute in ("gather", "matmuls", "full"):
        again, kept = (run(sharded_training, world, card, compile, recompute, 1, torch.float32, reshard,
                           timeout=600)[0] for reshard in (True, False))
        np.testing.assert_allclose(kept[0], again[0], rtol=0 if compile is None else 1e-6)
        for name, tensor in kept[1].items():
            assert relative_error(tensor, again[1][name]) <= (0 if compile is None else 1e-6), (recompute, name)


def gathers_in_the_backward(rank: int, world: int, card, compile: str | None, recompute: str, reshard: bool) -> int:
    """How many gathers (on one rank, casts) one step's backward runs: counted as dispatched in eager code, as
    calls in inductor's code of the backward compiled. No prefetch: the tiny card's two layers are the last
    prefetch + 1, whose gathers the schedule keeps either way."""
    import re

    from torch._inductor.utils import run_and_get_code
    from torch.utils._python_dispatch import TorchDispatchMode

    from linnet.torch import fully_shard

    model = fully_shard(load(card, compile=compile), recompute=recompute, prefetch=0, reshard_after_forward=reshard)
    data = rows(world)[rank]
    inputs = row_tensors(data)
    gathers = ("linnet.all_gather.default", "linnet.cast_into_sink.default")
    if compile:
        _, (_, backward) = run_and_get_code(lambda: model.loss_packed(*inputs).backward())
        return len(re.findall(r"torch\.ops\.linnet\.(all_gather|cast_into_sink)\.default\(", backward))

    class Count(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.seen += str(func) in gathers
            return func(*args, **(kwargs or {}))

    loss = model.loss_packed(*inputs)
    with Count():
        loss.backward()
    return Count.seen


@pytest.mark.parametrize("compile", [None, "inductor"])
@pytest.mark.parametrize("world", [1, 2])
def test_gathers_kept_for_the_backward_are_not_gathered_again(card, world, compile):
    for recompute in ("gather", "matmuls", "full"):
        again, kept = (run(gathers_in_the_backward, world, card, compile, recompute, reshard, timeout=600)[0]
                       for reshard in (True, False))
        assert again > 0 and kept == 0, (recompute, again, kept)  # (a layer compiled once is one call in the code)


def products_policy_decisions(rank: int, world: int, card, recompute: str) -> tuple[dict, set]:
    """What the "matmuls" policy decided for each op of one step's forward, and the ops its backward ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from linnet.torch import fully_shard
    from linnet.torch import recompute as policies

    decisions, backward_ops = {}, set()
    policy = policies._products_policy

    def recording(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        decisions.setdefault(str(func), set()).add(decision.name)
        return decision

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            backward_ops.add(str(func))
            return func(*args, **(kwargs or {}))

    policies._products_policy = recording
    model = fully_shard(load(card), recompute=recompute)
    data = rows(world)[rank]
    loss = model.loss_packed(*row_tensors(data))
    with Seen():
        loss.backward()
    return decisions, backward_ops


@pytest.mark.parametrize("world", [1, 2])
def test_the_matmuls_policy_keeps_products_and_recomputes_the_rest(card, world):
    forward, backward_ops = run(products_policy_decisions, world, card, "matmuls", timeout=300)[0]
    for product in ("aten.mm.default", "aten.bmm.default"):  # the projections; exact attention's two products
        assert forward[product] == {"MUST_SAVE"}, product
    for pointwise in ("aten.mul.Tensor", "aten.rsqrt.default", "aten.silu.default", "aten._softmax.default"):
        assert forward[pointwise] == {"PREFER_RECOMPUTE"}, pointwise
    gather = "linnet.all_gather.default"
    assert forward[gather] == {"PREFER_RECOMPUTE"}  # on one rank too, where a gather is a cast
    assert {"aten.silu.default", "aten.rsqrt.default"} <= backward_ops  # the backward ran the pointwise work again
    _, kept_all = run(products_policy_decisions, world, card, "gather", timeout=300)[0]
    assert not {"aten.silu.default", "aten.rsqrt.default"} & kept_all  # which "gather" keeps


def backward_products(rank: int, world: int, card, recompute: str) -> tuple[int, int]:
    """The matrix products inductor's code runs in one compiled step's forward and in its backward, a
    layer compiled once (the default on one rank)."""
    import os
    import re

    from torch._inductor.utils import run_and_get_code

    from linnet.torch import fully_shard

    os.environ.pop("LINNET_COMPILE_LAYERS_ONCE", None)
    model = fully_shard(load(card, compile="inductor"), recompute=recompute)
    assert model.layer_region
    data = rows(world)[rank]
    _, (forward, backward) = run_and_get_code(
        lambda: model.loss_packed(*row_tensors(data)).backward())
    return tuple(len(re.findall(r"extern_kernels\.b?mm\(", code)) for code in (forward, backward))


def test_compiled_the_matmuls_policy_recomputes_no_product(card):
    """On one rank a layer is compiled once, the region around the layer's checkpoint: "matmuls"'s policy
    sees the layer's own ops, so its backward runs the products that "gather"'s runs, where "full"'s runs
    the forward's products again (with the checkpoint around the region, "matmuls" recomputed them all)."""
    counts = {recompute: run(backward_products, 1, card, recompute, timeout=600)[0]
              for recompute in ("gather", "matmuls", "full")}
    assert counts["matmuls"] == counts["gather"]
    assert counts["full"][1] > counts["matmuls"][1]


def schedules(rank: int, world: int, card, configurations: list) -> list:
    """sharded_training under each (compile, recompute, prefetch), one after another in the same ranks.
    One thread a rank: inductor's CPU kernels then add each embedding gradient in one order."""
    torch.set_num_threads(1)
    return [sharded_training(rank, world, card, *configuration) for configuration in configurations]


@pytest.mark.parametrize("world", [2, 3])
def test_prefetch_depths_train_alike_when_compiled(card, world):
    """The schedule moves communication, never arithmetic: every prefetch depth trains alike. Not to the
    bit: two compiled ranks on the CPU differ run to run in a gradient's last bits, at any one depth too,
    which Adam's steps grow (docs/design/schedule.md)."""
    depths = [("inductor", "gather", prefetch) for prefetch in (0, 1, 2)] + [("inductor", "full", 2)]
    expected_losses, expected_weights = reference(card, world)
    runs = run(schedules, world, card, depths, timeout=1200)[0]
    (losses, weights, _), others = runs[0], runs[1:]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for name, tensor in weights.items():
        assert relative_error(tensor, expected_weights[name].numpy()) < 1e-5, name
    for (other_losses, other_weights, _), configuration in zip(others, depths[1:]):
        np.testing.assert_allclose(other_losses, losses, rtol=1e-6, err_msg=str(configuration))
        for name, tensor in other_weights.items():
            assert relative_error(tensor, weights[name]) < 1e-5, (configuration, name)


def test_prefetched_training_at_world_4_equals_single_process(card):
    expected_losses, expected_weights = reference(card, 4)
    for losses, weights, _ in run(sharded_training, 4, card, "inductor", "gather", 2, timeout=900):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name].numpy()) < 1e-5, name


def test_bf16_reduction_learns_what_f32_does(card):
    """Gradients reduce-scattered in bf16 (half the bytes) follow the f32 loss curve: the tiny
    card's 5 steps at world 2 agree within 1e-3 relative, and are not the same numbers."""
    f32 = run(sharded_training, 2, card, None, "gather", 1, torch.float32, timeout=300)[0][0]
    bf16 = run(sharded_training, 2, card, None, "gather", 1, torch.bfloat16, timeout=300)[0][0]
    np.testing.assert_allclose(bf16, f32, rtol=1e-3)
    assert bf16 != f32


def own_loop(rank: int, world: int, card):
    """A user's loop: each rank its own row, loss.backward(), optimizer.step()."""
    from linnet.torch import fully_shard
    from linnet.torch.shard import gathered_weights

    model = fully_shard(load(card))
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    data = rows(world)
    for step in range(STEPS):
        row = data[step * world + rank]
        model.loss_packed(*row_tensors(row)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: tensor.numpy() for name, tensor in gathered_weights(model, torch.float32)}


def mean_of_the_ranks_losses(card, world: int) -> dict:
    """One process, each step the mean of `world` rows' losses, each row its own call: the weights."""
    model = load(card)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    data = rows(world)
    for step in range(STEPS):
        losses = [model.loss_packed(*row_tensors(row))
                  for row in data[step * world:(step + 1) * world]]
        (sum(losses) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: tensor.detach() for name, tensor in model.named_weights()}


def test_a_users_own_loop_trains_on_the_mean_of_the_ranks_losses(card):
    """As with DDP and FSDP2, the gradient is that of the mean of the ranks' losses."""
    expected = mean_of_the_ranks_losses(card, 2)
    for weights in run(own_loop, 2, card, timeout=300):
        for name, tensor in weights.items():
            assert relative_error(tensor, expected[name].numpy()) < 1e-5, name


def state_bytes(model, optimizer) -> int:
    """Bytes this rank holds for parameters, their gradients and the optimizer's state, measured."""
    total = 0
    for param in model.parameters():
        total += param.numel() * param.element_size()
        if param.grad is not None:
            total += param.grad.numel() * param.grad.element_size()
        for value in optimizer.state[param].values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total


def one_step(model):
    """One AdamW step on the same row in every rank: the mean of the ranks' losses is that row's."""
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, eps=EPS)
    row = rows(1)[0]
    loss = model.loss_packed(*row_tensors(row))
    loss.backward()
    optimizer.step()
    return optimizer


def memory_and_export(rank: int, world: int, card, folder: str):
    from linnet.torch import fully_shard

    model = fully_shard(load(card))
    held = state_bytes(model, one_step(model))
    model.save_weights(folder, dtype=torch.float32)
    return held


def test_each_rank_holds_a_world_th_and_saved_weights_load_in_transformers(card, tmp_path):
    unsharded = load(card)
    whole = state_bytes(unsharded, one_step(unsharded))
    for world in (2, 4):
        held = run(memory_and_export, world, card, str(tmp_path / f"w{world}"), timeout=300)
        for rank_bytes in held:  # padding to the alignment adds a little over 1/world
            assert whole / world <= rank_bytes <= whole / world * 1.02 + 4 * 16 * 4 * world * 3
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "w2", attn_implementation="eager")
    # the sharded model after its one step, against the same step taken unsharded
    tokens = torch.from_numpy(rows(1)[0].tokens)[None].long()
    expected = dict(unsharded.named_weights())
    for name, tensor in reloaded.state_dict().items():
        if name in expected:
            assert relative_error(tensor.numpy(), expected[name].detach().numpy()) < 1e-5, name
    logits = nest.load(card, numerics="exact", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"},
                       weights=tmp_path / "w2", entry="logits").logits(tokens)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, logits, rtol=1e-5, atol=1e-5)


def calls_fully_shard_badly(rank: int, world: int, card):
    from linnet.torch import fully_shard

    errors = []
    for attempt in (lambda: fully_shard(fully_shard(load(card))),
                    lambda: fully_shard(nest.load(card, generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"},
                                                  weights="random")),
                    lambda: fully_shard(load(card), recompute="some")):
        try:
            attempt()
        except (RuntimeError, ValueError) as error:
            errors.append(str(error))
    return errors


def test_clear_errors(card):
    from linnet.torch import fully_shard
    from linnet.sharding.layout import group_layouts

    with pytest.raises(RuntimeError, match="needs a process group"):
        fully_shard(load(card))
    twice, uncast, policy = run(calls_fully_shard_badly, 1, card)[0]
    assert "already sharded" in twice and "cast_dtype=True" in uncast
    assert 'recompute must be "gather", "matmuls" or "full"' in policy
    with pytest.raises(ValueError, match=r"group \w+ has \d+ elements: split over 100000 ranks into parts of 16 \(a "
                                         r"multiple of 16\), more than half of its buffer would be padding"):
        group_layouts(load(card).checked, 100000, 16)


def test_a_token_outside_the_vocabulary_is_named():
    from linnet.torch.train import evaluate, train

    model = nest.load("tiny-llama", entry="loss_packed", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"},
                      cast_dtype=True, trainable=True)
    outside = rows(1)[0]
    outside.targets = outside.targets.copy()
    outside.targets[3] = 512  # tiny-llama's vocabulary is 0..511
    with pytest.raises(ValueError, match=r"rank 0: step 1: targets\[3\] = 512 is not a token id .* 512"):
        train(model, [outside], optimizer=torch.optim.AdamW(model.parameters()), steps=1, on_step=lambda step: None)
    with pytest.raises(ValueError, match=r"rank 0: evaluate, row 0: targets\[3\] = 512"):
        evaluate(model, [outside])


def one_bad_rank(rank: int, world: int, card, where: str):
    """train or evaluate where only the last rank's first row holds a token outside the vocabulary."""
    from linnet.torch import fully_shard
    from linnet.torch.train import evaluate, train

    model = fully_shard(load(card))
    mine = rows(world)[rank::world]
    if rank == world - 1:
        mine[0].targets = mine[0].targets.copy()
        mine[0].targets[3] = 10**6
    try:
        if where == "train":
            train(model, iter(mine), optimizer=torch.optim.AdamW(list(model.parameters())), steps=STEPS,
                  on_step=lambda step: None)
        else:
            evaluate(model, mine)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("where", ["train", "evaluate"])
def test_one_ranks_bad_row_stops_every_rank_with_its_message(card, where):
    first = "step 1" if where == "train" else "evaluate, row 0"
    for message in run(one_bad_rank, 2, card, where, timeout=30):
        assert message is not None and f"rank 1: {first}: targets[3] = 1000000 is not a token id" in message


def bad_row_at_step_two(rank: int, world: int, card):
    """train where the last rank's second row holds a token outside the vocabulary: (what each rank
    raised, the steps it reported). A step is reported once the next is launched, or before a stop."""
    from linnet.torch import fully_shard
    from linnet.torch.train import train

    model = fully_shard(load(card))
    mine = rows(world)[rank::world]
    if rank == world - 1:
        mine[1].targets = mine[1].targets.copy()
        mine[1].targets[3] = 10**6
    reported = []
    try:
        train(model, iter(mine), optimizer=torch.optim.AdamW(list(model.parameters())), steps=STEPS,
              on_step=reported.append)
    except ValueError as error:
        return str(error), [(s.step, s.loss) for s in reported]
    return None, reported


def test_the_step_before_a_stop_is_reported(card):
    outcomes = run(bad_row_at_step_two, 2, card, timeout=30)
    for message, reported in outcomes:
        assert message is not None and "rank 1: step 2: targets[3] = 1000000 is not a token id" in message
        assert [step for step, _ in reported] == [1] and np.isfinite(reported[0][1])
    assert outcomes[0][1] == outcomes[1][1]  # the global batch's loss, on every rank


def train_over_a_subgroup(rank: int, world: int, card) -> str:
    import torch.distributed as dist

    from linnet.torch import fully_shard
    from linnet.torch.train import train

    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    model = fully_shard(load(card), group=own)
    try:
        train(model, iter(rows(1)), optimizer=torch.optim.AdamW(list(model.parameters())), steps=1,
              on_step=lambda s: None)
    except ValueError as error:
        return str(error)
    return "trained"


def test_train_refuses_a_model_sharded_over_some_of_the_processes(card):
    for said in run(train_over_a_subgroup, 2, card, timeout=120):
        assert said == ("train needs the model sharded over every one of the 2 processes; it is over 1 "
                        "(fully_shard(group=...) of some of them)")


def shard_that_fails(rank: int, world: int, card, read_first: bool) -> list[str]:
    """fully_shard failing as it cuts the first part, then fully_shard again, then a call of the model."""
    import linnet.torch.shard as shard
    from linnet.torch import fully_shard

    model = load(card)
    if read_first:
        model.params  # read whole: fully_shard then cuts the weights group by group, dropping each
    cut = shard._part_of

    def no_room(*args, **kwargs):
        raise MemoryError("no room for the part")

    shard._part_of, said = no_room, []
    try:
        fully_shard(model)
    except MemoryError as error:
        said.append(str(error))
    shard._part_of = cut
    for attempt in (lambda: fully_shard(model), lambda: model.loss_packed(*row_tensors(rows(1)[0]))):
        try:
            attempt()
            said.append("ran")
        except RuntimeError as error:
            said.append(str(error))
    return said


def test_a_fully_shard_that_fails_says_whether_the_model_can_be_used_again(card):
    """Loaded whole, its weights go as the parts are cut: after a failure the model says it has lost them
    (rather than "already sharded", or a KeyError at its next call). Not read yet, nothing changed."""
    failed, again, called = run(shard_that_fails, 1, card, True)[0]
    assert failed == "no room for the part"
    assert again == called and again.startswith("fully_shard of ") and again.endswith(
        " failed after it began to cut the weights into parts (MemoryError: no room for the part): this model has "
        "lost them; nest.load it again")
    assert run(shard_that_fails, 1, card, False)[0] == ["no room for the part", "ran", "ran"]


def device_check(rank: int, world: int) -> dict:
    """What fully_shard's device check says of a model on each device, over the default group."""
    from types import SimpleNamespace

    from linnet.torch.shard import _check_device

    said = {}
    for device in ("cpu", "cuda"):
        try:
            _check_device(SimpleNamespace(device=torch.device(device), cast_dtype=True), torch.distributed.group.WORLD)
            said[device] = None
        except ValueError as error:
            said[device] = str(error)
    return said


def test_the_model_must_be_where_the_groups_backends_take_tensors():
    """A group whose backends take CPU tensors alone refuses a CUDA model; one made with a backend a device
    ("cpu:gloo,cuda:nccl", or none named, as init_device_mesh makes it with NCCL there) takes either."""
    said = run(device_check, 1, backend="cpu:gloo")[0]
    assert said["cpu"] is None
    assert "the model is on cuda but the process group's backend (cpu:gloo) takes tensors on cpu" in said["cuda"]
    assert run(device_check, 1, backend="cpu:gloo,cuda:gloo")[0] == {"cpu": None, "cuda": None}


def save_where_it_cannot(rank: int, world: int, card, target: str):
    """save_weights, then a checkpoint, into a path under a file: only the first rank writes either."""
    from linnet.torch.checkpoint import Checkpointer
    from linnet.torch import fully_shard

    model = fully_shard(load(card))
    outcomes = []
    for save in (lambda: model.save_weights(target),
                 lambda: Checkpointer(target, model, torch.optim.AdamW(list(model.parameters()))).save(1, 0)):
        try:
            save()
            outcomes.append(None)
        except Exception as error:  # noqa: BLE001  (the test looks at what each rank raised)
            outcomes.append(f"{type(error).__name__}: {error}")
    return outcomes


def test_a_failed_write_on_the_first_rank_reaches_every_rank(card, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    first, second = run(save_where_it_cannot, 2, card, str(blocker / "out"), timeout=60)
    # The weights' NotADirectoryError reaches the other rank as a RuntimeError; the checkpoint folder's
    # StorageError, a user error, as a UserError (one line in the examples).
    for mine, other, kind in zip(first, second, ["RuntimeError", "UserError"]):
        assert mine is not None and "RuntimeError: could not" not in mine  # the first rank's own error
        assert other.startswith(f"{kind}: could not") and "rank 0: " in other and mine.split(": ")[0] in other


def test_sft_torch_example_runs_offline(tmp_path):
    """The README's quick start, shortened: two processes over Gloo, the tiny card, the repo's data; the script
    at the path the first README gave it (examples/07-fsdp/, a link to examples/sft/)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "examples/07-fsdp/sft_torch.py",
               "--card", "tiny-llama", "--data", "examples/sft/data/tasks.jsonl", "--tokens", "256",
               "--steps", "5", "--lr", "3e-3", "--out", str(tmp_path / "weights")]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 2 processes" in result.stdout and "held-out loss" in result.stdout
    assert (tmp_path / "weights" / "model.safetensors").exists()


COMPILE_ONE_STEP = """
import logging, sys
import torch, torch.distributed as dist
from linnet import nest
from linnet.torch import fully_shard
if sys.argv[1] == "unfiltered":
    import linnet.torch.shard
    logging.getLogger("torch._higher_order_ops.wrap").filters.clear()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = fully_shard(nest.load("tiny-llama", numerics="fast", generics={"Batch": 1, "MaxSeq": 32, "T": "f32"},
                              cast_dtype=True, trainable=True, weights="random", entry="loss_packed",
                              compile="inductor"))
x = torch.zeros(1, 32, dtype=torch.int32)
model.loss_packed(x, x, torch.arange(32, dtype=torch.int32)[None], x, torch.ones(1, 32)).backward()
dist.destroy_process_group()
"""


def test_a_compiled_sharded_step_prints_no_context_fn_warning():
    """torch.compile's warning about a checkpoint's context_fn concerns in-place ops, which the
    generated code has none of; without linnet's filter it is printed (the control run)."""
    import subprocess
    import sys

    def stderr(mode: str) -> str:
        result = subprocess.run([sys.executable, "-c", COMPILE_ONE_STEP, mode], capture_output=True, text=True,
                                timeout=600, check=True)
        return result.stderr

    assert "context_fn" not in stderr("filtered")
    assert "context_fn is passed to torch.utils.checkpoint" in stderr("unfiltered")


DEEP_LAYERS = 5


@pytest.fixture(scope="module")
def deep_card(tmp_path_factory):
    """The tiny card with 5 layers: prefetch 1 keeps the last 2 layers' gathers for the backward, so 3
    are gathered again in the backward (with 2 layers none is)."""
    return write_tied_card(tmp_path_factory.mktemp("deep"), layers=DEEP_LAYERS)


def region_training(rank: int, world: int, card, recompute: str):
    from torch._C._distributed_c10d import _get_work_registry_size
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    from linnet.torch import fully_shard
    from linnet.torch.shard import gathered_weights
    from linnet.torch.train import train

    model = fully_shard(load(card, compile="inductor"), recompute=recompute)
    around_checkpoint = ("@torch.compiler.nested_compile_region\ndef decoder_layer_region(x, w, cos, sin, mask):"
                         "  # traced and compiled once, called for every layer\n"
                         "    return checkpointed(decoder_layer, x, w, cos, sin, mask)")
    inside_checkpoint = "@torch.compiler.nested_compile_region\ndef decoder_layer(x, w, cos, sin, mask):"
    expected, other = (around_checkpoint, inside_checkpoint) if world == 1 else (inside_checkpoint, around_checkpoint)
    assert model.layer_region and expected in model.source and other not in model.source
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR, weight_decay=0.0, eps=EPS)
    un_waited, traced = [], []
    hop = type(invoke_subgraph)  # each trace of the region that finds its schema (linnet/torch/compile_once.py)
    own = hop.gen_schema
    hop.gen_schema = lambda self, *args: traced.append(args[1]) or own(self, *args)
    try:
        history = train(model, iter(rows(world)[rank::world]), optimizer=optimizer, steps=STEPS,
                        on_step=lambda s: un_waited.append(_get_work_registry_size()))
    finally:
        hop.gen_schema = own
    assert un_waited == [0] * STEPS, f"collectives launched and never waited for, after each step: {un_waited}"
    # Each subgraph (the layer's, and the forward and backward made of it) traced once, not once a layer
    # in each of AOT autograd's passes.
    assert traced and len(traced) == len(set(traced)), traced
    return [s.loss for s in history.steps], {name: t.numpy() for name, t in gathered_weights(model, torch.float32)}


@pytest.mark.parametrize("world, recompute", [(1, "gather"), (1, "matmuls"), (2, "full")])
def test_a_layer_compiled_once_trains_as_single_process(deep_card, world, recompute, monkeypatch):
    """LINNET_COMPILE_LAYERS_ONCE=1 (on one rank, as unset): the layer's function is one nested compile
    region, around the layer's checkpoint on one rank and inside it over several; it trains as the single
    process does and leaves no collective un-waited."""
    monkeypatch.setenv("LINNET_COMPILE_LAYERS_ONCE", "1")
    expected_losses, expected_weights = reference(deep_card, world)
    for losses, weights in run(region_training, world, deep_card, recompute, timeout=600):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        for name, tensor in weights.items():  # 2e-5: five layers' f32 sums in other orders (1.1e-5 measured)
            assert relative_error(tensor, expected_weights[name].numpy()) < 2e-5, name


def region_refused(rank: int, world: int, card):
    from linnet.torch import fully_shard

    model = load(card, compile="inductor")
    for recompute in ("gather", "matmuls"):
        with pytest.raises(ValueError,
                           match=f"recompute='{recompute}' over 2 ranks.*leak.*use recompute='full', or unset"):
            fully_shard(model, recompute=recompute)
    assert fully_shard(model, recompute="full").layer_region  # the refusals left the model as it was


def test_a_layer_compiled_once_is_refused_where_the_backward_gathers_again(deep_card, monkeypatch):
    """A region keeps every input its backward reads: with recompute "gather" over several ranks the
    gathered weights would be kept and the backward's second gather never waited for (each step leaked
    3 gathers here, measured before the refusal), so fully_shard says so instead; and "matmuls", whose
    backward gathers again too."""
    monkeypatch.setenv("LINNET_COMPILE_LAYERS_ONCE", "1")
    run(region_refused, 2, deep_card)
