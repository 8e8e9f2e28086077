"""The communication schedule of compiled sharded code, checked in the code
inductor generates rather than assumed: a layer's gather is launched before
the layer ahead computes and waited for after, in the forward and in the
backward; each reduce-scatter runs under the next layer's backward; and no
more than prefetch + 1 layers' gathered weights are alive at once.

One process joins a fake process group of 4 ranks (collectives move nothing:
only the order and the lifetimes of buffers are looked at), and compiles one
forward and backward of a 4-layer Llama."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from distributed import run
from hf_models import BASE, write_card

LAYERS, ROW, WORLD = 4, 32, 4


@dataclass
class Code:
    """The lines of one generated function, and where the layers' collectives are in them."""

    lines: list[str]
    launches: list[tuple[int, str, str]]  # (line, part's input name, gathered buffer), in launch order
    reduce_scatters: list[tuple[int, str]]  # (line, result buffer), in launch order

    def first(self, pattern: str, after: int = -1) -> int:
        return next(i for i, line in enumerate(self.lines) if i > after and re.search(pattern, line))

    def wait(self, buffer: str) -> int:
        return self.first(rf"wait_tensor\.default\({buffer}\)")

    def first_matmul(self, weights: str) -> int:
        """The first matmul that reads a layer's gathered weights."""
        return self.first(rf"extern_kernels\.b?mm\(.*\b{weights}\b")

    def freed(self, buffer: str) -> int:
        return self.first(rf"^\s*del {buffer}$|; del {buffer}\b")

    def most_alive(self, buffers: list[str]) -> int:
        """The most of `buffers` alive at once: each from its launch to the line that frees it."""
        spans = [(self.first(rf"^\s*{b} = "), self.freed(b)) for b in buffers]
        return max(sum(start <= line <= end for start, end in spans) for line, _ in spans)


def _result(lines: list[str], number: int) -> tuple[str, int]:
    """The 1-D buffer an op call at `number` returns, and its length (from inductor's size assert)."""
    found = next(m for later in lines[number:number + 8]
                 if (m := re.search(r"assert_size_stride\((buf\d+), \((\d+), \)", later)))
    return found.group(1), int(found.group(2))


def parse(source: str, gathered_size: int, part_size: int) -> Code:
    lines = source.splitlines()
    launches, reduce_scatters = [], []
    for number, line in enumerate(lines):
        if launch := re.search(r"(buf\d+) = torch\.ops\.linnet\.all_gather\.default\((\w+),", line):
            buffer, size = _result(lines, number)
            if size == gathered_size:
                launches.append((number, launch.group(2), buffer))
        if re.search(r"= torch\.ops\.linnet\.reduce_scatter\.default", line):
            buffer, size = _result(lines, number)
            if size == part_size:
                reduce_scatters.append((number, buffer))
    return Code(lines, launches, reduce_scatters)


def generated_code(rank: int, world: int, card, prefetch: int = 1, fake_world: int = WORLD, mesh: tuple | None = None):
    """Inductor's forward and backward of one sharded step at a fake world of 4 (or of `fake_world`; or
    over a fake ("replicate", "shard") mesh of that shape)."""
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from linnet import nest
    from linnet.torch import fully_shard

    dist.destroy_process_group()  # the Gloo group of one rank that `run` made: a fake world instead
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world)
    model = nest.load(card, numerics="exact", generics={"Batch": 1, "MaxSeq": ROW, "T": "bf16"}, cast_dtype=True,
                      trainable=True, weights="random", compile="inductor", entry="loss_packed")
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
    fully_shard(model, prefetch=prefetch, mesh=mesh)
    tokens = torch.randint(0, BASE["vocab_size"], (1, ROW), dtype=torch.int32)
    positions, segments = torch.arange(ROW, dtype=torch.int32)[None], torch.zeros(1, ROW, dtype=torch.int32)
    _, (forward, backward) = run_and_get_code(
        lambda: model.loss_packed(tokens, tokens, positions, segments, torch.ones(1, ROW)).backward())
    layout, head, table = (model.sharding.layouts[name] for name in ("Layer", "Head", "Embedding"))
    return forward, backward, layout.total, layout.part_size, head.total, head.part_size, (table.total, table.part_size)


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return write_card(tmp_path_factory.mktemp("card"), {**BASE, "num_hidden_layers": LAYERS}, None, repo="random")


@pytest.mark.parametrize("prefetch", [1, 2])
def test_compiled_step_runs_the_schedule(card, prefetch):
    forward_source, backward_source, gathered_size, part_size, head_size, head_part, table = run(
        generated_code, 1, card, prefetch, timeout=600)[0]
    forward = parse(forward_source, gathered_size, part_size)
    backward = parse(backward_source, gathered_size, part_size)
    kept = range(LAYERS - prefetch - 1, LAYERS)  # the layers whose backward comes first keep their gathers
    assert len(forward.launches) == LAYERS and len(backward.launches) == LAYERS - len(kept)
    assert len(backward.reduce_scatters) == LAYERS

    # Forward: layer i + prefetch's gather is launched before layer i's first matmul, and layer
    # i + 1's is waited for after it; the head's gather is launched as a next layer's would be.
    weights = [gathered for _, _, gathered in forward.launches]
    head = parse(forward_source, head_size, head_part)
    (head_launch, _, head_gathered), = head.launches
    for i in range(LAYERS - 1):
        first_matmul = forward.first_matmul(weights[i])
        ahead = min(i + prefetch, LAYERS - 1)
        assert forward.launches[ahead][0] < first_matmul < forward.wait(weights[i + 1]), f"layer {i}"
    assert head_launch < forward.first_matmul(weights[LAYERS - prefetch]) < forward.wait(head_gathered)
    assert forward.most_alive(weights[:kept.start]) == min(prefetch + 1, kept.start)
    returned = forward.lines[forward.first(r"^\s*return \(")]
    assert all(re.search(rf"\b{weights[i]}\b", returned) for i in kept)  # kept for the backward, not freed

    # Backward: the same, downwards; the other layers' gathers are launched again.
    layer_of = {part: i for i, (_, part, _) in enumerate(forward.launches)}
    regathered = {layer_of[part]: gathered for _, part, gathered in backward.launches}
    launched = {layer_of[part]: line for line, part, _ in backward.launches}
    assert sorted(regathered) == list(range(kept.start))
    for i in range(kept.start - 1, 0, -1):
        first_matmul = backward.first_matmul(regathered[i])
        below = max(i - prefetch, 0)
        assert launched[below] < first_matmul < backward.wait(regathered[i - 1]), f"layer {i}"
    assert backward.most_alive(list(regathered.values())) <= prefetch + 1

    # Each layer's reduce-scatter is launched before the layer below computes its gradient and
    # waited for after (the reduce-scatters run from the top layer down).
    for (line, result), i in zip(backward.reduce_scatters, range(LAYERS - 1, -1, -1)):
        if 0 < i <= kept.start:
            below = backward.first_matmul(regathered[i - 1])
            assert line < below < backward.wait(result), f"layer {i}'s reduce-scatter"

    # The head's reduce-scatter runs under the last layer's backward: launched before that layer's
    # own reduce-scatter, waited for after it.
    (head_reduce, head_gradient), = parse(backward_source, head_size, head_part).reduce_scatters
    assert head_reduce < backward.reduce_scatters[0][0] < backward.wait(head_gradient)

    # The untied embedding is looked up: its table is never gathered nor its gradient reduce-scattered;
    # the tokens are gathered, and the rows reduce-scattered (forward) and gathered (backward).
    assert not parse(forward_source, *table).launches and not parse(backward_source, *table).reduce_scatters
    assert "_c10d_functional.all_gather_into_tensor.default(" in forward_source
    assert ".reduce_scatter_tensor.default(" in forward_source  # _c10d_functional_autograd's
    assert "_c10d_functional.all_gather_into_tensor.default(" in backward_source


def test_without_prefetch_each_gather_is_waited_for_before_the_next_is_launched(card):
    forward_source, _, gathered_size, part_size, *_ = run(generated_code, 1, card, 0, timeout=600)[0]
    forward = parse(forward_source, gathered_size, part_size)
    for (_, _, gathered), (next_launch, _, _) in zip(forward.launches, forward.launches[1:]):
        assert forward.wait(gathered) < next_launch
    assert forward.most_alive([gathered for _, _, gathered in forward.launches]) == 1


def test_a_tied_embedding_is_gathered_once_and_reduce_scattered_once(tmp_path):
    """Read by the embedding and by the head, its gradients meet before one reduce-scatter."""
    layers = 2
    tied = write_card(tmp_path, {**BASE, "num_hidden_layers": layers, "tie_word_embeddings": True}, None, repo="random")
    forward, backward, *_ = run(generated_code, 1, tied, timeout=600)[0]
    groups = layers + 2  # the layers, the embedding (with the head's matrix) and the final norm
    assert forward.count("torch.ops.linnet.all_gather.default(") == groups
    assert backward.count("torch.ops.linnet.reduce_scatter.default(") == groups


def test_on_one_rank_a_gather_is_a_cast_made_again_in_the_backward(card):
    """On one rank a gather is a cast. A layer's backward gets its f32 part and casts it again, as several
    ranks gather again, rather than keep the forward's bf16 cast; the gradient's "reduce-scatter" is its
    one cast into the part's f32 gradient."""
    forward, backward, total, *_ = run(generated_code, 1, card, 1, 1, timeout=600)[0]
    parts = {m.group(1) for m in re.finditer(rf"assert_size_stride\((primals_\d+), \({total}, \), \(1, \)", forward)}
    inputs = set(re.search(r"^\s*(\w+(?:, \w+)*),? = args$", backward, re.MULTILINE).group(1).split(", "))
    assert len(parts) == LAYERS
    # On one rank a layer is compiled once (linnet/torch/model.py): its backward is a subgraph, called once
    # a layer, whose inputs are the part (its primals_0), not the cast the forward's gather waited for.
    layer = "partitioned_bw_subgraph_0_0_"
    assert layer + "primals_0" in inputs and layer + "wait_tensor" not in inputs
    assert len(re.findall(r"= partitioned_bw_subgraph_0_0\(", backward)) == LAYERS
    # The cast again and the gradient's cast, each written once in the layer's subgraph; the head's and
    # the embedding's gradients' casts beside it.
    assert backward.count("torch.ops.linnet.all_gather.default(") == 1
    assert backward.count("torch.ops.linnet.reduce_scatter.default(") == 1 + 2


def test_with_replicas_each_all_reduce_runs_under_the_layers_below(card):
    """Hybrid sharding, 2 replicas of 2 shards: each part's reduce-scatter carries the sum across the
    replicas that follows it (launched by the op when the reduce-scatter ends), and is waited for only
    where the backward ends, after the looked-up embedding's gradient, so each runs under the backward
    of the layers below it. The lowest layer's has none below it: it stays inside the shard group (its sum
    across the replicas follows the backward, tests/test_hybrid.py). The embedding's part is not
    all-reduced: its rows' gradients are gathered across the replicas, then inside the shard group."""
    _, backward, gathered_size, part_size, *_ = run(generated_code, 1, card, 1, 4, (2, 2), timeout=600)[0]
    lines = backward.splitlines()
    assert "_c10d_functional.all_reduce" not in backward
    code = parse(backward, gathered_size, part_size)
    reductions = [(n, line) for n, line in enumerate(lines) if "= torch.ops.linnet.reduce_scatter.default(" in line]
    assert len(reductions) == LAYERS + 1  # the layers' and the head's
    *above, (_, lowest) = reductions  # (full, op, dtype, shard ranks, shard group, replicate group, replicas)
    for _, line in above:
        assert re.search(r"reduce_scatter\.default\(\w+, 'avg', torch\.float32, 2, '\w+', '\w+', 2\)", line), line
    assert re.search(r"reduce_scatter\.default\(\w+, 'avg', torch\.float32, 2, '\w+'\)", lowest), lowest  # no replicas
    rows = [n for n, line in enumerate(lines) if "_c10d_functional.all_gather_into_tensor.default(" in line]
    assert len(rows) == 2  # the rows' gradients: across the replicas, then inside the shard group
    waits = [code.wait(_result(lines, n)[0]) for n, _ in reductions]
    assert min(waits) > max(rows) > max(n for n, _ in reductions)  # every wait after the embedding's backward
    matmuls = [n for n, line in enumerate(lines) if re.search(r"extern_kernels\.b?mm\(", line)]
    for line, _ in reductions[:-1]:  # all but the lowest layer's: a layer's backward below it
        assert any(line < matmul < min(waits) for matmul in matmuls), "a reduction with no compute under it"
