"""Adam's step taken in the backward (linnet/torch/step_in_backward.py): the op
steps as torch.optim.Adam(W)(fused=True) does, and training that steps each
part where its gradient is complete equals training that steps after the
backward, bit for bit, eager and compiled, on one rank and on two (there,
compiled, within run-to-run noise: `assert_same_training`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from distributed import run
from hf_models import write_tied_card, write_untied_card
from linnet import nest
from linnet.data.packing import Example, pack
from linnet.torch.train import row_tensors
from linnet.torch import ops
from linnet.torch.step_in_backward import stepping_in_backward, supported

ROW = 64
STEPS = 4


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return write_tied_card(tmp_path_factory.mktemp("card"))


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """A head of its own (as the 8B's): the embedding is looked up, the head gathered with the final norm."""
    return write_untied_card(tmp_path_factory.mktemp("untied"))


def rows(world: int) -> list:
    rng = np.random.default_rng(3)
    examples = [Example.prompted(rng.integers(0, 211, rng.integers(3, 20)).tolist(),
                                 rng.integers(0, 211, rng.integers(2, 15)).tolist()) for _ in range(50 * world)]
    return list(pack(examples, ROW))[: STEPS * world]


@pytest.mark.parametrize("kind, weight_decay",
                         [(torch.optim.AdamW, 0.1), (torch.optim.Adam, 0.1), (torch.optim.AdamW, 0.0)])
def test_the_op_steps_as_fused_adam(kind, weight_decay):
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(1000, generator=generator))
    gradients = [torch.randn(1000, generator=generator) for _ in range(3)]
    optimizer = kind([param], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay, fused=True)
    mine = param.detach().clone()
    exp_avg, exp_avg_sq, step = torch.zeros(1000), torch.zeros(1000), torch.zeros(())
    lr = torch.tensor(1e-2, dtype=torch.float64)  # as the step in the backward passes it
    for gradient in gradients:
        param.grad = gradient
        optimizer.step()
        ops.adam_step(mine, exp_avg, exp_avg_sq, step, gradient, lr, 0.8, 0.99, weight_decay, 1e-6,
                      decoupled=kind is torch.optim.AdamW)
    state = optimizer.state[param]
    assert torch.equal(mine, param.detach())
    assert torch.equal(exp_avg, state["exp_avg"]) and torch.equal(exp_avg_sq, state["exp_avg_sq"])
    assert float(step) == float(state["step"]) == 3


def test_the_op_passes_opcheck():
    """Schema (what it changes in place), fake kernel, and its run under AOT autograd's functionalisation."""
    generator = torch.Generator().manual_seed(1)
    args = (torch.randn(64, generator=generator), torch.zeros(64), torch.zeros(64), torch.zeros(()),
            torch.randn(64, generator=generator), torch.tensor(1e-3, dtype=torch.float64), 0.9, 0.999, 0.01, 1e-8, True)
    torch.library.opcheck(torch.ops.linnet.adam_step_.default, args)


def test_a_narrower_gradient_steps_as_the_same_values_widened():
    """A bf16 gradient of an f32 parameter (as the CUDA kernel reads it): here widened, then ATen's step."""
    generator = torch.Generator().manual_seed(2)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        param, exp_avg, exp_avg_sq, step = torch.ones(100), torch.zeros(100), torch.zeros(100), torch.zeros(())
        gradient = torch.randn(100, generator=generator.manual_seed(2)).bfloat16().to(dtype)
        ops.adam_step(param, exp_avg, exp_avg_sq, step, gradient, torch.tensor(1e-2, dtype=torch.float64),
                      0.9, 0.999, 0.1, 1e-8)
        results.append((param, exp_avg, exp_avg_sq))
    for narrow, wide in zip(*results):
        assert torch.equal(narrow, wide)


def test_the_op_names_a_mismatched_gradient():
    param, lr = torch.zeros(8), torch.tensor(1e-3)
    with pytest.raises(RuntimeError, match=r"the gradient's shape \[4\] is not the parameter's \[8\]"):
        ops.adam_step(param, torch.zeros(8), torch.zeros(8), torch.zeros(()), torch.zeros(4), lr, 0.9, 0.999, 0.0, 1e-8)
    with pytest.raises(RuntimeError, match=r"a moment of shape \[4\] and dtype Float for a parameter of shape \[8\]"):
        ops.adam_step(param, torch.zeros(4), torch.zeros(8), torch.zeros(()), torch.zeros(8), lr, 0.9, 0.999, 0.0, 1e-8)
    with pytest.raises(RuntimeError, match="the parameter and its gradient must be floating point, got Float and Long"):
        ops.adam_step(param, torch.zeros(8), torch.zeros(8), torch.zeros(()), torch.zeros(8, dtype=torch.long), lr,
                      0.9, 0.999, 0.0, 1e-8)
    with pytest.raises(RuntimeError, match="step must be a 0-d float32 tensor"):
        ops.adam_step(param, torch.zeros(8), torch.zeros(8), torch.zeros(1), torch.zeros(8), lr, 0.9, 0.999, 0.0, 1e-8)


def test_only_the_optimizers_with_a_stepper_step_a_sharded_model_in_the_backward():
    param, sharded = torch.nn.Parameter(torch.zeros(4)), SimpleNamespace(sharding=object(), late_parts=None)
    assert supported(sharded, torch.optim.AdamW([param])) is None
    assert supported(sharded, torch.optim.Adam([param], weight_decay=0.1)) is None
    assert supported(sharded, torch.optim.SGD([param], lr=0.1, weight_decay=0.1)) is None
    assert "not sharded" in supported(SimpleNamespace(sharding=None, late_parts=None), torch.optim.AdamW([param]))
    assert supported(sharded, torch.optim.Adagrad([param])) == (
        "Adagrad has no stepper in linnet/torch/steppers/ (those there: Adam, AdamW, SGD)")
    assert "momentum=0.9 (only plain SGD" in supported(sharded, torch.optim.SGD([param], lr=0.1, momentum=0.9))
    assert "amsgrad=True" in supported(sharded, torch.optim.AdamW([param], amsgrad=True))
    assert "maximize=True" in supported(sharded, torch.optim.Adam([param], maximize=True))
    hooked = torch.optim.AdamW([param])
    hooked.register_step_post_hook(lambda optimizer, args, kwargs: None)
    assert "step hooks" in supported(sharded, hooked)
    param.register_post_accumulate_grad_hook(lambda param: None)
    assert "gradient hook" in supported(sharded, torch.optim.AdamW([param]))


def sharded(card, compile: str | None = None, dtype: str = "f32", recompute: str = "gather",
            reshard_after_forward: bool = True):
    """The card with random weights, sharded over the default group (each caller runs in its rank)."""
    from linnet.torch import fully_shard

    model = nest.load(card, numerics="exact", generics={"Batch": 1, "MaxSeq": ROW, "T": dtype}, device="cpu",
                      cast_dtype=True, trainable=True, weights="random", seed=0, compile=compile, entry="loss_packed")
    return fully_shard(model, recompute=recompute, reshard_after_forward=reshard_after_forward)


def training(rank: int, world: int, card, compile: str | None, in_backward: bool, optimizer_kind=torch.optim.AdamW,
             dtype: str = "f32", reshard_after_forward: bool = True):
    """STEPS of linnet.torch.train, sharded over `world` ranks: the losses, the parts, the optimizer's state."""
    from linnet.torch.train import train

    torch.set_num_threads(1)  # the same sums in the same order, run to run
    model = sharded(card, compile, dtype, reshard_after_forward=reshard_after_forward)
    optimizer = optimizer_kind(list(model.parameters()), lr=3e-3, weight_decay=0.1, eps=1e-6, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))  # the lr changes each step
    history = train(model, iter(rows(world)[rank::world]), optimizer=optimizer, steps=STEPS, schedule=schedule,
                    on_step=lambda s: None, step_in_backward=in_backward)
    parts = [p.detach().numpy().copy() for p in model.parameters()]  # (numpy: tensors do not cross processes here)
    states = [{key: value.cpu().numpy().copy() for key, value in optimizer.state[p].items()}
              for p in model.parameters()]
    return [s.loss for s in history.steps], parts, states


def assert_same_training(actual, expected, noise: float = 0.0):
    """The same losses, parts and optimizer state: bit for bit, or each tensor within `noise` times its
    largest magnitude."""
    np.testing.assert_allclose(actual[0], expected[0], rtol=noise, atol=0)
    pairs = [(mine, theirs, "part") for mine, theirs in zip(actual[1], expected[1])]
    for mine, theirs in zip(actual[2], expected[2]):
        assert mine.keys() == theirs.keys() == {"step", "exp_avg", "exp_avg_sq"}
        pairs += [(mine[key], theirs[key], key) for key in mine]
    for mine, theirs, what in pairs:
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=noise * np.abs(theirs).max(), err_msg=what)


def compile_attempts(rank: int, world: int, card) -> list[str]:
    """The attempts torch.compile made at the compiled frames of a training that steps in the backward."""
    from torch._dynamo.utils import compilation_time_metrics

    compilation_time_metrics.clear()
    training(rank, world, card, "inductor", True)
    return sorted({name for name in compilation_time_metrics if name.startswith("compile_attempt_")})


def test_the_step_in_the_backward_compiles_at_the_first_attempt(card):
    """The learning rate enters as a one-element host tensor. As a 0-d f64 one, torch.compile reads it as a
    float, throws away its whole first compile of the step and compiles again
    (docs/design/compile_time.md)."""
    assert run(compile_attempts, 1, card, timeout=300)[0] == ["compile_attempt_0"]


@pytest.mark.parametrize("compile", [None, "inductor"])
@pytest.mark.parametrize("world", [1, 2])
def test_training_that_steps_in_the_backward_equals_stepping_after(card, compile, world):
    """Compiled on two ranks on the CPU, one run's gradients differ from another's in their last bits (the
    same run stepping after, too; eager and one rank are repeatable to the bit), which Adam's steps,
    dividing its moments, grow (docs/design/step_in_backward.md). Held to 1e-5."""
    after, within = (run(training, world, card, compile, in_backward, timeout=300) for in_backward in (False, True))
    for rank in range(world):
        assert_same_training(within[rank], after[rank], noise=1e-5 if compile and world > 1 else 0.0)


def sgd_training(rank: int, world: int, card, compile: str | None, in_backward: bool):
    """STEPS of train with plain SGD (its stepper, linnet/torch/steppers/sgd.py): the losses and the parts."""
    from linnet.torch.train import train

    torch.set_num_threads(1)
    model = sharded(card, compile)
    optimizer = torch.optim.SGD(list(model.parameters()), lr=0.3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    history = train(model, iter(rows(world)[rank::world]), optimizer=optimizer, steps=STEPS, schedule=schedule,
                    on_step=lambda s: None, step_in_backward=in_backward)
    return [s.loss for s in history.steps], [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_a_second_optimizer_steps_in_the_backward_as_after(card, compile):
    """Plain SGD, a stepper of ATen arithmetic (its step and torch.optim.SGD's round the product of the rate
    and the gradient apart: within 1e-6)."""
    after, within = (run(sgd_training, 2, card, compile, in_backward, timeout=300)[0] for in_backward in (False, True))
    np.testing.assert_allclose(within[0], after[0], rtol=1e-6)
    for mine, theirs in zip(within[1], after[1]):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6 * np.abs(theirs).max())


def reductions(rank: int, world: int, card, compile: str | None, in_backward: bool) -> tuple[int, int, int]:
    """(the reduce-scatters that a bf16 step on one rank runs, after a first (compiling) step; the parts; the
    layers' parts)."""
    from linnet.torch.train import train

    model = sharded(card, compile, "bf16")
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-3, fused=True)

    def one_step():
        train(model, iter(rows(world)), optimizer=optimizer, steps=1, on_step=lambda s: None,
              step_in_backward=in_backward)

    one_step()  # compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        one_step()
    ran = sum(event.count for event in profile.key_averages() if event.key == "linnet::reduce_scatter")
    layers = sum(len(parts) for parts in model.params.values() if isinstance(parts, list))
    return ran, len(list(model.parameters())), layers


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_on_one_rank_a_layers_bf16_gradient_steps_its_part_as_it_is(card, compile):
    """On one rank, a part's cast sends its bf16 gradient straight to the step (shard.py's `_take`): every
    part, the layers' and the tied table's (whose lookup's and head's gradients autograd sums in bf16
    either way), is stepped with no reduce-scatter (on one rank, a cast to f32), and the training equals
    stepping after, which widens each gradient first."""
    after, within = (run(training, 1, card, compile, in_backward, torch.optim.AdamW, "bf16")[0]
                     for in_backward in (False, True))
    assert_same_training(within, after)
    ran, parts, layers = run(reductions, 1, card, compile, True)[0]
    assert layers > 0 and ran == 0
    ran, parts, layers = run(reductions, 1, card, compile, False)[0]
    assert ran == parts


def test_on_one_rank_an_untied_heads_bf16_gradient_steps_it_as_it_is(untied):
    """The head gathered with the final norm sends its bf16 gradient to its step as a layer does (the
    looked-up embedding's gradient is its rows', f32): the same training as stepping after, and no
    linnet::reduce_scatter (on one rank, a cast to f32) at all."""
    after, within = (run(training, 1, untied, None, in_backward, torch.optim.AdamW, "bf16")[0]
                     for in_backward in (False, True))
    assert_same_training(within, after)
    ran, parts, layers = run(reductions, 1, untied, None, True)[0]
    assert layers > 0 and ran == 0


def test_adam_with_l2_steps_in_the_backward_as_after(card):
    after, within = (run(training, 1, card, None, in_backward, torch.optim.Adam)[0] for in_backward in (False, True))
    assert_same_training(within, after)


def one_backward(rank: int, world: int, card, compile: str | None):
    """Inside stepping_in_backward, a backward leaves no gradient and moves every part; outside, the same
    backward leaves every gradient and moves none. Also whether each part entered detached."""
    from torch.utils._pytree import tree_leaves

    model = sharded(card, compile)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-2)
    row = row_tensors(rows(world)[rank])
    before = [p.detach().clone() for p in model.parameters()]
    with stepping_in_backward(model, optimizer) as stepping:
        # Each part enters the entry detached: the graph's inputs that its backward changes require no
        # grad (torch 2.11's AOT autograd refuses one that does), and are the parts' own storage.
        entered = zip(tree_leaves(stepping.parts(model.params)), tree_leaves(model.params))
        detached = [not e.requires_grad and e.data_ptr() == p.data_ptr() for e, p in entered]
        model.loss_packed(*row).backward()
    stepped = [p.grad is None and not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)]
    before = [p.detach().clone() for p in model.parameters()]
    model.loss_packed(*row).backward()
    kept = [p.grad is not None and torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)]
    return stepped, kept, [float(s["step"]) for s in optimizer.state.values()], detached


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_a_backward_inside_steps_every_part_and_keeps_no_gradient(card, compile):
    for stepped, kept, steps, detached in run(one_backward, 2, card, compile, timeout=300):
        assert all(stepped) and all(kept) and all(detached)
        assert steps == [1.0] * len(stepped)


def test_train_asked_to_step_in_the_backward_names_why_it_cannot(card):
    from linnet.torch.train import train

    model = nest.load(card, numerics="exact", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, device="cpu",
                      cast_dtype=True, trainable=True, weights="random", seed=0, entry="loss_packed")
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-3)
    with pytest.raises(ValueError, match=r"train\(step_in_backward=True\): the model is not sharded"):
        train(model, iter(rows(1)), optimizer=optimizer, steps=1, on_step=lambda s: None, step_in_backward=True)
    history = train(model, iter(rows(1)), optimizer=optimizer, steps=1, on_step=lambda s: None)  # steps after
    assert len(history.steps) == 1 and model.stepping is None


def backward_ops(rank: int, world: int, card) -> list[str]:
    """The ops of one eager backward inside stepping_in_backward, in the order they ran: each step and
    each matrix product."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.linnet.adam_step_.default, torch.ops.aten.mm.default):
                self.names.append("step" if func is torch.ops.linnet.adam_step_.default else "mm")
            return func(*args, **(kwargs or {}))

    model = sharded(card, recompute="full")
    row = row_tensors(rows(world)[rank])
    with stepping_in_backward(model, torch.optim.AdamW(list(model.parameters()), lr=1e-2)):
        loss = model.loss_packed(*row)
        with Record() as record:
            loss.backward()
    return record.names


@pytest.mark.parametrize("world", [1, 2])
def test_each_part_steps_as_soon_as_its_gradient_is_complete(card, world):
    """The steps come between the layers' backward products, not after them all: each part's gradient is
    freed where it is complete (a step made where the entry starts would run once the backward is done).
    On one rank the head's and the last layer's steps come before the first layer's products; over two,
    prefetching a layer ahead, the head's does (a part is taken where its gather is launched)."""
    for names in run(backward_ops, world, card, timeout=300):
        assert names.count("step") == 4  # the head with the final norm, two layers, the tied embedding
        last_product = len(names) - 1 - names[::-1].index("mm")
        assert names[:last_product].count("step") == (2 if world == 1 else 1)


def settings_changed(rank: int, world: int, card, in_backward: bool):
    """Two compiled `train` runs on one model, the weight decay changed between them: the parts."""
    from linnet.torch.train import train

    torch.set_num_threads(1)
    model = sharded(card, "inductor")
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=3e-3, weight_decay=0.1, fused=True)
    for decay in (0.1, 0.3):
        optimizer.param_groups[0]["weight_decay"] = decay
        train(model, iter(rows(world)[:2]), optimizer=optimizer, steps=2, on_step=lambda s: None,
              step_in_backward=in_backward)
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_a_changed_setting_compiles_the_step_again(card):
    """The settings are the compiled step's constants: a new weight decay is a new graph, not a failed one."""
    after, within = (run(settings_changed, 1, card, in_backward, timeout=600)[0] for in_backward in (False, True))
    for mine, theirs in zip(within, after):
        np.testing.assert_array_equal(mine, theirs)


def test_the_op_keeps_the_stepped_cast_until_the_parts_next_cast():
    """adam_step(..., copy_dtype=bf16) keeps the stepped part's cast; the next cast_into_sink of the part
    takes it (seen where a write through .data, which no version counts, came between: the cast is of the
    part as stepped) and keeps it no longer. A part changed after its step, another view of its storage, a
    cast to another dtype, or a step made below autograd (inference_mode, no version counted) finds none,
    and casts what the part holds."""
    lr = torch.tensor(1e-2, dtype=torch.float64)
    base, exp_avg, exp_avg_sq, step = torch.randn(80), torch.zeros(40), torch.zeros(40), torch.zeros(())
    part = base[:40]
    gradient = torch.randn(40).bfloat16()
    sink = torch.zeros((), dtype=torch.bfloat16).expand(40)

    def stepped():
        ops.adam_step(part, exp_avg, exp_avg_sq, step, gradient, lr, 0.9, 0.99, 0.0, 1e-8, copy_dtype=torch.bfloat16)

    ops.drop_stepped_casts([part])
    stepped()
    assert ops.stepped_casts_kept() == 1
    as_stepped = part.bfloat16()
    part.data.add_(1.0)  # unseen by the version: the kept cast is taken, of the part as stepped
    assert torch.equal(ops.cast_into_sink(part, sink, torch.bfloat16), as_stepped)
    assert ops.stepped_casts_kept() == 0
    assert torch.equal(ops.cast_into_sink(part, sink, torch.bfloat16), part.bfloat16())  # none kept: a cast

    stepped()
    with torch.no_grad():
        part.add_(1.0)  # a change after the step: its cast is stale
    assert torch.equal(ops.cast_into_sink(part, sink, torch.bfloat16), part.bfloat16())
    assert ops.stepped_casts_kept() == 0

    stepped()
    half = torch.zeros((), dtype=torch.float16).expand(40)
    assert torch.equal(ops.cast_into_sink(part, half, torch.float16), part.half())
    stepped()
    other = base[::2]  # the same storage and size, other elements
    assert torch.equal(ops.cast_into_sink(other, sink, torch.bfloat16), other.bfloat16())

    with torch.inference_mode():
        stepped()
    with torch.no_grad():
        part.add_(1.0)  # one version on: what an uncounted step's cast would have waited for
    assert torch.equal(ops.cast_into_sink(part, sink, torch.bfloat16), part.bfloat16())
    assert ops.stepped_casts_kept() == 0
    with pytest.raises(RuntimeError, match="copy_dtype must be a floating dtype"):
        ops.adam_step(part, exp_avg, exp_avg_sq, step, gradient, lr, 0.9, 0.99, 0.0, 1e-8, copy_dtype=torch.int32)


def kept_casts(rank: int, world: int, card, compile: str | None, reshard_after_forward: bool) -> tuple:
    """Steps inside stepping_in_backward, bf16 (the table is the first part):
    - (casts kept after the forward, after the backward), each of three steps;
    - the loss of a forward after a write through .data into the table, which no version counts, and the
      loss of the same forward once the table is put back (a forward that takes the kept casts computes
      with the table as stepped, as the second does);
    - after another step, the table changed in place: the loss of a forward, and of it again (finding no
      kept cast: the first took or dropped them all);
    - after a last step, the casts kept once stepping_in_backward has ended."""
    torch.set_num_threads(1)
    model = sharded(card, compile, "bf16", reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-2, fused=True)
    batches = [row_tensors(row) for row in rows(world)]
    table = model.params[next(iter(model.params))]
    counts = []
    with stepping_in_backward(model, optimizer):
        for step in range(3):
            loss = model.loss_packed(*batches[step])
            forward = ops.stepped_casts_kept()
            loss.backward()
            counts.append((forward, ops.stepped_casts_kept()))
        as_stepped = table.detach().clone()
        table.data.add_(0.25)
        unseen = float(model.loss_packed(*batches[3]))  # (a forward that steps: one without a gradient casts none)
        table.data.copy_(as_stepped)
        put_back = float(model.loss_packed(*batches[3]))
        model.loss_packed(*batches[3]).backward()
        with torch.no_grad():
            table.add_(0.25)
        changed = float(model.loss_packed(*batches[3]))
        again = float(model.loss_packed(*batches[3]))
        model.loss_packed(*batches[3]).backward()
    return counts, (unseen, put_back), (changed, again), ops.stepped_casts_kept(), len(list(model.parameters()))


@pytest.mark.parametrize("compile", [None, "inductor"])
def test_on_one_rank_with_kept_casts_each_step_casts_its_part_for_the_next_forward(card, compile):
    """With reshard_after_forward=False, on one rank, Adam's step writes each part's cast and the next
    forward takes it rather than cast the part (linnet/torch/collectives.py, `_casts_from_the_step`): after a
    backward one cast is kept a part, after the next forward none; that forward computes with the parts as
    stepped; a part changed after its step is cast again; none is kept once the stepping ends. Training so
    equals stepping after the backward, to the bit."""
    counts, (unseen, put_back), (changed, again), left, parts = run(kept_casts, 1, card, compile, False)[0]
    assert counts == [(0, parts)] * 3
    assert unseen == put_back
    assert changed == again
    assert left == 0
    after, within = (run(training, 1, card, compile, in_backward, torch.optim.AdamW, "bf16", False)[0]
                     for in_backward in (False, True))
    assert_same_training(within, after)


def test_where_the_layers_let_their_casts_go_the_step_keeps_none(card):
    """With reshard_after_forward (the default) the backward frees a layer's activations as the steps
    go, and their casts would pile up instead: none is kept, and the forwards cast what the parts hold."""
    counts, (unseen, put_back), _, _, _ = run(kept_casts, 1, card, None, True)[0]
    assert counts == [(0, 0)] * 3
    assert unseen != put_back
