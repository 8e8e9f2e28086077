"""A small training run for the crash tests, started by torchrun:

    torchrun --nproc_per_node=2 tests/train_driver.py OUT [--die-once MARKER --die-at STEP --die-rank R]

Trains the tiny card over Gloo with a checkpoint every 2 steps in OUT/ckpt,
appends each step's loss to OUT/losses.jsonl (rank 0) and writes the final
weights to OUT/weights. With --die-once, the first run whose MARKER does not
exist creates it and SIGKILLs rank R at step STEP: the same command run again
resumes."""

import argparse
import json
import os
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from linnet import nest
from linnet.data.packing import Example, pack
from linnet.torch import fully_shard
from linnet.torch.train import cosine_schedule, train

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--die-once", type=Path)
parser.add_argument("--die-at", type=int, default=5)
parser.add_argument("--die-rank", type=int, default=1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rng = np.random.default_rng(0)
examples = [Example.prompted(rng.integers(6, 512, rng.integers(3, 20)).tolist(),
                             rng.integers(6, 512, rng.integers(2, 12)).tolist())
            for _ in range(400)]
rows = list(pack(examples, 64))
model = nest.load("tiny-llama", numerics="fast", generics={"Batch": 1, "MaxSeq": 64, "T": "f32"}, cast_dtype=True,
                  trainable=True, weights="random", entry="loss_packed")
fully_shard(model)
optimizer = torch.optim.AdamW(list(model.parameters()), lr=3e-3, weight_decay=0.0)
schedule = cosine_schedule(optimizer, 2, args.steps, floor=0.1)
die = args.die_once is not None and not args.die_once.exists()
dist.barrier()
if die and rank == 0:
    args.die_once.touch()


def on_step(step):
    if rank == 0:
        with open(args.out / "losses.jsonl", "a") as f:
            f.write(json.dumps({"step": step.step, "loss": step.loss}) + "\n")
    if die and rank == args.die_rank and step.step == args.die_at:
        os.kill(os.getpid(), signal.SIGKILL)


args.out.mkdir(parents=True, exist_ok=True)
train(model, iter(rows[rank::world]), optimizer=optimizer, steps=args.steps, schedule=schedule, on_step=on_step,
      checkpoint=args.out / "ckpt", checkpoint_every=2)
model.save_weights(args.out / "weights", dtype=torch.float32)
dist.destroy_process_group()
