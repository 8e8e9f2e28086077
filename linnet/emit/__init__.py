"""Code generators: PyTorch and JAX source from a checked card."""
