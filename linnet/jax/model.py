"""A card loaded for JAX (`backend="jax_source"`): the generated jax.numpy
functions, each taking `(params, *inputs)` and jitted, the weights as a
pytree (`model.params`), and `model.save_weights(folder)`, which writes a
Hugging Face checkpoint. linnet/jax/train.py trains it, fully sharded.

A model trained (or evaluated before its weights were read whole) keeps them
as parts over the mesh (`model.weight_source` is a `ShardedWeights`):
`evaluate` runs over them, `save_weights` writes them a group at a time, and
`model.params` (and so the entries) gathers them whole, group by group, if
they fit."""

from __future__ import annotations

from math import prod
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linnet.emit.jax_backend import JAX
from linnet.jax.shard import ShardedWeights, part_at, to_host, unshard_weights
from linnet.jax.xla import xla_options
from linnet.model import LoadedModel
from linnet.hf.read import group_specs

JAX_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


class JaxModel(LoadedModel):
    backend = JAX

    def __init__(self, card, checked, *, generics, numerics, cast_dtype, entries):
        compute = JAX_DTYPES[generics[checked.program.compute_dtype]]
        self.weight_dtype = jnp.float32 if cast_dtype else compute
        self.training_mesh = None  # set while linnet.jax.train holds the weights as parts
        super().__init__(card, checked, generics=generics, numerics=numerics, cast_dtype=cast_dtype, entries=entries)

    def _compile(self, function):
        return jax.jit(function, compiler_options=xla_options(jax.default_backend()))

    def _convert(self, tensor):
        return jnp.asarray(tensor.float().numpy(), dtype=self.weight_dtype)

    def _random_drawer(self, seed: int):
        draw = self.host_drawer(seed)
        return lambda spec, std: jnp.asarray(draw(spec, std), dtype=self.weight_dtype)

    def host_drawer(self, seed: int):
        """draw(spec, std) -> a random weight as an f32 numpy array: called in checkpoint order, the model's values."""
        rng = np.random.default_rng(seed)

        def draw(spec, std):
            if spec.init == "ones":
                return np.ones(spec.shape, np.float32)
            weight = rng.standard_normal(spec.shape, dtype=np.float32)  # f32 draws: 3.5x quicker than f64's
            weight *= np.float32(std)
            return weight

        return draw

    def _weight_itemsize(self) -> int:
        return jnp.dtype(self.weight_dtype).itemsize

    def _free_memory(self) -> tuple[str, int]:
        device = jax.devices()[0]  # where jnp puts the weights
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:  # the host's memory (CPU devices report none)
            return super()._free_memory()
        return str(device), stats["bytes_limit"] - stats["bytes_in_use"]

    def _read_whole(self) -> None:
        source = self.weight_source
        if not isinstance(source, ShardedWeights):
            super()._read_whole()
            return
        try:
            self._check_fits(sum(prod(spec.shape) for spec in self.specs()))
        except MemoryError as error:
            raise MemoryError(f"{error} (Its weights are the parts linnet.jax.train left over the mesh: "
                              f"model.save_weights(folder) writes them a group at a time.)") from None
        self.params = unshard_weights(self.checked, source.parts, source.layouts)  # consumes the parts

    _shard_hint = "train it with linnet.jax.train over a mesh, which"

    def check_whole(self, doing: str) -> None:
        """Raises while linnet.jax.train holds the weights as parts (from an on_step, say)."""
        if self.training_mesh is not None:
            raise RuntimeError(f"{doing}: {self.card.name}'s weights are parts of a running linnet.jax.train; "
                               f"call it after train returns")

    def save_weights(self, path, dtype=jnp.bfloat16, max_shard_size: int | str = "5GB") -> Path:
        """SafeTensors files of at most max_shard_size (an index when several) under Hugging Face names, and the
        config.json transformers loads them with; written a group at a time (from parts, each fetched whole
        to the host once)."""
        self.check_whole("save_weights")
        import torch

        from linnet.hf.write import DTYPES, write_hf_checkpoint

        names = {jnp.dtype(d): name for name, d in JAX_DTYPES.items()}
        if jnp.dtype(dtype) not in names:
            raise ValueError(f"save_weights(dtype=...) takes one of {list(JAX_DTYPES.values())}, got {dtype}")
        torch_dtype = DTYPES[names[jnp.dtype(dtype)]]
        shapes = {spec.checkpoint_name: spec.shape for spec in self.specs()}
        tensors = ((name, torch.from_numpy(weight)) for name, weight in self._host_weights())  # converted as written
        if jax.process_index() != 0:  # every process holds them all (linnet.jax.train): the first writes
            return Path(path)
        return write_hf_checkpoint(self.card, shapes, tensors, Path(path), torch_dtype, max_shard_size=max_shard_size)

    def _host_weights(self):
        """(checkpoint name, f32 numpy array) for every weight, in checkpoint order; from parts, a group at a time."""
        source = self.weight_source
        if not isinstance(source, ShardedWeights):
            for name, weight in self.named_weights():
                yield name, np.array(weight, np.float32)
            return
        for decl, index, specs in group_specs(self.checked, self.specs()):
            flat = to_host(part_at(source.parts, decl.key, index))
            for spec, offset in zip(specs, source.layouts[decl.name].offsets):
                yield spec.checkpoint_name, flat[offset:offset + prod(spec.shape)].reshape(spec.shape)

    def _check_placement(self, entry: str, inputs) -> None:
        self.check_whole(f"{entry}()")

    def _kind(self, array) -> str:
        return "float" if jnp.issubdtype(array.dtype, jnp.floating) else "int"
