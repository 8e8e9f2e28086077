"""Attention over packed rows, side by side on one GPU (docs/design/kernels.md).

Each candidate computes causal attention in which the documents of a row never
see each other, forward and backward, in bf16, on (batch 1, seq S) rows of a
Llama shape. The reference for speed is cuDNN's causal SDPA on a row of one
document (what the plain compiled ceiling runs); the reference for numbers is
exact attention in f32 over the dense document mask. Prints one RESULT line a
candidate and layout:

    python3 benchmarks/attention.py --shape 8b [--seq 4096] [--reps 20]

Candidates:
  sdpa-cudnn, sdpa-flash  causal SDPA: right only for a row of one document
  flex-same-doc           flex attention, mask `kv <= q and segment[q] == segment[kv]` (today's)
  flex-doc-start          flex attention, mask `document_start[q] <= kv <= q`, and tuned block sizes
  varlen-flash            FlashAttention-2 over cu_seqlens (torch.nn.attention.varlen)
  varlen-cudnn            cuDNN over cu_seqlens (aten._cudnn_attention_forward); with key/value heads
                          repeated; with cu_seqlens padded by empty documents to a fixed length
  flex-*-flash            flex attention's FLASH backend (FlashAttention-4, the flash-attn-4 package)
  varlen-fa4              FlashAttention-4 over cu_seqlens (flash_attn.cute.flash_attn_varlen_func)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

SHAPES = {"1b": (32, 8, 64), "3b": (24, 8, 128), "8b": (32, 8, 128), "70b": (64, 8, 128)}  # heads, kv heads, head dim


def document_lengths(seq: int, seed: int) -> list[int]:
    """Documents of the lengths chat fine-tuning packs: mostly a few hundred tokens, a few long."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], seq
    while left > 0:
        n = int(torch.empty(1).log_normal_(6.0, 0.8, generator=g).clamp(16, 3000))
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


def layout(lengths: list[int], device) -> dict:
    seq = sum(lengths)
    segments = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                       torch.tensor(lengths, device=device))[None]  # (1, S)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    # (1, S): each token's document start
    starts = cu[:-1].repeat_interleave(torch.tensor(lengths, device=device))[None]
    return dict(seq=seq, segments=segments, cu=cu, starts=starts, documents=len(lengths))


def exact(q, k, v, segments):
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    seq = q.shape[2]
    mask = ((segments[:, :, None] == segments[:, None, :])
            & torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril())
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


def to_thd(x):  # (1, H, S, Dh) -> (S, H, Dh)
    return x[0].transpose(0, 1).contiguous()  # a no-op for heads split as the model splits them


def from_thd(x):
    return x.transpose(0, 1)[None]


def cudnn_varlen(q, k, v, cu, max_len):
    """cuDNN's attention over cu_seqlens, causal within each document; (T, H, Dh) in and out.
    Differentiable through aten's own derivative of _cudnn_attention_forward."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False)[0]


def candidates(lay: dict, heads: int, kv_heads: int):
    seq, segments, starts, cu = lay["seq"], lay["segments"], lay["starts"], lay["cu"]
    groups = heads // kv_heads

    def same_document(b, h, q, kv):
        return (kv <= q) & (segments[b, q] == segments[b, kv])

    def from_document_start(b, h, q, kv):
        return (kv <= q) & (kv >= starts[b, q])

    same_mask = create_block_mask(same_document, 1, None, seq, seq, device="cuda")
    start_mask = create_block_mask(from_document_start, 1, None, seq, seq, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return run

    def varlen_flash(q, k, v):
        from torch.nn.attention.varlen import varlen_attn
        return from_thd(varlen_attn(to_thd(q), to_thd(k), to_thd(v), cu, cu, seq, seq, window_size=(-1, 0),
                                    enable_gqa=True))

    def varlen_cudnn(cu, repeat=False):
        def run(q, k, v):
            if repeat:
                k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            return from_thd(cudnn_varlen(to_thd(q), to_thd(k), to_thd(v), cu, seq))
        return run

    def padded(count):  # cu_seqlens of a fixed length: empty documents after the last
        return torch.cat([cu, cu.new_full((count + 1 - len(cu),), seq)])

    def varlen_fa4(q, k, v):
        from flash_attn.cute import flash_attn_varlen_func
        out = flash_attn_varlen_func(to_thd(q), to_thd(k), to_thd(v), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=seq, max_seqlen_k=seq, causal=True)
        return from_thd(out[0] if isinstance(out, tuple) else out)

    found = {
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "flex-same-doc": lambda q, k, v: flex(q, k, v, block_mask=same_mask, enable_gqa=True),
        "flex-doc-start": lambda q, k, v: flex(q, k, v, block_mask=start_mask, enable_gqa=True),
        "flex-doc-start-128x64-w8": lambda q, k, v: flex(q, k, v, block_mask=start_mask, enable_gqa=True,
                                                         kernel_options=dict(BLOCK_M=128, BLOCK_N=64, num_warps=8)),
        "varlen-flash": varlen_flash,
        "varlen-cudnn": varlen_cudnn(cu),
        "varlen-cudnn-repeat-kv": varlen_cudnn(cu, repeat=True),
        "varlen-cudnn-pad64": varlen_cudnn(padded(64)),
        "varlen-cudnn-pad-seq": varlen_cudnn(padded(seq)),
    }
    if importlib.util.find_spec("flash_attn") is not None:
        found["varlen-fa4"] = varlen_fa4
        found["flex-same-doc-flash"] = lambda q, k, v: flex(q, k, v, block_mask=same_mask, enable_gqa=True,
                                                            kernel_options={"BACKEND": "FLASH"})
        found["flex-doc-start-flash"] = lambda q, k, v: flex(q, k, v, block_mask=start_mask, enable_gqa=True,
                                                             kernel_options={"BACKEND": "FLASH"})
    return found


def timed(fn, q, k, v, grad, reps: int) -> tuple[float, float]:
    """Median milliseconds of the forward alone, and of forward plus backward."""
    def events(step):
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[2:])

    def both():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(grad)

    with torch.no_grad():
        forward = events(lambda: fn(q, k, v))
    return forward, events(both)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", default="", help="comma-separated candidate names")
    a = p.parse_args()
    heads, kv_heads, head_dim = SHAPES[a.shape]
    torch.manual_seed(0)
    def heads_of(count):  # (1, H, S, Dh) over (1, S, H, Dh) memory, as the model's split_heads makes them
        x = torch.randn(1, a.seq, count, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return x.requires_grad_()

    q, k, v = heads_of(heads), heads_of(kv_heads), heads_of(kv_heads)
    grad = torch.randn(1, heads, a.seq, head_dim, device="cuda", dtype=torch.bfloat16)
    for name, lengths in (("one-document", [a.seq]), ("packed", document_lengths(a.seq, seed=0))):
        lay = layout(lengths, "cuda")
        reference = exact(q, k, v, lay["segments"])
        ref_grads = torch.autograd.grad(reference, (q, k, v), grad.float())
        for cand, fn in candidates(lay, heads, kv_heads).items():
            if a.only and cand not in a.only.split(","):
                continue
            if cand.startswith("sdpa") and lay["documents"] > 1:
                continue  # causal only: wrong across documents
            try:
                out = fn(q, k, v)
                grads = torch.autograd.grad(out, (q, k, v), grad)
                errors = [((x.float() - r).abs().max() / r.abs().max()).item()
                          for x, r in zip((out, *grads), (reference, *ref_grads))]
                forward, both = timed(fn, q, k, v, grad, a.reps)
                print("RESULT " + json.dumps(dict(
                    shape=a.shape, layout=name, documents=lay["documents"], candidate=cand,
                    forward_ms=round(forward, 3), forward_backward_ms=round(both, 3),
                    rel_error=[f"{e:.1e}" for e in errors])), flush=True)
            except Exception as e:  # noqa: BLE001  (a candidate this torch or GPU lacks: say so and go on)
                print("RESULT " + json.dumps(dict(shape=a.shape, layout=name, candidate=cand,
                                                  error=f"{type(e).__name__}: {str(e)[:300]}")), flush=True)


if __name__ == "__main__":
    main()
