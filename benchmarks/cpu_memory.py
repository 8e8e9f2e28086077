"""The host's peak memory over a few training steps on the CPU (one process,
Gloo, eager), with the optimizer's step in the backward or after it: what the
gradients that are never all held at once are worth, measured where no GPU is.

    python benchmarks/cpu_memory.py --card qwen2.5-0.5b              # steps in the backward
    python benchmarks/cpu_memory.py --card qwen2.5-0.5b --step-after

Prints a RESULT line: the process's peak resident memory (ru_maxrss) and the
parts' bytes, for the difference between two runs to be read against them.
"""

import argparse
import json
import os
import resource

import numpy as np
import torch
import torch.distributed as dist

from linnet import nest
from linnet.packing import Row
from linnet.torch import fully_shard
from linnet.train import train

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--card", default="qwen2.5-0.5b")
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--step-after", action="store_true", help="train(step_in_backward=False)")
args = parser.parse_args()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29541")
dist.init_process_group("gloo", rank=0, world_size=1)
model = nest.load(args.card, backend="torch", device="cpu", numerics="fast", compile=None,
                  generics={"Batch": 1, "MaxSeq": args.tokens, "T": "bf16"}, cast_dtype=True, trainable=True,
                  weights="random", entry="loss_packed")
fully_shard(model)
optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-5, fused=True)
rng = np.random.default_rng(0)
vocab = model.checked.dims["Vocab"]


def row() -> Row:
    tokens = rng.integers(0, vocab, args.tokens, dtype=np.int32)
    return Row(tokens, np.roll(tokens, -1), np.arange(args.tokens, dtype=np.int32),
               np.zeros(args.tokens, dtype=np.int32), np.ones(args.tokens, dtype=np.float32), 1)


train(model, (row() for _ in range(args.steps)), optimizer=optimizer, steps=args.steps, on_step=lambda s: None,
      step_in_backward=not args.step_after)
parts = sum(p.numel() * p.element_size() for p in model.parameters())
print("RESULT " + json.dumps(dict(card=args.card, step_in_backward=not args.step_after, tokens=args.tokens,
                                  parts_gib=round(parts / 2**30, 3),
                                  peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3))))
dist.destroy_process_group()
