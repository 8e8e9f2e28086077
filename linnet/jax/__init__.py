"""Linnet for JAX: cards loaded as generated jax.numpy."""
