"""PyTorch implementations of the card primitives, for both numerics.

The emitter copies the source of the functions a card uses into the generated
module, so each must stand alone (torch, F and math only). `EXACT` follows
Hugging Face transformers' computation order (the parity reference); `FAST`
swaps in fused kernels where the order may change."""

import math

import torch
import torch.nn.functional as F


def embedding(tokens, table):
    return F.embedding(tokens, table)


def rms_norm(x, weight, eps):
    # As transformers: normalise in f32, cast back, then scale.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def linear(x, weight):
    return F.linear(x, weight)


def linear_bias(x, weight, bias):
    # One fused product and sum, as transformers' nn.Linear with a bias.
    return F.linear(x, weight, bias)


def split_heads(x, heads):
    batch, seq, width = x.shape
    return x.view(batch, seq, heads, width // heads).transpose(1, 2)  # (B, H, S, Dh)


def merge_heads(x):
    batch, heads, seq, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * head_dim)  # (B, S, H * Dh)


def rope(positions, head_dim, theta, scaling):
    # The inverse frequencies as transformers computes them (on the CPU, in
    # f32), so that the angles agree to the last bit. The card's check allows no
    # scaling, "default" or "llama3".
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is not None and scaling["rope_type"] == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < context / high) * ~(wavelen > context / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    angles = positions.float()[:, :, None] * inv_freq.to(positions.device)  # (B, S, Dh / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (B, S, Dh)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    # As transformers: the f32 tables are cast to x's dtype first.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype)[:, None] + rotated * sin.to(x.dtype)[:, None]  # (B, H, S, Dh)


def attention_exact(q, k, v, mask):
    # As transformers' eager attention: scores in T, softmax in f32.
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # (B, H, S, Dh)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5  # (B, H, S, S)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)  # (B, H, S, Dh)


def attention_fast(q, k, v, mask):
    # None is plain causal attention, which fused kernels do without a mask; a
    # dense mask goes to SDPA; a block mask (documents, on CUDA) to flex attention.
    # Attention keeps its inputs for the backward. v comes as a view of the one
    # product of q, k and v (q and k are new tensors, rotated): kept as it is, it
    # would keep that whole product; its own copy keeps v alone (the 3B: 32 MiB a
    # layer, 0.88 GiB in all, at 4,096 tokens).
    v = v.contiguous()
    if mask is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # cuDNN's kernel first where it runs: on Hopper it is quicker than FlashAttention-2's, which SDPA
        # would choose (docs/design/kernels.md).
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.MATH], set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


def silu(x):
    return F.silu(x)


def arange_positions(tokens):
    return torch.arange(tokens.shape[1], dtype=torch.int32, device=tokens.device).expand_as(tokens)


def causal_mask_exact(tokens):
    seq = tokens.shape[1]
    return torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()[None, None]  # (1, 1, S, S)


def causal_mask_fast(tokens):
    return None


def document_mask_fast(segments):
    # On CUDA a block mask: flex attention skips the blocks no document reaches.
    batch, seq = segments.shape
    if not segments.is_cuda:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
        return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]  # (B, 1, S, S)
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document(b, h, q, kv):
        return (kv <= q) & (segments[b, q] == segments[b, kv])

    return create_block_mask(same_document, batch, None, seq, seq, device=segments.device)


def document_mask(segments):
    seq = segments.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    same_document = segments[:, :, None] == segments[:, None, :]  # (B, S, S)
    return (same_document & causal)[:, None]  # (B, 1, S, S)


def to_f32(x):
    return x.float()


def cross_entropy(hidden, head, targets, weights):
    # As transformers: logits upcast to f32; the mean is over the weight.
    logits = F.linear(hidden, head).float()  # (B, S, Vocab)
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten().long(), reduction="none")
    weights = weights.flatten()
    return (losses * weights).sum() / weights.sum().clamp_min(torch.finfo(torch.float32).tiny)


def token_statistics(hidden, head, targets):
    # Each position's (log-probability of its target, entropy of its distribution, 1.0 where the target is the
    # likeliest token), logits upcast to f32 as transformers does; only the log-probability takes a gradient.
    logits = F.linear(hidden, head).float()  # (B, S, Vocab)
    log_probs = logits.log_softmax(-1)
    chosen = torch.take_along_dim(log_probs, targets.long()[..., None], dim=-1)[..., 0]
    known = log_probs.detach()
    entropy = -(known.exp() * known).sum(-1)
    top = (known.argmax(-1) == targets.long()).float()
    return torch.stack([chosen, entropy, top], dim=-1)  # (B, S, 3)


def cross_entropy_in_one_op(hidden, head, targets, weights, rows=1024):
    # The head's product and the loss in one of Linnet's ops (csrc/linear_cross_entropy.cpp), `rows` at a
    # time: the logits are never whole, and the backward keeps the gradients the forward made, not the logits.
    # Not in FAST: it makes the step slower for a little less memory at its peak (docs/design/kernels.md);
    # benchmarks/step.py --loss op measures it.
    return torch.ops.linnet.linear_cross_entropy(hidden.flatten(0, 1), head, targets.flatten(), weights.flatten(),
                                                 rows)


_SHARED = {
    f.__name__: f
    for f in (embedding, rms_norm, linear, linear_bias, split_heads, merge_heads, rope, rotate, silu,
              arange_positions, to_f32, cross_entropy, token_statistics)
}
EXACT = {**_SHARED, "attention": attention_exact, "causal_mask": causal_mask_exact, "document_mask": document_mask}
FAST = {**_SHARED, "attention": attention_fast, "causal_mask": causal_mask_fast, "document_mask": document_mask_fast}
