"""Linnet's training step on random weights and tokens, the way the FSDP2
probe (benchmarks/peers/fsdp2_baseline.py) measures its peer: one packed
4096-token row a GPU a step, median step after warm-up, tokens/s, peak memory.

    torchrun --nproc_per_node=1 benchmarks/step.py --card llama-3.2-1b --steps 30
"""

import argparse
import functools
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from common import flops_per_token, load_rows, parameters, random_rows

from linnet import nest
from linnet.emit import prims_torch
from linnet.torch import collectives, fully_shard
from linnet.torch.train import evaluate, train

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--card", default="llama-3.2-1b")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--tokens", type=int, default=4096)
parser.add_argument("--recompute", default="gather", choices=["gather", "matmuls", "full"])
parser.add_argument("--no-reshard", action="store_true", help="fully_shard(reshard_after_forward=False): each layer's "
                    "gathered weights (on one rank, its cast) kept from the forward to the backward")
parser.add_argument("--prefetch", type=int, default=1, help="layers whose gathers run ahead (fully_shard's prefetch)")
parser.add_argument("--reduce-dtype", default="f32", choices=["f32", "bf16"])
parser.add_argument("--no-compile", action="store_true")
parser.add_argument("--step-after", action="store_true", help="the optimizer steps after the backward, holding every "
                    "gradient at once (train(step_in_backward=False)); by default each part steps in the backward")
parser.add_argument("--accumulate", type=int, default=1, help="rows a rank takes for one optimizer step (train's "
                    "accumulate): the optimizer then steps after the last row's backward")
parser.add_argument("--hold-gradients", action="store_true", help="with --accumulate, the rows but the last hold "
                    "their whole gradients, reduce-scattered once a step (train's hold_gradients)")
parser.add_argument("--max-grad-norm", type=float, default=None, help="clip at this global gradient norm (train's "
                    "max_grad_norm): the optimizer then steps after the backward, once the norm is known")
parser.add_argument("--mesh", metavar="MACHINESxGPUS", help="hybrid sharding over a (replicate, shard) mesh of that "
                    "shape, e.g. 2x4 (default: one flat group)")
parser.add_argument("--packed", action="store_true",
                    help="rows of several documents (chat fine-tuning's lengths) instead of one each: attention under "
                    "the document mask rather than causal attention")
parser.add_argument("--init", help="start from this Hugging Face checkpoint folder (benchmarks/shared_start.py) "
                    "instead of random weights")
parser.add_argument("--rows", help="train on this .npz of rows (shared_start.py; rank r takes rows r, r + W, ...) "
                    "instead of random ones")
parser.add_argument("--held-out", help="report the held-out loss over this .npz of rows before and after training")
parser.add_argument("--memory-trace", action="store_true", help="after each step, the memory allocated and the "
                    "collectives c10d still holds un-waited (its work registry): what a step leaves behind")
parser.add_argument("--profile", metavar="FOLDER",
                    help="trace the last two steps (torch.profiler): FOLDER/trace.json.gz and the compute stream's "
                    "idle gaps (benchmarks/trace_gaps.py)")
parser.add_argument("--memory-snapshot", metavar="FILE",
                    help="record the allocator over the last step and write its snapshot "
                    "(torch.cuda.memory._dump_snapshot); benchmarks/memory_peak.py reads what is live at the peak")
parser.add_argument("--compile-times", action="store_true", help="after the run, where the compile's seconds went: "
                    "dynamo's, AOT autograd's and inductor's phases, the longest first (rank 0)")
parser.add_argument("--loss", default="generated", choices=["generated", "op"], help="the loss: the generated code's "
                    "F.cross_entropy, compiled, or Linnet's op that never holds the logits whole "
                    "(csrc/linear_cross_entropy.cpp), swapped into the fast numerics to compare")
parser.add_argument("--loss-rows", type=int, default=1024, help="with --loss op: the rows of each of its chunks")
parser.add_argument("--casts-from-step", default="auto", choices=["auto", "always", "never"], help="on one rank, "
                    "whether Adam's step writes each part's cast for the next forward: as fully_shard decides "
                    "(linnet/torch/collectives.py, `_casts_from_the_step`), or forced either way to compare")
args = parser.parse_args()
if args.casts_from_step != "auto":
    collectives._casts_from_the_step = lambda sharding: args.casts_from_step == "always"
if args.loss == "op":  # before the card is loaded: the emitter copies the primitives it finds there
    prims_torch.FAST["cross_entropy"] = functools.partial(prims_torch.cross_entropy_in_one_op, rows=args.loss_rows)

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
device = torch.device("cuda", torch.cuda.current_device())
start = time.perf_counter()
# every entry: train takes `loss` for one-document rows
model = nest.load(args.card, backend="torch", device=device, numerics="fast",
                  compile=None if args.no_compile else "inductor",
                  generics={"Batch": 1, "MaxSeq": args.tokens, "T": "bf16"},
                  cast_dtype=True, trainable=True, weights=args.init or "random")
mesh = None
if args.mesh:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", tuple(int(n) for n in args.mesh.split("x")), mesh_dim_names=("replicate", "shard"))
fully_shard(model, mesh=mesh, recompute=args.recompute, reshard_after_forward=not args.no_reshard,
            prefetch=args.prefetch, reduce_dtype=torch.float32 if args.reduce_dtype == "f32" else torch.bfloat16)
torch.cuda.synchronize()
load_s, load_peak = time.perf_counter() - start, torch.cuda.max_memory_allocated()  # nest.load and fully_shard
optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-5, weight_decay=0.0, fused=True)
torch.cuda.reset_peak_memory_stats()
profiler = None
if args.profile:
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA],
                                      schedule=torch.profiler.schedule(wait=args.steps - 3, warmup=1, active=2))
    profiler.start()


def on_step(s):
    if rank == 0:
        print(f"step {s.step} loss {s.loss:.3f} {s.seconds:.3f}s", flush=True)
        if args.memory_trace:
            from torch._C._distributed_c10d import _get_work_registry_size

            print(f"  allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, un-waited collectives "
                  f"{_get_work_registry_size()}", flush=True)
    if profiler is not None:
        profiler.step()
    if args.memory_snapshot and s.step == args.steps - 2:  # record the last step, compiled and warm
        torch.cuda.synchronize()
        print(f"  recording the allocator from {torch.cuda.memory_allocated()} bytes allocated", flush=True)
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")


held_out = load_rows(args.held_out, rank, world) if args.held_out else None
loss_start = evaluate(model, held_out) if held_out else None
rows = (load_rows(args.rows, rank, world) if args.rows
        else random_rows(rank, args.tokens, model.checked.dims["Vocab"], args.packed))
whole_gradient = args.accumulate > 1 or args.max_grad_norm is not None  # train then steps after the backward
history = train(model, iter(rows), optimizer=optimizer, steps=args.steps, on_step=on_step,
                step_in_backward=not (args.step_after or whole_gradient), accumulate=args.accumulate,
                max_grad_norm=args.max_grad_norm, hold_gradients=args.hold_gradients)
if profiler is not None:
    profiler.stop()
    if rank == 0:
        os.makedirs(args.profile, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(args.profile, "trace.json.gz"))
        print(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=30), flush=True)
if args.memory_snapshot:
    torch.cuda.memory._dump_snapshot(args.memory_snapshot)
    torch.cuda.memory._record_memory_history(enabled=None)
loss_end = evaluate(model, held_out) if held_out else None
step = statistics.median(s.seconds for s in history.steps[3:])
seq = args.tokens
result = dict(card=args.card, world=world, mesh=args.mesh, packed=args.packed, recompute=args.recompute,
              reshard_after_forward=not args.no_reshard, loss=args.loss, casts_from_step=args.casts_from_step,
              prefetch=args.prefetch,
              reduce_dtype=args.reduce_dtype, compiled=not args.no_compile,
              step_in_backward=not (args.step_after or whole_gradient), accumulate=args.accumulate,
              max_grad_norm=args.max_grad_norm, hold_gradients=args.hold_gradients,
              row_s=round(step / args.accumulate, 4),
              params=parameters(model), step_s=round(step, 4), tok_s=round(world * seq * args.accumulate / step),
              tflops_gpu=round(flops_per_token(model, seq) * seq * args.accumulate / step / 1e12, 1),
              peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
              first_steps_s=[round(s.seconds, 2) for s in history.steps[:3]],
              setup_s=round(time.perf_counter() - start, 1),
              load_s=round(load_s, 1), load_peak_gib=round(load_peak / 2**30, 2),
              losses=[round(s.loss, 4) for s in history.steps], loss_start=loss_start, loss_end=loss_end)
if rank == 0:
    print("RESULT " + json.dumps(result), flush=True)
if args.compile_times and rank == 0:
    from torch._dynamo.utils import compile_times

    names, seconds = compile_times(repr="csv", aggregate=True)  # "str" is a table whose layout varies
    for name, phase_seconds in sorted(zip(names, map(float, seconds)), key=lambda phase: -phase[1])[:25]:
        print(f"  {phase_seconds:8.2f} s  {name}", flush=True)
dist.destroy_process_group()
