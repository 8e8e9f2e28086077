"""Adam's step of one flat f32 part on the GPU, by kernel: ATen's fused AdamW (what `fused=True` runs) and
Linnet's (`linnet::adam_step_` on CUDA: csrc/cuda/adam_step.cu), with an f32 gradient and a bf16 one. Prints
each one's time and the bandwidth it reaches (bytes moved: the part and both moments read and written, the
gradient read). The sizes are the parts of Llama 3.2 1B (a layer; the tied embedding), 3.2 3B and 3.1 8B
(a layer).

    python3 benchmarks/adam_bench.py [--sizes N ...] [--repeats 20]"""

import argparse

import torch

import linnet.torch.ops as ops
from common import cuda_seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[60_821_504, 262_668_288, 100_669_440, 218_112_000])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    lr = torch.tensor(1e-4, dtype=torch.float64)  # as the step in the backward passes it: on the host
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for size in args.sizes:
        param, exp_avg, exp_avg_sq = (torch.randn(size, device="cuda") for _ in range(3))
        exp_avg_sq.abs_()
        grad = torch.randn(size, device="cuda")
        grad_bf16 = grad.bfloat16()
        step = torch.zeros((), device="cuda")
        runs = {
            "aten, f32 gradient": (lambda: torch._fused_adamw_(
                [param], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=lr, beta1=0.9, beta2=0.95,
                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False), 4),
            "linnet, f32 gradient": (lambda: ops.adam_step(
                param, exp_avg, exp_avg_sq, step, grad, lr, 0.9, 0.95, 0.1, 1e-8), 4),
            "linnet, bf16 gradient": (lambda: ops.adam_step(
                param, exp_avg, exp_avg_sq, step, grad_bf16, lr, 0.9, 0.95, 0.1, 1e-8), 2),
        }
        for name, (function, gradient_bytes) in runs.items():
            seconds = cuda_seconds(function, args.repeats)
            moved = size * (3 * 8 + gradient_bytes)
            print(f"RESULT size {size:>11,} {name:<22} {seconds * 1e3:8.3f} ms {moved / seconds / 1e12:6.2f} TB/s")


if __name__ == "__main__":
    main()
