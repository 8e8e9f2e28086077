"""Linnet for JAX: cards loaded as generated jax.numpy, and the training loop over a device mesh.

    from linnet.jax import train, evaluate
"""

from linnet.jax.train import evaluate, train

__all__ = ["evaluate", "train"]
