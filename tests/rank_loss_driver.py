"""A sharded run in which one rank dies or errs, for tests/test_rank_loss.py, started by torchrun:

    torchrun --nproc_per_node=2 tests/rank_loss_driver.py OUT --kill-rank 1 --at 3
    torchrun --nproc_per_node=2 tests/rank_loss_driver.py OUT --bad-shape-rank 1 --at 2
    torchrun --nproc_per_node=2 tests/rank_loss_driver.py OUT --stop-rank 1 --at 3
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d ... \\
        tests/rank_loss_driver.py OUT [--kill-this-machine] --at 3

Trains the tiny card sharded over Gloo, in linnet's `train` (--kill-rank: that
rank SIGKILLs itself after step --at; --stop-rank: SIGSTOPs itself; --kill-this-machine: given to one
torchrun of several, its first rank SIGKILLs that torchrun, its other workers and itself, after writing
their ranks to OUT/lost) or in a user's own loop (--bad-shape-rank:
that rank passes a row one position longer than MaxSeq at step --at). Before
dying, the rank writes the time (time.time()) to OUT/killed_at; every rank that
raises writes OUT/error-RANK with the exception's type and message, then raises."""

import argparse
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from linnet import nest
from linnet.data.packing import LOSS_PACKED_INPUTS, Example, pack
from linnet.torch import fully_shard
from linnet.torch.train import train

ROW = 64

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--at", type=int, default=3)
parser.add_argument("--kill-rank", type=int)
parser.add_argument("--stop-rank", type=int)
parser.add_argument("--kill-this-machine", action="store_true")
parser.add_argument("--bad-shape-rank", type=int)
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rng = np.random.default_rng(0)
examples = [Example.prompted(rng.integers(6, 512, rng.integers(3, 20)).tolist(),
                             rng.integers(6, 512, rng.integers(2, 12)).tolist())
            for _ in range(200)]
rows = list(pack(examples, ROW))[rank::world]
model = fully_shard(nest.load("tiny-llama", numerics="fast", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"},
                              cast_dtype=True, trainable=True, weights="random", entry="loss_packed"))
optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-3)


def die(step) -> None:
    if step.step == args.at and rank in (args.kill_rank, args.stop_rank):
        (args.out / "killed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if rank == args.kill_rank else signal.SIGSTOP)
    if step.step == args.at and args.kill_this_machine and int(os.environ["LOCAL_RANK"]) == 0:
        (args.out / "lost").write_text(" ".join(str(rank + r) for r in range(int(os.environ["LOCAL_WORLD_SIZE"]))))
        (args.out / "killed_at").write_text(repr(time.time()))
        agent = os.getppid()  # the machine's torchrun, then its workers: as if the machine lost power
        workers = [int(pid) for pid in Path(f"/proc/{agent}/task/{agent}/children").read_text().split()]
        os.kill(agent, signal.SIGKILL)
        for pid in [pid for pid in workers if pid != os.getpid()] + [os.getpid()]:
            os.kill(pid, signal.SIGKILL)


def tensors(row, extra: int = 0) -> list[torch.Tensor]:
    fields = [getattr(row, name) for name in LOSS_PACKED_INPUTS]
    return [torch.from_numpy(np.concatenate([f, f[:extra]]))[None] for f in fields]


def users_loop() -> None:
    """What a user writes instead of linnet's train: no agreement of its own."""
    for step in range(1, args.steps + 1):
        bad = rank == args.bad_shape_rank and step == args.at
        loss = model.loss_packed(*tensors(rows[step], extra=1 if bad else 0))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {float(loss):.3f}", flush=True)


try:
    if args.bad_shape_rank is not None:
        users_loop()
    else:
        train(model, iter(rows), optimizer=optimizer, steps=args.steps, on_step=die)
except Exception as error:
    (args.out / f"error-{rank}").write_text(f"{type(error).__name__}: {error}")
    raise
dist.destroy_process_group()
