"""Fully sharded data parallelism for the JAX backend, inside `jax.shard_map`.

The same plan as linnet/torch/shard.py, in JAX's terms:
  1. each group's weights (the embedding, each layer, the final norm with the
     head) are laid out in one flat f32 buffer, padded to divide by the number
     of devices, and placed split over the mesh's axis: each device holds its
     part. A model whose weights were never read whole builds each part
     straight on its device (`parts_from_source`): a checkpoint's slices that
     cover it, or its group drawn on the host;
  2. the card's entries are emitted in their sharded form (`linnet jax CARD
     --fully-shard` prints it), with `gather` and `checkpointed` bound here:
     `gather` casts a part to the compute dtype and all-gathers it, and its
     gradient is reduce-scattered in f32 into the part (`psum_scatter`);
  3. `checkpointed` runs each layer as it is (`remat=False`: its activations
     and gathered weights are kept for the backward) or under `jax.checkpoint`
     (`remat=True`: the backward gathers the layer's weights and computes it
     again, keeping only its input).

The functions here run inside `shard_map`; linnet/jax/train.py places the
parts and calls them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from linnet.cardlang.check import Checked
from linnet.sharding.layout import GroupLayout
from linnet.sharding.layout import group_layouts as layouts_of
from linnet.hf.read import CheckpointWeights, RandomWeights, SliceReader, group_specs


def shard_axis(mesh: Mesh) -> str:
    """The axis the parts are split over: a 1-D mesh's one, or "shard" of a ("replicate", "shard") mesh,
    whose replicas each hold every part (a machine each, across machines)."""
    return mesh.axis_names[-1]


def shards(mesh: Mesh) -> int:
    """How many parts each group is split into."""
    return mesh.shape[shard_axis(mesh)]


def group_layouts(checked: Checked, devices: int) -> dict[str, GroupLayout]:
    """The flat layout of every group of the card for `devices` parts each: the weights end to end, then padding."""
    return layouts_of(checked, devices, what="devices")


def flatten(weights: dict, layout: GroupLayout) -> jax.Array:
    """One group's weights as its flat f32 buffer, padding zero."""
    pieces = [jnp.asarray(weights[name], jnp.float32).reshape(-1) for name in layout.names]
    pieces.append(jnp.zeros(layout.total - layout.extent, jnp.float32))
    return jnp.concatenate(pieces)


def views(flat: jax.Array, layout: GroupLayout) -> dict[str, jax.Array]:
    """The group's weights, cut from a full flat buffer (gathered, or as saved)."""
    return {name: jax.lax.slice_in_dim(flat, offset, offset + math.prod(shape)).reshape(shape)
            for name, shape, offset in zip(layout.names, layout.shapes, layout.offsets)}


def shard_weights(checked: Checked, params: dict, layouts: dict[str, GroupLayout], mesh: Mesh) -> dict:
    """The model's weights as parts split over the mesh, group by group; `params` is emptied as it goes,
    so the model is not held twice."""
    placement = NamedSharding(mesh, PartitionSpec(shard_axis(mesh)))
    parts = {}
    for decl in checked.program.groups.values():
        layout = layouts[decl.name]
        if decl.repeat is None:
            parts[decl.key] = jax.device_put(flatten(params.pop(decl.key), layout), placement)
        else:
            layers = params.pop(decl.key)
            parts[decl.key] = []
            while layers:
                parts[decl.key].append(jax.device_put(flatten(layers.pop(0), layout), placement))
    return parts


@dataclass(frozen=True)
class ShardedWeights:
    """Where a model's weights are after linnet.jax.train, if they were never whole: its groups' parts."""

    parts: dict  # as params, each group's weights one flat f32 array split over the mesh
    layouts: dict[str, GroupLayout]
    mesh: Mesh


def part_at(parts: dict, key: str, index: int | None) -> jax.Array:
    return parts[key] if index is None else parts[key][index]


def parts_from_source(model, layouts: dict[str, GroupLayout], mesh: Mesh) -> dict:
    """The model's parts built on their devices from `model.weight_source`, never the whole model at once:
    each device's range of a checkpoint read alone, or one group at a time whole on the host (drawn in the
    unsharded model's order, so with its values whatever the mesh; or fetched from parts on another mesh)."""
    source = model.weight_source
    if isinstance(source, ShardedWeights) and source.mesh == mesh:
        return source.parts
    placement = NamedSharding(mesh, PartitionSpec(shard_axis(mesh)))
    reader = SliceReader(source.files) if isinstance(source, CheckpointWeights) else None
    draw = model.host_drawer(source.seed) if isinstance(source, RandomWeights) else None
    parts: dict = {}
    for decl, index, specs in group_specs(model.checked, model.specs()):
        layout = layouts[decl.name]
        if reader is not None:
            read = partial(reader.read_flat, specs, layout.offsets)
        else:
            flat = np.zeros(layout.total, np.float32)
            if draw is not None:
                for spec, offset in zip(specs, layout.offsets):
                    flat[offset:offset + math.prod(spec.shape)] = draw(spec, source.std).reshape(-1)
            else:
                flat[:layout.extent] = np.asarray(part_at(source.parts, decl.key, index))[:layout.extent]
            read = partial(_cut, flat)
        part = _place(layout.total, placement, read)
        if index is None:
            parts[decl.key] = part
        else:
            parts.setdefault(decl.key, []).append(part)
    return parts


def _place(total: int, placement: NamedSharding, read: Callable) -> jax.Array:
    """A flat f32 array of `total` elements, split as `placement` says, each device's range from read(start, end)."""
    return jax.make_array_from_callback((total,), placement,
                                        lambda index: np.asarray(read(*index[0].indices(total)[:2])))


def _cut(flat: np.ndarray, start: int, end: int) -> np.ndarray:
    return flat[start:end]


def part_spec(part, axis: str) -> PartitionSpec:
    """How a part is split: a flat part along its length; layers stacked as [Layers, part] along the second axis."""
    return PartitionSpec(*[None] * (len(part.shape) - 1), axis)


def placements(tree, parts, mesh: Mesh):
    """Where each array of a training state lies: the parts, and any array shaped as a part (an
    optimizer's moments), split as the part is; everything else (a step count, an optimizer's
    factored statistics) on every device."""
    axis = shard_axis(mesh)
    part_shapes = {tuple(part.shape) for part in jax.tree.leaves(parts)}
    return jax.tree.map(lambda leaf: NamedSharding(mesh, part_spec(leaf, axis) if tuple(leaf.shape) in part_shapes
                                                   else PartitionSpec()), tree)


def stack_layers(tree, mesh: Mesh):
    """`tree` (parts, or an optimizer state shaped as them) with each list of layer parts made one
    [Layers, part] array split along its second axis, built a layer at a time: each layer's array is
    freed as it is copied in, so a device never holds the layers twice."""
    def stack(layers: list):
        placement = NamedSharding(mesh, PartitionSpec(None, shard_axis(mesh)))
        stacked = jax.jit(partial(jnp.zeros, (len(layers), *layers[0].shape), layers[0].dtype),
                          out_shardings=placement)()
        for index in range(len(layers)):
            stacked = _set_row(stacked, layers[index], index)
            layers[index].delete()
        return stacked

    return jax.tree.map(lambda node: stack(node) if _is_layer_list(node) else node, tree, is_leaf=_is_layer_list)


def unstack_layers(tree) -> dict:
    """The inverse of stack_layers: each [Layers, part] array as a list of flat parts (freed once cut)."""
    def unstack(stacked):
        sharding = stacked.sharding
        row = jax.jit(_row, out_shardings=NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:])))
        layers = [row(stacked, index) for index in range(stacked.shape[0])]
        stacked.delete()
        return layers

    return jax.tree.map(lambda leaf: unstack(leaf) if getattr(leaf, "ndim", 0) == 2 else leaf, tree)


def _row(stacked: jax.Array, index) -> jax.Array:
    return stacked[index]


def _is_layer_list(node) -> bool:
    return isinstance(node, list) and bool(node) and all(isinstance(leaf, jax.Array) and leaf.ndim == 1
                                                         and leaf.shape == node[0].shape for leaf in node)


@partial(jax.jit, donate_argnums=0)
def _set_row(stacked: jax.Array, row: jax.Array, index) -> jax.Array:
    return stacked.at[index].set(row)


def from_host(host: np.ndarray, sharding) -> jax.Array:
    """`host` placed as `sharding` says, each device given only its own block (so a process of several
    places only what its devices hold)."""
    return jax.make_array_from_callback(host.shape, sharding, host.__getitem__)


def to_host(array: jax.Array) -> np.ndarray:
    """A whole array on the host from this process's own devices, with no collective: every array a
    process trains holds whole on its devices (train keeps each replica inside one process)."""
    return np.asarray(array) if array.is_fully_addressable else _assemble(array)


def _assemble(array: jax.Array) -> np.ndarray:
    """`array` whole from the blocks on this process's devices; an error if they do not cover it."""
    host = np.empty(array.shape, array.dtype)
    blocks = set()  # each distinct block this process holds (replicas hold the same), as (start, stop) a dim
    for piece in array.addressable_shards:
        block = tuple(index.indices(size)[:2] for index, size in zip(piece.index, array.shape))
        if block not in blocks:
            blocks.add(block)
            host[piece.index] = np.asarray(piece.data)
    if sum(math.prod(stop - start for start, stop in block) for block in blocks) != array.size:
        raise ValueError(f"an array of shape {array.shape} is split over several processes; linnet.jax keeps every "
                         f"part in each process (a ('replicate', 'shard') mesh, a replica a process)")
    return host


def unshard_weights(checked: Checked, parts: dict, layouts: dict[str, GroupLayout]) -> dict:
    """The full weights, in the card's layout (params["layers"][i]["q_proj"]), on the first device;
    `parts` is emptied as it goes, so the model is not held twice."""
    device = jax.devices()[0]

    def full(part, layout):
        weights = views(jax.device_put(part if part.is_fully_addressable else to_host(part), device), layout)
        part.delete()
        return weights

    params = {}
    for decl in checked.program.groups.values():
        layout, group = layouts[decl.name], parts.pop(decl.key)
        if decl.repeat is None:
            params[decl.key] = full(group, layout)
        else:
            params[decl.key] = [full(group.pop(0), layout) for _ in range(len(group))]
    return params


# Bound into the sharded source; they run inside shard_map over `axis`.


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def all_gather_cast(part: jax.Array, axis: str, dtype) -> jax.Array:
    """Every device's part, cast to dtype, gathered into the full buffer."""
    return jax.lax.all_gather(part.astype(dtype), axis, tiled=True)


def _all_gather_cast_forward(part, axis, dtype):
    return all_gather_cast(part, axis, dtype), None


def _all_gather_cast_backward(axis, dtype, _, gradient):
    # The full gradient of every device, summed in f32 into this device's part.
    return (jax.lax.psum_scatter(gradient.astype(jnp.float32), axis, scatter_dimension=0, tiled=True),)


all_gather_cast.defvjp(_all_gather_cast_forward, _all_gather_cast_backward)


def gather(layouts: dict[str, GroupLayout], axis: str, dtype, part: jax.Array, group: str) -> dict[str, jax.Array]:
    """One group's weights, gathered from every device, in the compute dtype."""
    return views(all_gather_cast(part, axis, dtype), layouts[group])


def over_layers(one_layer, x, layers):
    """x through every layer: a loop over a list of parts, or `lax.scan` over them stacked as one
    [Layers, part] array (one layer traced and compiled once; XLA may pipeline a layer's gather and
    reduce-scatter under its neighbour's compute)."""
    if isinstance(layers, (list, tuple)):
        for w in layers:
            x = one_layer(x, w)
        return x
    return jax.lax.scan(lambda x, w: (one_layer(x, w), None), x, layers)[0]


def checkpointed(remat: bool, function, *args):
    """A layer, recomputed in the backward (with its gather) when remat, else kept."""
    return jax.checkpoint(function)(*args) if remat else function(*args)
