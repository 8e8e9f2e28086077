"""`fully_shard(model)`: each group's weights flattened into one f32 buffer,
this rank's part kept as the model's parameter, and the entries regenerated
to gather each group (in the compute dtype, cast fused into the gather) where
a function first uses it.

The order is fixed:
  1. resolve the process group and check the model against it;
  2. lay out each group (the embedding, each layer, the final norm with the
     head) in one flat buffer, aligned and padded to divide by the world;
  3. keep this rank's part of each buffer: read only the rows of the
     checkpoint that cover it, or draw one group at a time (the values the
     unsharded model draws), when the model was not read yet; else drop the
     full weights group by group, so the model is never held twice;
  4. regenerate the entries under a communication schedule
     (linnet/sharding/schedule.py: each layer's gather launched `prefetch` layers
     ahead) with the functions it calls bound here: the backward of a gather
     reduce-scatters the gradient into the f32 part, and each layer's gathered
     weights are not kept for the backward (ZeRO-3): the backward gathers them
     again. Two exceptions: compiled, the layers whose backward comes first
     (the last prefetch + 1, linnet/sharding/schedule.py) keep theirs; and
     reshard_after_forward=False keeps every gather. A table read only by
     lookups (an untied embedding) is never gathered: `lookup` moves the rows
     of the tokens instead.

The functions the regenerated source calls are linnet/torch/collectives.py's; the recompute
policies are linnet/torch/recompute.py's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from linnet.emit.fused_linears import runs_by_group
from linnet.hf.read import CheckpointWeights, RandomWeights, SliceReader, group_specs
from linnet.sharding.layout import GroupLayout, group_layouts
from linnet.sharding.schedule import Schedule
from linnet.torch import agree, ops, watchdog
from linnet.torch.collectives import Sharding, bindings, gathered_weights
from linnet.torch.hybrid import LateParts
from linnet.torch.model import TorchModel
from linnet.torch.read_parts import read_part
from linnet.torch.recompute import POLICIES

__all__ = ["ALIGN", "Sharding", "fully_shard", "gathered_weights"]

ALIGN = 16  # elements: each tensor of a group starts on a 64-byte boundary in f32


def fully_shard(model, *, group: dist.ProcessGroup | None = None, mesh=None, recompute: str | None = None,
                reshard_after_forward: bool | None = True, prefetch: int = 1, reduce_dtype: torch.dtype | None = None,
                mp_policy=None, stall_timeout: float | None = None, weights=None, compile: str | None = None,
                numerics: str | None = None, **fsdp2_options):
    """Shards `model` in place over `group` (default: the default process group) and returns it.

    model: a model from nest.load(..., backend="torch", cast_dtype=True), or a transformers causal LM of a
    family Linnet has (linnet/torch/causal_lm.py), or one of its decoder layers: FSDP2's pattern of a call
    on each layer and then on the model works as it is (the layers' calls only mark them).

    mesh: a DeviceMesh in place of `group`, as FSDP2's: of one dimension, it is that dimension's group;
    of two, named ("replicate", "shard") (init_device_mesh(..., (machines, gpus_per_machine),
    mesh_dim_names=("replicate", "shard"))), the weights are sharded inside each "shard" group and
    each replica holds the same parts: a part's gradient is reduce-scattered inside its shard group,
    then averaged across the replicas (compiled: an all-reduce launched when the reduce-scatter ends
    and waited for where the backward ends, under the layers below; eager: at once). An untied
    embedding's part is not all-reduced: its rows' gradients are gathered from every rank. The parts
    reduced last (the first layer's, a tied embedding's) are averaged across the replicas after the
    backward (linnet/torch/hybrid.py): in `train`, under the optimizer's step of the other parts.

    recompute: "gather" keeps each layer's activations and gathers its weights
    again in the backward; "matmuls" keeps only the outputs of its matrix
    products and attention, and recomputes the pointwise work between them
    (norms, rotations, activations) and the gathers; "full" recomputes each
    layer in the backward, keeping only its input.
    reshard_after_forward: as FSDP2's. True: each layer's gathered weights
    are dropped after its forward and gathered again for its backward (on one
    rank, cast again). False: they are kept from the forward to the backward,
    under every recompute policy: a gather (or cast) less a layer, for the
    layers' weights in the compute dtype, over this group's ranks, more memory
    where the backward starts (1B on one rank: about 1.8 GiB). On one rank,
    stepping in the backward, Adam's step then also writes each part's cast
    for the next forward, which casts nothing (`_casts_from_the_step`).
    prefetch: how many layers' gathers run ahead of the layer computing (0: each
    gather is launched where it is waited for).
    reduce_dtype: the dtype gradients are reduce-scattered in: float32 (as
    FSDP2's default), or bfloat16 for half the bytes. Either way the parts'
    gradients are f32, and they are the gradient of the mean of the ranks'
    losses (as DDP and FSDP2 give).
    stall_timeout: seconds after which the other ranks end the run, naming it,
    when a rank stops answering (linnet/torch/watchdog.py; default LINNET_STALL_TIMEOUT
    or 300; 0: never).
    mp_policy: FSDP2's MixedPrecisionPolicy: param_dtype is the compute dtype (a loaded model's must be its
    card's T; a transformers model's default is its parameters' dtype, as FSDP2's), reduce_dtype as above
    (default: param_dtype, as FSDP2's). FSDP2's other options (offload_policy, shard_placement_fn,
    ignored_params) are refused by name.

    For a transformers model only: weights, the folder a model on the meta device reads this rank's parts
    from (default: the folder it was made from); compile ("inductor", or "none"; default "inductor" on a
    GPU) and numerics ("exact" or "fast"; default "fast" on a GPU), as nest.load takes them. Its recompute
    defaults to "full" where gradient checkpointing was enabled, else "gather".
    """
    mp_param_dtype, mp_reduce_dtype = _mixed_precision(mp_policy, fsdp2_options)
    if reshard_after_forward is None:
        reshard_after_forward = True
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r} (resharding to "
                         "a smaller world is FSDP2's, not Linnet's)")
    if not isinstance(model, TorchModel):
        return _shard_module(model, group=group, mesh=mesh, recompute=recompute,
                             reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                             reduce_dtype=reduce_dtype or mp_reduce_dtype, param_dtype=mp_param_dtype,
                             stall_timeout=stall_timeout, weights=weights, compile=compile, numerics=numerics)
    for name, value in (("weights", weights), ("compile", compile), ("numerics", numerics)):
        if value is not None:
            raise ValueError(f"fully_shard takes {name}= for a transformers model; a loaded model has its "
                             f"{name} from nest.load")
    if mp_param_dtype is not None and mp_param_dtype != model.compute_dtype:
        raise ValueError(f"mp_policy's param_dtype is {mp_param_dtype}, but {model.card.name} computes in "
                         f"{model.compute_dtype} (its generic T): load it with that T instead")
    recompute = recompute or "gather"
    reduce_dtype = reduce_dtype or mp_reduce_dtype or torch.float32
    if recompute not in POLICIES:
        raise ValueError(f'recompute must be "gather", "matmuls" or "full", got {recompute!r}')
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"reduce_dtype must be torch.float32 or torch.bfloat16, got {reduce_dtype}")
    if not isinstance(model, TorchModel):
        raise TypeError(f"fully_shard takes a model from nest.load(..., backend='torch'), got {type(model).__name__}")
    if model.unusable is not None:
        raise RuntimeError(model.unusable)
    if getattr(model, "sharding", None) is not None:
        raise RuntimeError(f"{model.card.name} is already sharded (over {model.sharding.world} ranks); "
                           "fully_shard it once")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs a process group: call torch.distributed.init_process_group first "
                           "(under torchrun, or with world_size=1 for one process)")
    group, replicate, everyone = _groups(group, mesh)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    replicas, replica = (1, 0) if replicate is None else (dist.get_world_size(replicate), dist.get_rank(replicate))
    schedule = Schedule(prefetch, communicates=world > 1, replicas=replicas)
    _check_device(model, group)
    model.layer_region_over(world * replicas, recompute)  # refused (an error) before the model changes
    agree.cpu_group(everyone)  # where the ranks agree on each call's inputs (made here, where every rank is)
    watchdog.watch(everyone, stall_timeout)
    checked = model.checked
    layouts = group_layouts(checked, world, ALIGN)
    # Not read yet, the parts are cut from the checkpoint or the draw, and nothing changes until they are all
    # made. Loaded whole, the weights go group by group as their parts are cut (never held twice): from then
    # on, a failure leaves a model that can be neither used nor sharded again.
    parts = None if model.weight_source is None else _parts_from_source(model, layouts, rank, world)
    try:
        if parts is None:
            parts = _parts_from_weights(model, layouts, rank, world)
        model.params = parts
        model.sharding = Sharding(group.group_name, rank, world, layouts, recompute, model.compute_dtype,
                                  reduce_dtype if world * replicas > 1 else torch.float32, schedule,
                                  reshard_after_forward, None if replicate is None else replicate.group_name,
                                  replicas, replica, runs_by_group(checked, list(checked.program.functions.values())))
        emitted = model.emit(schedule=schedule)
        model.install(emitted.source, bindings(model.sharding))
        late = [model.params[key] if index is None else model.params[key][index] for key, index in emitted.late_parts]
        if late and model.trainable:  # (untrainable parts take no gradient, and no hook)
            model.late_parts = LateParts(late, model.sharding.reduce_dtype, replicate.group_name, replicas)
    except BaseException as error:
        model.sharding, model.unusable = None, (
            f"fully_shard of {model.card.name} failed after it began to cut the weights into parts "
            f"({type(error).__name__}: {error}): this model has lost them; nest.load it again")
        raise
    return model


def _mixed_precision(mp_policy, fsdp2_options: dict) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) of FSDP2's MixedPrecisionPolicy (None where it leaves one out), after
    refusing FSDP2's options Linnet does not do."""
    given = {name for name, value in fsdp2_options.items() if value is not None}
    unknown = given - {"offload_policy", "shard_placement_fn", "ignored_params"}
    if unknown:
        raise TypeError(f"fully_shard got unexpected keyword arguments {sorted(unknown)}")
    offload = fsdp2_options.get("offload_policy")
    if offload is not None and type(offload).__name__ != "OffloadPolicy":  # FSDP2's default, which offloads nothing
        raise ValueError(f"fully_shard does not offload to the CPU ({type(offload).__name__}): leave offload_policy "
                         "out; Linnet keeps the parts on the GPU and recomputes (recompute='full') to save memory")
    for name in ("shard_placement_fn", "ignored_params"):
        if fsdp2_options.get(name):
            raise ValueError(f"fully_shard does not take {name}: Linnet shards every weight of each layer along "
                             "one flat buffer")
    if mp_policy is None:
        return None, None
    if getattr(mp_policy, "output_dtype", None) is not None or not getattr(mp_policy, "cast_forward_inputs", True):
        raise ValueError("fully_shard takes mp_policy's param_dtype and reduce_dtype; its output_dtype and "
                         "cast_forward_inputs are FSDP2's")
    param, reduce = mp_policy.param_dtype, mp_policy.reduce_dtype
    return param, reduce or param


def _shard_module(model, *, group, mesh, recompute, reshard_after_forward, prefetch, reduce_dtype, param_dtype,
                  stall_timeout, weights, compile, numerics):
    """fully_shard of a transformers causal LM (linnet/torch/causal_lm.py): its engine sharded as any loaded
    model, then the model made to compute with it, its parameters the engine's parts."""
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard

    from linnet.torch import causal_lm

    if causal_lm.is_decoder_layer(model):
        return causal_lm.mark_layer(model)
    if not causal_lm.is_transformers_module(model):
        raise TypeError(f"fully_shard takes a model from nest.load(..., backend='torch') or a transformers causal "
                        f"LM, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs a process group: call torch.distributed.init_process_group first "
                           "(under torchrun, or with world_size=1 for one process)")
    shard_group, replicate, _ = _groups(group, mesh)
    if recompute is None:
        recompute = "full" if causal_lm.gradient_checkpointing(model) else "gather"
    device = causal_lm.group_device(shard_group, model)
    engine = causal_lm.engine_of(model, param_dtype=param_dtype, device=device, weights=weights, compile=compile,
                                 numerics=numerics)
    fully_shard(engine, group=group, mesh=mesh, recompute=recompute, reshard_after_forward=reshard_after_forward,
                prefetch=prefetch, reduce_dtype=reduce_dtype or engine.compute_dtype, stall_timeout=stall_timeout)
    if mesh is None:
        mesh = DeviceMesh.from_group(shard_group, device.type)
    # A 2-D mesh's parts: the same on each replica (the late parts averaged across them by their hooks,
    # linnet/torch/hybrid.py), sharded inside each "shard" group.
    placements = (Shard(0),) if replicate is None else (Replicate(), Shard(0))
    return causal_lm.sharded_in_place(model, engine, mesh, placements)


def _groups(group: dist.ProcessGroup | None,
            mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, dist.ProcessGroup]:
    """(the group that shards, the group of replicas or None, the group of every rank) from fully_shard's arguments."""
    if mesh is None:
        group = group or dist.group.WORLD
        return group, None, group
    if group is not None:
        raise ValueError("fully_shard takes group= or mesh=, not both")
    names = tuple(mesh.mesh_dim_names or ())
    match mesh.ndim:
        case 1:
            group = mesh.get_group()
            return group, None, group
        case 2 if names == ("replicate", "shard"):
            if mesh.size() != dist.get_world_size():
                raise ValueError(f"the mesh holds {mesh.size()} ranks of {dist.get_world_size()}: a 2-D mesh must hold "
                                 "every rank of the default process group")
            return mesh.get_group("shard"), mesh.get_group("replicate"), dist.group.WORLD
        case _:
            raise ValueError(f"fully_shard takes a mesh of one dimension, or of two named ('replicate', 'shard'); got "
                             f"{mesh.ndim} dimensions named {names}")


def _check_device(model: TorchModel, group: dist.ProcessGroup) -> None:
    """The model where the group's backends take tensors: a group made with no backend named (or with
    "cpu:gloo,cuda:nccl") takes both, and each collective goes to the backend of its tensors' device."""
    takes = sorted({device.type for device in group._device_types})
    if model.device.type not in takes:
        raise ValueError(f"the model is on {model.device} but the process group's backend "
                         f"({dist.get_backend(group)}) takes tensors on {' and '.join(takes)}: "
                         "nest.load(..., device=...) accordingly")
    if not model.cast_dtype:
        raise ValueError("fully_shard keeps f32 master parts and gathers in the compute dtype: "
                         "load the model with cast_dtype=True")


def _parts_from_weights(model: TorchModel, layouts: dict, rank: int, world: int) -> dict:
    """This rank's part of each group of weights already read, dropping the full weights group by group."""
    parts = {}
    for decl in model.checked.program.groups.values():
        layout, weights = layouts[decl.name], model.params.pop(decl.key)
        if decl.repeat is None:
            parts[decl.key] = _part_of(weights, layout, rank, world, model.trainable, model.device)
        else:
            parts[decl.key] = [_part_of(weights[i], layout, rank, world, model.trainable, model.device)
                               for i in range(len(weights))]
            del weights
    return parts


def _part_of(weights: dict, layout: GroupLayout, rank: int, world: int, trainable: bool,
             device: torch.device) -> torch.nn.Parameter:
    with torch.no_grad():
        # (in f32 on the model's device: a transformers model's weights may be in another dtype, or elsewhere)
        tensors = [weights[name].detach().to(device, torch.float32).reshape(-1) for name in layout.names]
        flat = ops.flatten(tensors, list(layout.offsets), layout.total)
        del tensors
        weights.clear()  # the full weights go as soon as the part exists
        part = ops.shard(flat, rank, world)
    return torch.nn.Parameter(part, requires_grad=trainable)


def _parts_from_source(model: TorchModel, layouts: dict, rank: int, world: int) -> dict:
    """This rank's part of each group, read from a checkpoint's slices (the rows covering the part) or drawn
    a group at a time in the order, and so with the values, of the unsharded model's draw."""
    source, parts = model.weight_source, {}
    draw = model._random_drawer(source.seed) if isinstance(source, RandomWeights) else None
    reader = SliceReader(source.files) if isinstance(source, CheckpointWeights) else None
    for decl, index, specs in group_specs(model.checked, model.specs()):
        layout = layouts[decl.name]
        if draw is not None:
            part = _part_of({spec.name: draw(spec, source.std) for spec in specs}, layout, rank, world, model.trainable,
                           model.device)
        else:
            part = torch.nn.Parameter(read_part(reader, specs, layout, rank).to(model.device),
                                      requires_grad=model.trainable)
        if index is None:
            parts[decl.key] = part
        else:
            parts.setdefault(decl.key, []).append(part)
    return parts
