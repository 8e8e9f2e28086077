"""A card loaded for JAX (`backend="jax_source"`): the generated jax.numpy
functions, each taking `(params, *inputs)` and jitted, the weights as a
pytree (`model.params`), and `model.save_weights(folder)`, which writes a
Hugging Face checkpoint. linnet/jax/train.py trains it, fully sharded."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linnet.emit.jax_backend import JAX
from linnet.model import LoadedModel

JAX_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


class JaxModel(LoadedModel):
    backend = JAX

    def __init__(self, card, checked, *, generics, numerics, cast_dtype, entries):
        compute = JAX_DTYPES[generics[checked.program.compute_dtype]]
        self.weight_dtype = jnp.float32 if cast_dtype else compute
        self.training_mesh = None  # set while linnet.jax.train holds the weights as parts
        super().__init__(card, checked, generics=generics, numerics=numerics, cast_dtype=cast_dtype, entries=entries)

    def _compile(self, function):
        return jax.jit(function)

    def _convert(self, tensor):
        return jnp.asarray(tensor.float().numpy(), dtype=self.weight_dtype)

    def _random_drawer(self, seed: int):
        rng = np.random.default_rng(seed)

        def draw(spec, std):
            if spec.init == "ones":
                return jnp.ones(spec.shape, self.weight_dtype)
            return jnp.asarray(rng.normal(0.0, std, spec.shape).astype(np.float32), dtype=self.weight_dtype)

        return draw

    def check_whole(self, doing: str) -> None:
        """Raises while linnet.jax.train holds the weights as parts (from an on_step, say)."""
        if self.training_mesh is not None:
            raise RuntimeError(f"{doing}: {self.card.name}'s weights are parts of a running linnet.jax.train; "
                               f"call it after train returns")

    def save_weights(self, path, dtype=jnp.bfloat16) -> Path:
        """One SafeTensors file under Hugging Face names, and the config.json transformers loads it with."""
        self.check_whole("save_weights")
        import torch

        from linnet.export import write_hf_checkpoint
        from linnet.torch.model import TORCH_DTYPES

        names = {jnp.dtype(d): name for name, d in JAX_DTYPES.items()}
        if jnp.dtype(dtype) not in names:
            raise ValueError(f"save_weights(dtype=...) takes one of {list(JAX_DTYPES.values())}, got {dtype}")
        torch_dtype = TORCH_DTYPES[names[jnp.dtype(dtype)]]
        tensors = {name: torch.from_numpy(np.array(weight, np.float32)).to(torch_dtype)
                   for name, weight in self.named_weights()}
        return write_hf_checkpoint(self.card, tensors, Path(path), torch_dtype)

    def _check_placement(self, entry: str, inputs) -> None:
        self.check_whole(f"{entry}()")

    def _kind(self, array) -> str:
        return "float" if jnp.issubdtype(array.dtype, jnp.floating) else "int"
