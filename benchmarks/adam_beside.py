"""Whether Adam's step hides under the backward's products when it runs on a stream of its own: a layer's
backward products of Llama 3.2 1B (or --shape 3b) at one 4,096-token row, 16 (28) times, each followed by
Adam's step of a layer's part (`linnet::adam_step_`, a bf16 gradient), timed as a whole:

  products       the products alone
  adam           the steps alone
  serial         each step after its layer's products, on the one stream (what the step in the backward does)
  beside         each step on a side stream that waits for its layer's gradient (copied first, on the
                 compute stream, as a buffer the step owns), the compute stream going on at once
  beside, hi     the same with the products on a high-priority stream (the block scheduler favours it)

A step hidden entirely makes "beside" equal "products"; none of it, "serial".

    python3 benchmarks/adam_beside.py [--shape 1b] [--repeats 5]"""

import argparse

import torch

import linnet.torch.ops as ops
from common import cuda_seconds

SHAPES = {  # width, the products' output widths (q k v; o; gate up; down), the MLP's width, layers, a layer's
    # part, attention's heads and their width
    "1b": (2048, (3072, 2048, 16384, 2048), 8192, 16, 60_821_504, 32, 64),
    "3b": (3072, (5120, 3072, 16384, 3072), 8192, 28, 100_669_440, 24, 128),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    width, outs, ffn, layers, size, heads, head_width = SHAPES[args.shape]
    tokens, dev, bf16 = 4096, "cuda", torch.bfloat16
    x = torch.randn(tokens, width, device=dev, dtype=bf16)
    hidden = torch.randn(tokens, ffn, device=dev, dtype=bf16)
    weights = [torch.randn(out, width if i < 3 else ffn, device=dev, dtype=bf16) for i, out in enumerate(outs)]
    outs_grad = [torch.randn(tokens, out, device=dev, dtype=bf16) for out in outs]
    q = torch.randn(1, heads, tokens, head_width, device=dev, dtype=bf16, requires_grad=True)
    attn_out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    attn_grad = torch.randn_like(attn_out)
    parts = [torch.randn(size, device=dev) for _ in range(layers)]
    moments = [(torch.zeros(size, device=dev), torch.ones(size, device=dev)) for _ in range(layers)]
    grad = torch.randn(size, device=dev, dtype=bf16)
    step = torch.zeros((), device=dev)
    lr = torch.tensor(1e-6, dtype=torch.float64)
    side = torch.cuda.Stream()
    high = torch.cuda.Stream(priority=-1)

    def products():
        for w, g, i in zip(weights, outs_grad, range(4)):
            inputs = x if i < 3 else hidden
            g @ w  # the input's gradient
            g.t() @ inputs  # the weight's gradient
        torch.autograd.grad(attn_out, q, attn_grad, retain_graph=True)

    def adam(layer, gradient):
        ops.adam_step(parts[layer], *moments[layer], step, gradient, lr, 0.9, 0.95, 0.0, 1e-8)

    def serial():
        for layer in range(layers):
            products()
            adam(layer, grad)

    def beside():
        compute = torch.cuda.current_stream()
        for layer in range(layers):
            products()
            owned = grad.clone()  # the compute stream's work may reuse the gradient's buffer at once
            side.wait_stream(compute)
            owned.record_stream(side)
            with torch.cuda.stream(side):
                adam(layer, owned)
            del owned
        compute.wait_stream(side)

    def beside_high():
        high.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(high):
            beside()
        torch.cuda.current_stream().wait_stream(high)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.shape}")
    runs = {"products": lambda: [products() for _ in range(layers)],
            "adam": lambda: [adam(layer, grad) for layer in range(layers)],
            "serial": serial, "beside": beside, "beside, hi": beside_high}
    for name, function in runs.items():
        print(f"RESULT {name:<12} {cuda_seconds(function, args.repeats) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
