"""What both benchmark scripts (step.py for PyTorch, step_jax.py for JAX) share:
the random rows they train on and the model FLOPs a token they report."""

import math

import numpy as np

from linnet.packing import Row


def random_rows(seed: int, tokens: int, vocab: int):
    """Endless rows of one document each: random tokens, every position but the last weighted."""
    rng = np.random.default_rng(seed)
    while True:
        ids = rng.integers(0, min(vocab, 32000), tokens, dtype=np.int32)
        yield Row(tokens=ids, targets=np.roll(ids, -1), positions=np.arange(tokens, dtype=np.int32),
                  segments=np.zeros(tokens, np.int32),
                  weights=np.r_[np.ones(tokens - 1, np.float32), 0.0].astype(np.float32), filled=tokens)


def parameters(model) -> int:
    return sum(math.prod(s.shape) for s in model.specs())


def flops_per_token(model, seq: int) -> int:
    """6 x the matrix-product parameters, plus causal attention's 6 x layers x seq x D."""
    checked = model.checked
    tied = bool(checked.consts["tied"])
    matmul = parameters(model) if tied else parameters(model) - checked.dims["Vocab"] * checked.dims["D"]
    return 6 * matmul + 6 * checked.dims["Layers"] * seq * checked.dims["D"]
