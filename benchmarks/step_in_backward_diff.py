"""How far a training that steps in the backward and one that steps after it part on one GPU: each part's
distance and the elements that differ, for the cases of tests/test_gpu.py's
`test_the_step_in_the_backward_equals_the_step_after_on_the_gpu`, run one after another in one process as
pytest runs them. Eager they are equal to the bit; compiled, the two functions round their bf16 gradients
apart, by an amount that differs from machine to machine (docs/design/step_in_backward.md).

    python3 benchmarks/step_in_backward_diff.py [--cases True-None,True-inductor] [--eps 1e-6]

A case is reshard_after_forward-compile, as pytest names it."""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_gpu import trained_after_and_within  # noqa: E402 (the test's trainings)

parser = argparse.ArgumentParser()
parser.add_argument("--cases", default="True-None,True-inductor,False-None,False-inductor")
parser.add_argument("--eps", type=float, default=1e-6)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
for case in args.cases.split(","):
    reshard, compile = case.split("-")
    (losses_after, parts_after), (losses_within, parts_within) = trained_after_and_within(
        None if compile == "None" else compile, reshard == "True", args.steps, args.eps)
    print(f"== {case}: losses after {losses_after}, within {losses_within}", flush=True)
    for index, (within, after) in enumerate(zip(parts_within, parts_after)):
        distance = float((within - after).norm() / after.norm())
        print(f"  part {index} {tuple(after.shape)}: {distance:.3e} of its norm, "
              f"{int((within != after).sum())} elements differ", flush=True)
dist.destroy_process_group()
