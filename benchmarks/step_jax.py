"""linnet.jax.train's step on random weights and tokens, measured as
benchmarks/step.py measures the PyTorch one: one packed 4096-token row a
device a step, every local device in the mesh, median step after warm-up,
tokens/s, peak memory.

    python benchmarks/step_jax.py --card llama-3.2-1b --steps 30 [--no-remat]
"""

import argparse
import glob
import json
import os
import shutil
import statistics
import time

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from common import flops_per_token, load_rows, parameters, random_rows

from linnet import nest
from linnet.jax.train import evaluate, train

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--card", default="llama-3.2-1b")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--tokens", type=int, default=4096)
parser.add_argument("--no-remat", dest="remat", action="store_false")
parser.add_argument("--scan", action="store_true",
                    help="run the layers by lax.scan over one stacked array (train's scan_layers)")
parser.add_argument("--packed", action="store_true",
                    help="rows of several documents (chat fine-tuning's lengths) instead of one document a row")
parser.add_argument("--profile", metavar="FOLDER", help="trace the last two steps (jax.profiler, with a Perfetto "
                    "trace: FOLDER/perfetto_trace.json.gz, which benchmarks/trace_gaps.py reads)")
parser.add_argument("--init", help="start from this Hugging Face checkpoint folder (benchmarks/shared_start.py)")
parser.add_argument("--rows", help="train on this .npz of rows (device d takes rows d, d + D, ...)")
parser.add_argument("--held-out", help="report the held-out loss over this .npz of rows before and after training")
args = parser.parse_args()

start = time.perf_counter()
model = nest.load(args.card, backend="jax_source", entry="loss_packed", numerics="fast",
                  generics={"Batch": 1, "MaxSeq": args.tokens, "T": "bf16"}, cast_dtype=True,
                  weights=args.init or "random")
print(f"loaded in {time.perf_counter() - start:.1f} s", flush=True)
mesh = Mesh(np.array(jax.devices()), ("data",))
count, seq = parameters(model), args.tokens
held_out = load_rows(args.held_out) if args.held_out else None
loss_start = evaluate(model, held_out) if held_out else None
rows = load_rows(args.rows) if args.rows else random_rows(0, seq, model.checked.dims["Vocab"], packed=args.packed)


def on_step(s):
    print(f"step {s.step} loss {s.loss:.3f} {s.seconds:.3f}s", flush=True)
    if args.profile and s.step == args.steps - 2:  # the last two steps
        jax.profiler.start_trace(args.profile, create_perfetto_trace=True)


_, history = train(model, iter(rows), optimizer=optax.adamw(1e-5, weight_decay=0.0), steps=args.steps,
                   mesh=mesh, remat=args.remat, scan_layers=args.scan, on_step=on_step)
if args.profile:
    jax.profiler.stop_trace()
    for found in glob.glob(os.path.join(args.profile, "**", "perfetto_trace.json.gz"), recursive=True):
        shutil.copy(found, os.path.join(args.profile, "perfetto_trace.json.gz"))
loss_end = evaluate(model, held_out) if held_out else None
step = statistics.median(s.seconds for s in history.steps[3:])
peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.devices())
result = dict(card=args.card, devices=mesh.size, remat=args.remat, scan=args.scan, packed=args.packed, params=count,
              step_s=round(step, 4), tok_s=round(mesh.size * seq / step),
              tflops_gpu=round(flops_per_token(model, seq) * seq / step / 1e12, 1),
              peak_gib=round(peak / 2**30, 2), first_steps_s=[round(s.seconds, 2) for s in history.steps[:3]],
              setup_s=round(time.perf_counter() - start, 1), losses=[round(s.loss, 4) for s in history.steps],
              loss_start=loss_start, loss_end=loss_end)
print("RESULT " + json.dumps(result), flush=True)
