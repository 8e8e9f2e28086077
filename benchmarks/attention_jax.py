"""JAX attention over packed rows, side by side on one GPU (docs/design/jax_speed.md).

The JAX twin of benchmarks/attention.py: each candidate computes causal attention
in which the documents of a row never see each other, forward and backward, in
bf16, on one row of S positions of a Llama shape, laid out (B, S, H, Dh) as
jax.nn.dot_product_attention takes it. The reference for speed is cuDNN's causal
attention on a row of one document; the reference for numbers is exact f32
attention over the dense document mask. One RESULT line a candidate and layout:

    python3 benchmarks/attention_jax.py --shape 8b [--seq 4096] [--reps 20]

Candidates:
  xla-mask            jax.nn.dot_product_attention, XLA, the dense (B, 1, S, S) mask (what `fast` ran)
  cudnn-mask          cuDNN's fused attention with the mask as a bias (jax.nn, implementation="cudnn")
  cudnn-mask-causal   the same, told the mask is also causal (cuDNN skips the upper triangle)
  cudnn-packed-M      cuDNN's packed layout: each document a segment by its offset and length, at most M a row
  pallas-segments     Pallas's GPU flash attention (jax.experimental.pallas.ops.gpu.attention) with segment ids
  cudnn-causal        causal attention, right only for a row of one document (the speed to reach)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {"1b": (32, 8, 64), "3b": (24, 8, 128), "8b": (32, 8, 128), "70b": (64, 8, 128)}  # heads, kv heads, head dim


def document_lengths(seq: int, seed: int) -> list[int]:
    """Documents of the lengths chat fine-tuning packs (as benchmarks/common.py's packed rows)."""
    rng = np.random.default_rng(seed)
    ends = np.cumsum(np.clip(rng.lognormal(6.0, 0.8, seq // 16), 16, 3000).astype(int))
    return [int(n) for n in np.diff(np.unique(np.r_[0, ends, seq].clip(0, seq)))]


def segments_of(lengths: list[int]) -> jnp.ndarray:
    return jnp.asarray(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None])  # (1, S)


def document_mask(segments):
    seq = segments.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]  # (B, 1, S, S)


def packed_offsets(segments, most: int):
    """Each row's documents as cuDNN's packed layout wants them: lengths (B, M) and starts (B, M + 1),
    -1 past the row's last document; segments are 0, 1, ... along a row."""
    lengths = jax.vmap(lambda s: jnp.bincount(s, length=most))(segments).astype(jnp.int32)  # (B, M)
    starts = jnp.cumsum(lengths, axis=1) - lengths  # (B, M)
    present = lengths > 0
    lengths, starts = jnp.where(present, lengths, -1), jnp.where(present, starts, -1)
    return lengths, jnp.concatenate([starts, jnp.full_like(starts[:, :1], -1)], axis=1)


def exact(q, k, v, segments):
    groups = q.shape[2] // k.shape[2]
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    scores = jnp.where(document_mask(segments), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def candidates(segments, documents: int, seq: int):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    mask = document_mask(segments)

    def packed(most):
        def run(q, k, v):
            lengths, starts = packed_offsets(segments, most)
            return cudnn_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts, kv_offsets=starts,
                                   scale=q.shape[-1] ** -0.5, mask_type=MaskType.PADDING_CAUSAL)
        return run

    def pallas(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        return pallas_attention.mha(q, k, v, segments, sm_scale=q.shape[-1] ** -0.5, causal=True)

    out = {
        "xla-mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla"),
        "cudnn-mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn"),
        "cudnn-mask-causal": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                                                         implementation="cudnn"),
        "pallas-segments": pallas,
        "cudnn-causal": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
    }
    for most in sorted({documents, -(-documents // 64) * 64, 256, seq // 16}):
        if most >= documents:
            out[f"cudnn-packed-{most}"] = packed(most)
    return out


def measure(name, attend, q, k, v, segments, reference, reps):
    cotangent = jax.random.normal(jax.random.key(3), q.shape, jnp.float32).astype(q.dtype)

    def forward_backward(q, k, v):
        out, pull = jax.vjp(attend, q, k, v)
        return (out, *pull(cotangent))

    step = jax.jit(forward_backward)
    try:
        compiled = step.lower(q, k, v).compile()
        outputs = compiled(q, k, v)
        jax.block_until_ready(outputs)
    except Exception as e:  # noqa: BLE001 - a candidate that does not run here is a result too
        return dict(candidate=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    scratch = compiled.memory_analysis().temp_size_in_bytes if compiled.memory_analysis() else None
    errors = {
        part: float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / (jnp.max(jnp.abs(want)) + 1e-30))
        for part, got, want in zip(("out", "dq", "dk", "dv"), outputs, reference)
    }
    for _ in range(3):
        jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - start)
    return dict(candidate=name, ms=round(statistics.median(times) * 1e3, 3), scratch_mb=round((scratch or 0) / 1e6, 1),
                max_relative_error={p: round(e, 5) for p, e in errors.items()})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b", choices=SHAPES)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", help="comma-separated candidates")
    args = parser.parse_args()
    heads, kv_heads, head_dim = SHAPES[args.shape]
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, args.seq, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, args.seq, kv_heads, head_dim), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, args.seq, kv_heads, head_dim), jnp.float32).astype(jnp.bfloat16)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    for layout, lengths in (("one document", [args.seq]), ("packed", document_lengths(args.seq, 0))):
        segments = segments_of(lengths)
        cotangent = jax.random.normal(jax.random.key(3), q.shape, jnp.float32).astype(q.dtype).astype(jnp.float32)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        out, pull = jax.vjp(functools.partial(exact, segments=segments), *f32)
        reference = (out, *pull(cotangent))
        for name, attend in candidates(segments, len(lengths), args.seq).items():
            if args.only and name.split("-packed")[0] not in args.only.split(",") and name not in args.only.split(","):
                continue
            result = measure(name, attend, q, k, v, segments, reference, args.reps)
            if name == "cudnn-causal" and len(lengths) > 1:
                result["note"] = "wrong here (documents see each other): the speed of the whole triangle"
            print("RESULT " + json.dumps(dict(shape=args.shape, seq=args.seq, layout=layout, documents=len(lengths),
                                              **result)), flush=True)


if __name__ == "__main__":
    main()
