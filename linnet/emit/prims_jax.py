"""JAX implementations of the card primitives, for both numerics.

Like prims_torch.py: each function stands alone (jax, jnp, np and math only),
since the emitter copies its source into the generated module. EXACT follows
transformers' order of computation; FAST uses jax.nn.dot_product_attention and
a loss that never holds the whole row's f32 logits."""

import math

import jax
import jax.numpy as jnp
import numpy as np


def embedding(tokens, table):
    return jnp.take(table, tokens, axis=0)


def rms_norm(x, weight, eps):
    # As transformers: normalise in f32, cast back, then scale.
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return weight * x.astype(dtype)


def linear(x, weight):
    return jnp.einsum("...i,oi->...o", x, weight)


def linear_bias(x, weight, bias):
    return jnp.einsum("...i,oi->...o", x, weight) + bias


def split_heads(x, heads):
    batch, seq, width = x.shape
    return x.reshape(batch, seq, heads, width // heads).transpose(0, 2, 1, 3)  # (B, H, S, Dh)


def merge_heads(x):
    batch, heads, seq, head_dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, seq, heads * head_dim)  # (B, S, H * Dh)


def rope(positions, head_dim, theta, scaling):
    # The inverse frequencies in f32 as transformers computes them; they are
    # constants, so numpy computes them once at trace time. The card's check
    # allows no scaling, "default" or "llama3".
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)))).astype(np.float32)
    if scaling is not None and scaling["rope_type"] == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelen = (2 * math.pi / inv_freq).astype(np.float32)
        scaled = np.where(wavelen > context / low, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
        smooth = ((context / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < context / high) & ~(wavelen > context / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)  # (B, S, Dh / 2)
    angles = jnp.concatenate((angles, angles), axis=-1)  # (B, S, Dh)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x, cos, sin):
    # As transformers: the f32 tables are cast to x's dtype first.
    half = x.shape[-1] // 2
    rotated = jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)
    return x * cos.astype(x.dtype)[:, None] + rotated * sin.astype(x.dtype)[:, None]  # (B, H, S, Dh)


def attention_exact(q, k, v, mask):
    # As transformers' eager attention: scores in the compute dtype, softmax in f32.
    groups = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, groups, axis=1)  # (B, H, S, Dh)
    v = jnp.repeat(v, groups, axis=1)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5  # (B, H, S, S)
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", probs, v)  # (B, H, S, Dh)


def attention_fast(q, k, v, mask):
    # jax.nn.dot_product_attention takes (B, S, H, Dh) and handles grouped heads.
    out = jax.nn.dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask=mask)
    return out.transpose(0, 2, 1, 3)  # (B, H, S, Dh)


def silu(x):
    return jax.nn.silu(x)


def arange_positions(tokens):
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def causal_mask(tokens):
    seq = tokens.shape[1]
    return jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None]  # (1, 1, S, S)


def document_mask(segments):
    seq = segments.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    same_document = segments[:, :, None] == segments[:, None, :]  # (B, S, S)
    return (same_document & causal)[:, None]  # (B, 1, S, S)


def to_f32(x):
    return x.astype(jnp.float32)


def cross_entropy(hidden, head, targets, weights):
    # As transformers: logits upcast to f32; the mean is over the weight.
    logits = jnp.einsum("bsd,vd->bsv", hidden, head).astype(jnp.float32)  # (B, S, Vocab)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    losses = -jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), jnp.finfo(jnp.float32).tiny)


def cross_entropy_chunked(hidden, head, targets, weights):
    # The head's matmul and the loss 1024 positions at a time (or fewer, dividing the row), each chunk
    # recomputed in the backward: f32 logits of one chunk live at a time, never of the whole row.
    batch, seq, width = hidden.shape
    chunk = math.gcd(seq, 1024)

    def chunk_loss(pieces):
        h, t, w = pieces  # (B, chunk, D), (B, chunk), (B, chunk)
        logits = jnp.einsum("bsd,vd->bsv", h, head).astype(jnp.float32)  # (B, chunk, Vocab)
        target = jnp.take_along_axis(logits, t[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - target) * w)

    def split(x):  # (B, S, ...) -> (S / chunk, B, chunk, ...)
        return x.reshape(batch, seq // chunk, chunk, *x.shape[2:]).swapaxes(0, 1)

    total = jnp.sum(jax.lax.map(jax.checkpoint(chunk_loss), (split(hidden), split(targets), split(weights))))
    return total / jnp.maximum(jnp.sum(weights), jnp.finfo(jnp.float32).tiny)


_SHARED = {
    f.__name__: f
    for f in (embedding, rms_norm, linear, linear_bias, split_heads, merge_heads, rope, rotate, silu,
              arange_positions, causal_mask, document_mask, to_f32)
}
EXACT = {**_SHARED, "attention": attention_exact, "cross_entropy": cross_entropy}
FAST = {**_SHARED, "attention": attention_fast, "cross_entropy": cross_entropy_chunked}
