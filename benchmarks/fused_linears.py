"""Would the generated layer gain from one matmul where several linears read the same input? A Llama layer's
q, k and v projections (and its gate and up projections) lie side by side in the layer's flat buffer, so one
view of it is their concatenated weight. Times forward and backward of the separate linears against the one
matmul and a split, compiled, in bf16 on one 4096-token row.

    python3 benchmarks/fused_linears.py [--shape 1b|3b|8b]"""

import argparse

import torch
import torch.nn.functional as F

from common import cuda_seconds

SHAPES = {"1b": (2048, [2048, 512, 512], [8192, 8192]), "3b": (3072, [3072, 1024, 1024], [8192, 8192]),
          "8b": (4096, [4096, 1024, 1024], [14336, 14336])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1b", choices=SHAPES)
    args = parser.parse_args()
    width, attention, mlp = SHAPES[args.shape]
    x = torch.randn(1, 4096, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for name, outs in (("qkv", attention), ("gate+up", mlp)):
        flat = torch.randn(sum(outs) * width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        def separate(x, flat):
            weights = flat.split([n * width for n in outs])
            return sum(F.linear(x, w.view(n, width)).float().sum() for w, n in zip(weights, outs))
        def fused(x, flat):
            return sum(y.float().sum() for y in F.linear(x, flat.view(sum(outs), width)).split(outs, dim=-1))
        for form, function in (("separate", separate), ("one matmul", fused)):
            compiled = torch.compile(function)
            ms = 1e3 * cuda_seconds(lambda: torch.autograd.grad(compiled(x, flat), (x, flat)), repeats=30, warmup=3)
            print(f"RESULT {args.shape} {name:<8} {form:<10} forward and backward {ms:.3f} ms")


if __name__ == "__main__":
    main()
