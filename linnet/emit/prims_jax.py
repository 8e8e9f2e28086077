"""JAX implementations of the card primitives, for both numerics.

Like prims_torch.py: each function stands alone (jax, jnp, np and math only),
since the emitter copies its source into the generated module. EXACT follows
transformers' order of computation; FAST uses fused attention (cuDNN's on GPUs)
and a loss that never holds the whole row's f32 logits."""

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
    # constants, so numpy computes them once at trace time. The power is taken
    # in f64 and rounded: numpy's f32 power is an ulp off torch's in 13 of
    # Llama 3's 64 (which then grows with the position); rounded, none there,
    # and at most one elsewhere (torch's own f32 power is an ulp off at times).
    # The card's check allows no scaling, "default" or "llama3".
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)).astype(np.float32)
    if scaling is not None and scaling["rope_type"] == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        # torch divides a number by a tensor as the tensor's reciprocal times the number: so here too.
        wavelen = (np.float32(1) / inv_freq) * np.float32(2 * math.pi)
        scaled = np.where(wavelen > context / low, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
        smooth = (((np.float32(1) / wavelen) * np.float32(context) - np.float32(low))
                  / np.float32(high - low)).astype(np.float32)
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


def attention_fast(q, k, v, mask, kernel=None):
    # `mask` is what the fast masks give: None for causal attention, or the row's segments (B, S), the
    # documents numbered 0, 1, ... along each row. On an Ampere or later GPU, in bf16 or f16, cuDNN's
    # fused attention: causal where every row is one document; else, on Hopper or later, its packed
    # layout (each document a segment, by its start and length) for up to 8 or 16 documents a row; else
    # the dense document mask as a bias with the upper triangle skipped (docs/design/jax_speed.md has the
    # kernels side by side). `kernel` is the choice, 0 to 3 in that order (`rows_kernel`), where the rows
    # were seen on the host before the code was traced (linnet.jax.train: no conditional on the device);
    # None: made on the device, a lax.switch on the rows' document count. Elsewhere, and in f32, XLA's
    # attention. All take (B, S, H, Dh) and grouped heads as they are.
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5
    device = jax.devices()[0]
    capability = float(getattr(device, "compute_capability", 0) or 0) if device.platform == "gpu" else 0.0
    fused = capability >= 8.0 and q.dtype in (jnp.bfloat16, jnp.float16)  # cuDNN's fused attention takes no f32
    # The packed layout needs Hopper, and with fewer key than query heads a jax whose offsets count the
    # key heads (wrong before 0.11.1; 0.11.2 measured right).
    version = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
    packs = capability >= 9.0 and (version >= (0, 11, 2) or k.shape[2] == q.shape[2])

    def dense(q, k, v):
        seq = mask.shape[1]
        same = (mask[:, :, None] == mask[:, None, :]) & jnp.tril(jnp.ones((seq, seq), dtype=bool))  # (B, S, S)
        return jax.nn.dot_product_attention(q, k, v, mask=same[:, None], is_causal=fused, scale=scale,
                                            implementation="cudnn" if fused else "xla")

    def causal(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                            implementation="cudnn" if fused else "xla")

    def packed(most):
        def attend(q, k, v):
            # cuDNN's time and scratch grow with `most` (two (T, N, H) f32 blocks a segment were measured),
            # so a few sizes, not one.
            from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

            lengths = jax.vmap(lambda row: jnp.bincount(row, length=most))(mask).astype(jnp.int32)  # (B, most)
            starts = jnp.cumsum(lengths, axis=1) - lengths
            present = lengths > 0
            starts = jnp.concatenate([jnp.where(present, starts, -1), jnp.full_like(starts[:, :1], -1)], axis=1)
            lengths = jnp.where(present, lengths, -1)
            return dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts,
                                         kv_offsets=starts, scale=scale, mask_type=MaskType.PADDING_CAUSAL)
        return attend

    if mask is None:
        out = causal(q, k, v)
    elif not fused:
        out = dense(q, k, v)
    else:
        branches, bounds = ([causal, packed(8), packed(16), dense], [1, 8, 16]) if packs else ([causal, dense], [1])
        if kernel is not None:  # without the packed layout, every kernel but the causal one is the dense mask
            out = branches[min(kernel, len(branches) - 1)](q, k, v)
        else:
            which = jnp.searchsorted(jnp.array(bounds, jnp.int32), jnp.max(mask) + 1)  # by the most documents a row
            # Offsets and lengths hold for segments that never fall along a row (linnet.data.packing's): others, dense.
            ordered = jnp.all(mask[:, 1:] >= mask[:, :-1]) & (jnp.min(mask) >= 0)
            out = jax.lax.switch(jnp.where(ordered, which, len(branches) - 1), branches, q, k, v)
    return out.transpose(0, 2, 1, 3)  # (B, H, S, Dh)


def rows_kernel(segments: np.ndarray) -> int:
    """attention_fast's choice for these rows' segments (B, S), made on the host as its lax.switch makes
    it on the device: 0 causal (one document a row), 1 and 2 the packed layout (up to 8 and 16
    documents), 3 the dense mask (more, or segments not numbered 0, 1, ... along the rows)."""
    segments = np.asarray(segments)
    ordered = bool(np.all(segments[:, 1:] >= segments[:, :-1])) and int(segments.min()) >= 0
    return int(np.searchsorted([1, 8, 16], int(segments.max()) + 1)) if ordered else 3


def causal_mask_fast(tokens):
    return None


def document_mask_fast(segments):
    # The segments themselves: attention_fast picks its kernel from them.
    return segments


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


def token_statistics(hidden, head, targets):
    # Each position's (log-probability of its target, entropy of its distribution, 1.0 where the target is the
    # likeliest token), logits upcast to f32 as transformers does; only the log-probability takes a gradient.
    logits = jnp.einsum("bsd,vd->bsv", hidden, head).astype(jnp.float32)  # (B, S, Vocab)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    known = jax.lax.stop_gradient(log_probs)
    entropy = -jnp.sum(jnp.exp(known) * known, axis=-1)
    top = (jnp.argmax(known, axis=-1) == targets).astype(jnp.float32)
    return jnp.stack([chosen, entropy, top], axis=-1)  # (B, S, 3)


def cross_entropy_chunked(hidden, head, targets, weights, recompute=False):
    # The head's matmul and the loss at most 1024 positions at a time, in chunks as even as they come (a
    # row of 4,097 positions: five of 820, the last three padded with weight zero): f32 logits of one
    # chunk live at a time, never of the whole row. Differentiated, each chunk's gradients are made
    # where its logits are (softmax less the target, times the weight), the head's summed in f32, in one
    # of two forms:
    # - one pass (default): in the forward, so that the backward only scales them (three matmuls a chunk,
    #   as the plain loss, where recomputing each chunk takes four); the head's gradient, Vocab x D, is
    #   held from the forward to the backward, and the chunks' are summed in a carried f32 sum.
    # - `recompute`: in the backward, nothing held from the forward; each chunk's head gradient rounded
    #   once to the head's dtype and the chunks' stacked (chunks x Vocab x D while the backward runs: 3.9
    #   GiB at 8B and 4096 positions, growing with the row), then summed in f32. linnet.jax.train
    #   recomputes under remat.
    # Why two forms: with remat, either carried sum (the one-pass form's, or a recomputed one's) makes XLA
    # keep every layer's gradient to the optimizer's update, the stacked sum not; without remat the one-pass
    # form is the quicker (docs/design/jax_speed.md). The loss weights are data: no gradient flows to them.
    batch, seq, width = hidden.shape
    count = -(-seq // 1024)
    chunk = -(-seq // count)
    padded = count * chunk
    weights = jax.lax.stop_gradient(weights)

    def varying(x):  # the shard_map axes x varies over (jax 0.10's name for them; earlier ones said vma)
        kind = jax.typeof(x)
        axes = getattr(getattr(kind, "manual_axis_type", None), "varying", None)
        return frozenset(getattr(kind, "vma", ()) if axes is None else axes)

    # Under shard_map the rows vary over every axis of the mesh, and a head gathered inside one group of
    # a larger mesh over fewer: the head is made varying over the rest, whose transpose sums its
    # gradient across them (as autodiff would).
    missing = tuple(sorted(varying(hidden) - varying(head)))
    if missing:
        head = jax.lax.pcast(head, missing, to="varying")

    def split(x):  # (B, S, ...) -> (count, B, chunk, ...), padded with zeros (weight zero: no loss, no gradient)
        if padded > seq:
            x = jnp.pad(x, [(0, 0), (0, padded - seq)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(batch, count, chunk, *x.shape[2:]).swapaxes(0, 1)

    def joined(chunks):  # (count, B, chunk, D) -> (B, S, D)
        return chunks.swapaxes(0, 1).reshape(batch, padded, width)[:, :seq]

    def chunk_losses(h, head, t, w, with_gradients):
        logits = jnp.einsum("bsd,vd->bsv", h, head).astype(jnp.float32)  # (B, chunk, Vocab)
        top = jax.nn.logsumexp(logits, axis=-1)
        losses = top - jnp.take_along_axis(logits, t[..., None].astype(jnp.int32), axis=-1)[..., 0]
        if not with_gradients:
            return jnp.sum(losses * w)
        d_logits = ((jnp.exp(logits - top[..., None]) - jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32))
                    * w[..., None])
        d_logits = d_logits.astype(jnp.result_type(h, head))  # as the cast to f32 passes the gradient back
        d_hidden = jnp.einsum("bsv,vd->bsd", d_logits, head).astype(h.dtype)
        d_head = jnp.einsum("bsv,bsd->vd", d_logits, h, preferred_element_type=jnp.float32)
        return jnp.sum(losses * w), d_hidden, d_head

    def summed(hidden, head, targets, weights):
        return jnp.sum(jax.lax.map(lambda p: chunk_losses(p[0], head, p[1], p[2], False),
                                   (split(hidden), split(targets), split(weights))))

    def loss_and_gradients(hidden, head, targets, weights):
        def step(d_head, pieces):
            loss, d_hidden, d_head_chunk = chunk_losses(pieces[0], head, pieces[1], pieces[2], True)
            return d_head + d_head_chunk, (loss, d_hidden)

        # The first chunk starts the sum of the head's gradient (a carry of zeros would not be varying
        # over shard_map's axes as the head is).
        chunks = (split(hidden), split(targets), split(weights))
        d_head, (loss, d_hidden) = step(0.0, [c[0] for c in chunks])
        d_head, (losses, d_hiddens) = jax.lax.scan(step, d_head, [c[1:] for c in chunks])
        d_hidden = joined(jnp.concatenate([d_hidden[None], d_hiddens]))
        return loss + jnp.sum(losses), (d_hidden, d_head.astype(head.dtype))

    def gradients_stacked(hidden, head, targets, weights):
        def chunk_gradients(pieces):
            _, d_hidden, d_head = chunk_losses(pieces[0], head, pieces[1], pieces[2], True)
            return d_hidden, d_head.astype(head.dtype)

        d_hiddens, d_heads = jax.lax.map(chunk_gradients, (split(hidden), split(targets), split(weights)))
        d_head = jnp.sum(d_heads.astype(jnp.float32), axis=0).astype(head.dtype)
        return joined(d_hiddens), d_head

    def summed_forward(hidden, head, targets, weights):
        if recompute:
            return summed(hidden, head, targets, weights), (hidden, head, targets, weights)
        return loss_and_gradients(hidden, head, targets, weights)

    def summed_backward(saved, g):
        d_hidden, d_head = gradients_stacked(*saved) if recompute else saved
        return ((d_hidden.astype(jnp.float32) * g).astype(d_hidden.dtype),
                (d_head.astype(jnp.float32) * g).astype(d_head.dtype), None, None)

    total = jax.custom_vjp(summed)
    total.defvjp(summed_forward, summed_backward)
    return total(hidden, head, targets, weights) / jnp.maximum(jnp.sum(weights), jnp.finfo(jnp.float32).tiny)


_SHARED = {
    f.__name__: f
    for f in (embedding, rms_norm, linear, linear_bias, split_heads, merge_heads, rope, rotate, silu,
              arange_positions, to_f32, token_statistics)
}
EXACT = {**_SHARED, "attention": attention_exact, "causal_mask": causal_mask, "document_mask": document_mask,
         "cross_entropy": cross_entropy}
FAST = {**_SHARED, "attention": attention_fast, "causal_mask": causal_mask_fast, "document_mask": document_mask_fast,
        "cross_entropy": cross_entropy_chunked}
