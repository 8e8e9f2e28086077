"""On a CUDA machine: JAX's fast attention (cuDNN's fused kernels, chosen by the rows'
document count) against exact attention, values and gradients, on rows of one
document and of a few, several and many. Skipped where JAX has no GPU (CI)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linnet.emit import prims_jax

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs JAX on a CUDA GPU")
BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 512, 64


def segments_of(documents: int, seed: int) -> np.ndarray:
    """(B, S) segments: each row `documents` documents of random lengths (the last row one fewer, so
    that rows differ), numbered 0, 1, ... as linnet.data.packing numbers them."""
    rng = np.random.default_rng(seed)
    rows = []
    for count in (documents, max(documents - 1, 1)):
        cuts = np.sort(rng.choice(np.arange(1, SEQ), count - 1, replace=False))
        rows.append(np.repeat(np.arange(count, dtype=np.int32), np.diff(np.r_[0, cuts, SEQ])))
    return np.stack(rows)


def qkv(seed: int):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(BATCH, HEADS, SEQ, HEAD_DIM), (BATCH, KV_HEADS, SEQ, HEAD_DIM), (BATCH, KV_HEADS, SEQ, HEAD_DIM)]
    return [jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes)], \
        jax.random.normal(keys[3], shapes[0], jnp.float32)


@pytest.mark.parametrize("documents,branch", [(0, None), (1, 0), (5, 1), (12, 2), (40, 3), (-5, 3)],
                         ids=["causal", "one", "few", "several", "many", "unordered"])
def test_fused_attention_equals_exact_on_packed_rows(documents, branch, monkeypatch):
    """0 is the causal mask; 1 document takes causal attention through the document mask, 5 and 12 the
    packed layout of 8 and 16 segments, 40 the dense mask, and -5 five documents numbered backwards
    along the rows (not linnet.data.packing's order) the dense mask too."""
    (q, k, v), cotangent = qkv(abs(documents))
    segments = (jnp.asarray(segments_of(abs(documents), abs(documents))) if abs(documents) > 1
                else jnp.zeros((BATCH, SEQ), jnp.int32))
    if documents < 0:
        segments = jnp.max(segments) - segments
    if documents == 0:
        fast_mask, exact_mask = prims_jax.causal_mask_fast(segments), prims_jax.causal_mask(segments)
    else:
        fast_mask, exact_mask = prims_jax.document_mask_fast(segments), prims_jax.document_mask(segments)

    def fast(q, k, v):
        bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        return jnp.sum(prims_jax.attention_fast(*bf16, fast_mask).astype(jnp.float32) * cotangent)

    def exact(q, k, v):
        return jnp.sum(prims_jax.attention_exact(q, k, v, exact_mask) * cotangent)

    assert "cudnn" in jax.jit(fast).lower(q, k, v).compile().as_text()  # the fused kernel, not XLA's
    # Which kernel the rows chose: run once outside jit, where the switch's index is a number. Branches
    # on Hopper with jax >= 0.11.2: causal, packed 8, packed 16, dense; before Hopper: causal, dense.
    hopper = float(jax.devices()[0].compute_capability) >= 9.0 and \
        tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit()) >= (0, 11, 2)
    branch = branch if hopper or branch is None else min(branch, 1)
    chosen, switch = [], jax.lax.switch
    monkeypatch.setattr(jax.lax, "switch",
                        lambda index, branches, *a: chosen.append(int(index)) or switch(index, branches, *a))
    prims_jax.attention_fast(*(x.astype(jnp.bfloat16) for x in (q, k, v)), fast_mask)
    monkeypatch.undo()  # under jit below, the index is traced: the real switch must take it
    assert chosen == ([] if branch is None else [branch])
    if branch is not None:  # the host's choice (linnet.jax.train) is the switch's, and runs its kernel alone
        kernel = prims_jax.rows_kernel(np.asarray(segments))
        assert (kernel if hopper else min(kernel, 1)) == branch
        bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        chosen_on_host = jax.jit(lambda *x: prims_jax.attention_fast(*x, fast_mask, kernel=kernel))
        assert not re.search(r"\bconditional\(", chosen_on_host.lower(*bf16).compile().as_text())
        on_device = jax.jit(lambda *x: prims_jax.attention_fast(*x, fast_mask))(*bf16)
        # The same kernel; XLA may lay out its operands differently outside a conditional's branch.
        error = float(jnp.max(jnp.abs(chosen_on_host(*bf16).astype(jnp.float32) - on_device.astype(jnp.float32))))
        assert error <= 1e-2 * float(jnp.max(jnp.abs(on_device.astype(jnp.float32)))), error
    got, want = jax.grad(fast, argnums=(0, 1, 2))(q, k, v), jax.grad(exact, argnums=(0, 1, 2))(q, k, v)
    out_got = prims_jax.attention_fast(*(x.astype(jnp.bfloat16) for x in (q, k, v)), fast_mask).astype(jnp.float32)
    out_want = prims_jax.attention_exact(q, k, v, exact_mask)
    # bf16 inputs and kernels against f32: errors of a few bf16 ulps of the largest value.
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out_got, *got), (out_want, *want)):
        error = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        assert error < 2e-2, f"{name}: {error}"
