"""`fully_shard(model)`: each group's weights flattened into one f32 buffer,
this rank's part kept as the model's parameter, and the entries regenerated
to gather each group (in the compute dtype, cast fused into the gather) where
a function first uses it.

The order is fixed:
  1. resolve the process group and check the model against it;
  2. lay out each group (the embedding, each layer, the final norm with the
     head) in one flat buffer, aligned and padded to divide by the world;
  3. keep this rank's part of each buffer and drop the full weights, group by
     group, so the model is never held twice;
  4. regenerate the entries with `gather` and `checkpointed` bound: the
     backward of a gather reduce-scatters the gradient into the f32 part, and
     each layer's gathered weights are not kept for the backward (ZeRO-3): the
     backward gathers them again."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from linnet.torch import ops
from linnet.torch.model import TorchModel

ALIGN = 16  # elements: each tensor of a group starts on a 64-byte boundary in f32


@dataclass(frozen=True)
class GroupLayout:
    """Where each weight of one group lies in its flat buffer."""

    group: str  # the card's group name ("Layer")
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    total: int  # padded: world * part_size
    part_size: int

    @property
    def numel(self) -> int:
        return sum(_numel(s) for s in self.shapes)

    @property
    def extent(self) -> int:
        """Where the last weight ends: the buffer's content, before the padding."""
        return self.offsets[-1] + _numel(self.shapes[-1])


@dataclass(frozen=True)
class Sharding:
    group_name: str
    rank: int
    world: int
    layouts: dict  # card group name -> GroupLayout
    recompute: str
    compute_dtype: torch.dtype


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def fully_shard(model: TorchModel, *, group: dist.ProcessGroup | None = None, recompute: str = "gather") -> TorchModel:
    """Shards `model` in place over `group` (default: the default process group) and returns it.

    recompute: "gather" keeps each layer's activations and gathers its weights
    again in the backward; "full" recomputes each layer in the backward, keeping
    only its input.
    """
    match recompute:
        case "gather" | "full":
            pass
        case _:
            raise ValueError(f'recompute must be "gather" or "full", got {recompute!r}')
    if not isinstance(model, TorchModel):
        raise TypeError(f"fully_shard takes a model from nest.load(..., backend='torch'), got {type(model).__name__}")
    if getattr(model, "sharding", None) is not None:
        raise RuntimeError(f"{model.card.name} is already sharded (over {model.sharding.world} ranks); fully_shard it once")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs a process group: call torch.distributed.init_process_group first "
                           "(under torchrun, or with world_size=1 for one process)")
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _check_device(model, group)
    checked = model.checked
    layouts = {}
    for decl in checked.program.groups.values():
        weights = [w for w in decl.weights if not checked.is_tied(w)]
        shapes = tuple(checked.weight_shape(w) for w in weights)
        layout = ops.flat_layout([_numel(s) for s in shapes], ALIGN, world)
        layouts[decl.name] = GroupLayout(decl.name, tuple(w.name for w in weights), shapes, tuple(layout.offsets),
                                         layout.total, layout.part_size)
        _check_split(layouts[decl.name], world)
    parts = {}
    for decl in checked.program.groups.values():
        layout = layouts[decl.name]
        if decl.repeat is None:
            parts[decl.key] = _shard_group(model.params.pop(decl.key), layout, rank, world, model.trainable)
        else:
            layers = model.params.pop(decl.key)
            parts[decl.key] = [_shard_group(layers[i], layout, rank, world, model.trainable) for i in range(len(layers))]
            del layers
    model.params = parts
    model.sharding = Sharding(group.group_name, rank, world, layouts, recompute, model.compute_dtype)
    namespace = {"gather": partial(_gather, model.sharding), "checkpointed": partial(_checkpointed, recompute)}
    model._install(model.emit(sharded=True), namespace)
    return model


def _check_device(model: TorchModel, group: dist.ProcessGroup) -> None:
    backend = dist.get_backend(group)
    wanted = "cuda" if backend == "nccl" else "cpu"
    if model.device.type != wanted:
        raise ValueError(f"the model is on {model.device} but the process group's backend is {backend}, "
                         f"which needs the model on {wanted}: nest.load(..., device=...) accordingly")
    if not model.cast_dtype:
        raise ValueError("fully_shard keeps f32 master parts and gathers in the compute dtype: "
                         "load the model with cast_dtype=True")


def _check_split(layout: GroupLayout, world: int) -> None:
    """A world so large that most of a group's buffer would be padding is a mistake, not a plan."""
    if 2 * layout.extent < layout.total:
        raise ValueError(
            f"group {layout.group} has {layout.numel} elements: split over {world} ranks into parts of "
            f"{layout.part_size} (a multiple of {ALIGN}), more than half of its buffer would be padding. "
            f"Use fewer ranks."
        )


def _shard_group(weights: dict, layout: GroupLayout, rank: int, world: int, trainable: bool) -> torch.Tensor:
    with torch.no_grad():
        tensors = [weights[name].detach().reshape(-1) for name in layout.names]
        flat = ops.flatten(tensors, list(layout.offsets), layout.total)
        del tensors
        weights.clear()  # the full weights go as soon as the part exists
        part = ops.shard(flat, rank, world)
    return torch.nn.Parameter(part, requires_grad=trainable)


def _gather(sharding: Sharding, part: torch.Tensor, group: str) -> dict[str, torch.Tensor]:
    """One group's weights, gathered from every rank, in the compute dtype."""
    layout = sharding.layouts[group]
    full = ops.wait(ops.all_gather(part, sharding.compute_dtype, sharding.world, sharding.group_name))
    views = ops.group_views(full, list(layout.offsets), layout.shapes)
    return dict(zip(layout.names, views))


def gathered_weights(model: TorchModel, dtype: torch.dtype):
    """(checkpoint name, full tensor in dtype, on the CPU) for every weight; every rank must iterate it."""
    sharding = model.sharding
    specs = {(s.group, s.index, s.name): s.checkpoint_name for s in model.specs()}
    for decl in model.checked.program.groups.values():
        layout = sharding.layouts[decl.name]
        parts = model.params[decl.key]
        for index, part in enumerate(parts if decl.repeat is not None else [parts]):
            with torch.no_grad():
                full = ops.wait(ops.all_gather(part.detach(), dtype, sharding.world, sharding.group_name)).cpu()
            views = ops.group_views(full, list(layout.offsets), layout.shapes)
            for name, view in zip(layout.names, views):
                yield specs[(decl.key, index if decl.repeat is not None else None, name)], view


def _gather_policy(ctx, func, *args, **kwargs):
    """Recompute the gather and the views of what it returns; keep everything else."""
    if func in ops.collective_overloads() or getattr(func, "is_view", False):  # higher-order ops have no is_view
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def _checkpointed(recompute: str, function, *args):
    if recompute == "full":
        return checkpoint(function, *args, use_reentrant=False)
    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _gather_policy))
