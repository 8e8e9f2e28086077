"""How far a training that steps in the backward and one that steps after it part on one GPU: each part's
distance and the elements that differ, for the cases of tests/test_gpu.py's
`test_the_step_in_the_backward_equals_the_step_after_on_the_gpu`, run one after another in one process as
pytest runs them. Eager they were equal to the bit on an H100; compiled, the two functions round their bf16
gradients apart, by an amount that changed from machine to machine (benchmarks/NOTES.md, twenty-third session).

    python3 benchmarks/step_in_backward_diff.py [--cases True-None,True-inductor] [--eps 1e-6]

A case is reshard_after_forward-compile, as pytest names it."""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_gpu import ROW, rows  # noqa: E402 (the test's rows)

from linnet import nest  # noqa: E402
from linnet.torch import fully_shard  # noqa: E402
from linnet.train import train  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--cases", default="True-None,True-inductor,False-None,False-inductor")
parser.add_argument("--eps", type=float, default=1e-6)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
for case in args.cases.split(","):
    reshard, compile = case.split("-")
    runs = []
    for in_backward in (False, True):
        model = fully_shard(nest.load("tiny-llama", device="cuda", numerics="fast", generics={"Batch": 1, "MaxSeq": ROW, "T": "bf16"},
                                      cast_dtype=True, trainable=True, weights="random", entry="loss_packed",
                                      compile=None if compile == "None" else compile),
                            reshard_after_forward=reshard == "True")
        optimizer = torch.optim.AdamW(list(model.parameters()), lr=3e-3, weight_decay=0.1, eps=args.eps, fused=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
        history = train(model, iter(rows(args.steps)), optimizer=optimizer, steps=args.steps, schedule=schedule,
                        on_step=lambda s: None, step_in_backward=in_backward)
        runs.append(([s.loss for s in history.steps], [p.detach().cpu().clone() for p in model.parameters()]))
    (losses_after, parts_after), (losses_within, parts_within) = runs
    print(f"== {case}: losses after {losses_after}, within {losses_within}", flush=True)
    for index, (within, after) in enumerate(zip(parts_within, parts_after)):
        distance = float((within - after).norm() / after.norm())
        print(f"  part {index} {tuple(after.shape)}: {distance:.3e} of its norm, {int((within != after).sum())} elements differ",
              flush=True)
dist.destroy_process_group()
