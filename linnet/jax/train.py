"""The JAX training loop: one process over every device of a mesh (or one
process a machine, linnet/jax/hosts.py, over a ("replicate", "shard") mesh
of every machine's devices: `default_mesh`), each device on its own packed
rows, every weight fully sharded (inside each replica).

    model = nest.load("llama-3.1-8b-instruct", backend="jax_source", entry="loss_packed", numerics="fast",
                      generics={"Batch": 1, "MaxSeq": 4096, "T": "bf16"}, cast_dtype=True)
    params, history = train(model, batches, optimizer=optax.adamw(1e-5), steps=30,
                            mesh=Mesh(np.array(jax.devices()), ("data",)))

A step is one jitted function: `shard_map` runs the card's sharded
`loss_packed` on each device's rows (linnet/jax/shard.py gathers each layer's
weights where it runs and reduce-scatters its gradient into the f32 part),
then the optimizer updates the parts where they lie. With `scan_layers` the
layers' parts (and their optimizer state) are one [Layers, part] array while
the run lasts, which the step runs through `lax.scan` (`over_layers` in the
printed source): one layer compiled once. The loss optimised and
reported is the token-weighted mean over the whole global batch: each
device's mean is scaled by its share of the batch's loss weight, so the
summed gradients are those of the global mean.

`train` takes over the model's weights: while it runs they are the parts,
and they stay parts when it returns (held by `model.weight_source`, and
returned), so that no device ever holds the whole model: weights read whole
before are split into parts group by group, and weights not read yet (a model
fresh from `nest.load`) are built straight into them, from a checkpoint's
slices or drawn a group at a time. `model.save_weights` writes them a group
at a time and `evaluate` runs over their mesh; `model.params` and
`model.loss_packed` gather them whole on the first device, when asked.

`evaluate` runs where the weights are: whole ones on one device; parts over
their mesh, each device on its own rows as in a step. Weights not read yet are
first built into parts over every device, and kept, so that a `train` on that
mesh (the one sft_jax.py makes) starts from them rather than building them
again."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from linnet.checkpoint import resume_check
from linnet.emit import prims_jax
from linnet.history import History, Progress, Step, stop_unless_finite
from linnet.schedules import lr_factor
from linnet.train_options import check_train_options, evaluates_after
from linnet.jax import shard
from linnet.jax.checkpoint import JaxCheckpointer, optimizer_settings
from linnet.jax.model import JAX_DTYPES, JaxModel
from linnet.jax.xla import xla_options
from linnet.data.packing import LOSS_PACKED_INPUTS, Row, stack_rows

__all__ = ["default_mesh", "evaluate", "lr_schedule", "own_rows", "train"]

T = TypeVar("T")


def train(
    model: JaxModel,
    batches: Iterable[Row],
    *,
    optimizer: optax.GradientTransformation,
    steps: int,
    mesh: Mesh,
    remat: bool = True,
    scan_layers: bool = False,
    on_step: Callable[[Step], None] | None = None,
    checkpoint: str | None = None,
    checkpoint_every: int | None = None,
    accumulate: int = 1,
    max_grad_norm: float | None = None,
    eval_rows: list[Row] | None = None,
    eval_every: int | None = None,
) -> tuple[dict, History]:
    """`steps` optimizer steps, each over accumulate x mesh.size x Batch rows of `batches`; returns (params,
    history): params the model's parts (each group one flat f32 array split over the mesh), which it keeps.

    accumulate: batches of mesh.size x Batch rows a step, run one after another (`lax.scan`) with their
        gradients summed in the parts; the step's loss and gradients are the token-weighted mean over all
        of its rows, as one batch of them.
    max_grad_norm: clip the gradients at this global norm, as torch.nn.utils.clip_grad_norm_ does (scaled
        by max_grad_norm / (norm + 1e-6) where that is below 1); each step's norm before clipping is in its
        Step.grad_norm. None: no clipping.
    eval_rows, eval_every: every `eval_every` steps, and after the last, the held-out loss over `eval_rows` (every
        process holds them all, as `evaluate` takes them) in that Step.held_out_loss; its time is no step's.

    remat: recompute each layer (and gather its weights again) in the backward, keeping only its input;
        with the fast numerics the loss's chunks too (prims_jax.cross_entropy_chunked).
    scan_layers: while training, hold the layers' parts (and their optimizer state) as one [Layers, part]
        array and run them with `lax.scan`: one layer compiled once, and XLA free to pipeline a layer's
        gather and reduce-scatter under its neighbour's compute. Off by default: on one GPU the scanned step
        is slower and holds more, and the 8B's stacked layers find no room (docs/design/jax_speed.md, "Note:
        why layers are not scanned by default"). Kept to optimizers whose update of the
        stacked layers equals their update of each (checked on a small tree first: Adafactor's factored
        moments and LAMB's trust ratio are per array, so those run the layers as a loop).
    checkpoint: a folder to resume from, and to save into every `checkpoint_every` steps (if given) and after
        the last. The run holds it until it returns (another run pointed at it stops at once, naming this one),
        and checks before its first step that it can write a checkpoint there.

    A step whose loss is not finite stops the run on every process (NotFinite, naming the step), and so does a
    checkpoint whose parts or optimizer state are not: nothing of that step is saved, so `checkpoint` resumes
    from the last good step."""
    _check(model, mesh)
    check_train_options(accumulate, max_grad_norm, eval_rows, eval_every)
    if eval_every is not None and scan_layers:
        raise ValueError("train(eval_every=...) evaluates the parts a layer at a time, not stacked: "
                         "not with scan_layers=True")
    rows_a_step = accumulate * mesh.size * model.generics["Batch"]
    layouts = shard.group_layouts(model.checked, shard.shards(mesh))
    # The folder is checked and held before the weights are built: a run that cannot save fails at once.
    checkpointer = None if checkpoint is None else JaxCheckpointer(
        checkpoint, model.card.name, {g: layout.extent for g, layout in layouts.items()}, rows_a_step,
        description=resume_check.model_description(model.checked), steps=steps,
        row_length=model.generics["MaxSeq"], optimizer_settings=optimizer_settings(optimizer), devices=mesh.size,
        writer=jax.process_index() == 0)
    try:
        return _train(model, batches, optimizer, steps, mesh, remat, scan_layers, on_step, checkpointer,
                      checkpoint_every, layouts, accumulate, max_grad_norm, eval_rows, eval_every)
    finally:
        if checkpointer is not None:
            checkpointer.close()


def _train(model: JaxModel, batches: Iterable[Row], optimizer: optax.GradientTransformation, steps: int,
           mesh: Mesh, remat: bool, scan_layers: bool, on_step: Callable[[Step], None] | None,
           checkpointer: JaxCheckpointer | None, checkpoint_every: int | None, layouts, accumulate: int,
           max_grad_norm: float | None, eval_rows: list[Row] | None, eval_every: int | None) -> tuple[dict, History]:
    batch = model.generics["Batch"]
    rows_a_batch = mesh.size * batch
    rows_a_step = accumulate * rows_a_batch
    own_rows = _own_devices(mesh) * batch  # what this process's batches give a batch of the step
    if model.weight_source is not None:  # not read whole: built into parts
        parts = shard.parts_from_source(model, layouts, mesh)
    else:
        parts = shard.shard_weights(model.checked, model.params, layouts, mesh)
    model.params, model.training_mesh = parts, mesh
    opt_state = None
    try:
        opt_state = jax.jit(optimizer.init, out_shardings=shard.placements(
            jax.eval_shape(optimizer.init, parts), parts, mesh))(parts)
        history = History()
        rows: Iterator[Row] = iter(batches)
        rows_consumed = 0  # over every run that led here
        if checkpointer is not None:
            history.resumed_from, parts, opt_state = _on_every_process(
                f"resuming from {checkpointer.folder}", lambda: checkpointer.resume(parts, opt_state))
            _same_step_on_every_process(history.resumed_from, checkpointer.folder)
            if history.resumed_from > steps:
                raise ValueError(f"the checkpoint in {checkpointer.folder} is at step {history.resumed_from}, "
                                 f"past steps={steps}")
            if history.resumed_from:
                rows_consumed = checkpointer.manifest["rows_consumed"]
                rows = itertools.islice(rows, _own_consumed(rows_consumed, rows_a_batch, own_rows), None)
            _on_every_process(f"checking the room in {checkpointer.folder}",
                              lambda: checkpointer.check_room(parts, opt_state))
        if scan_layers and layers_separable(optimizer, parts):  # after resuming: checkpoints hold a part a layer
            parts, opt_state = shard.stack_layers(parts, mesh), shard.stack_layers(opt_state, mesh)
        state_placements = shard.placements((parts, opt_state), parts, mesh)
        step_functions = {}  # by the attention kernel the rows take (_attention_kernel), each compiled when first met
        placement = NamedSharding(mesh, _batches_spec(mesh))
        report = on_step or Progress(steps, 0)

        def rows_of(step: int):
            chunk = list(itertools.islice(rows, accumulate * own_rows))
            if len(chunk) < accumulate * own_rows:
                times = f"{accumulate} batches x " if accumulate > 1 else ""
                raise ValueError(f"the batches ran out at step {step} of {steps}: each step takes "
                                 f"{accumulate * own_rows} rows ({times}{own_rows // batch} devices x Batch "
                                 f"{batch}{_of_all(mesh)})")
            for index, row in enumerate(chunk):
                row.check_ids(model.checked.dims["Vocab"], f"step {step}, row {index}")
            stacked = [_stack(chunk[i:i + own_rows], model.generics["MaxSeq"])
                       for i in range(0, len(chunk), own_rows)]
            return chunk, [np.stack(arrays) for arrays in zip(*stacked)]  # each [accumulate, own rows, MaxSeq]

        for step in range(history.resumed_from + 1, steps + 1):
            chunk, arrays = _on_every_process(f"taking the rows of step {step}", lambda: rows_of(step))
            segments = arrays[LOSS_PACKED_INPUTS.index("segments")]
            kernel = _agreed_kernel(_attention_kernel(model, mesh, segments.reshape(-1, segments.shape[-1])))
            if kernel not in step_functions:
                step_functions[kernel] = _step_function(model, layouts, mesh, optimizer, remat, parts,
                                                        state_placements, kernel, accumulate=accumulate,
                                                        max_grad_norm=max_grad_norm)
            inputs = [jax.make_array_from_process_local_data(placement, array) for array in arrays]
            start = time.perf_counter()
            parts, opt_state, (loss, weight, norm) = step_functions[kernel](parts, opt_state, *inputs)
            loss, weight = float(loss.addressable_data(0)), float(weight.addressable_data(0))  # waits for the step
            seconds = time.perf_counter() - start
            model.params = parts
            rows_consumed += rows_a_step
            grad_norm = None if max_grad_norm is None else float(norm.addressable_data(0))
            held_out = None
            if evaluates_after(step, steps, eval_every):
                held_out = _evaluate_sharded(model, eval_rows, shard.ShardedWeights(parts, layouts, mesh))
            record = Step(step, loss, seconds, rows_a_step * len(chunk[0].tokens), weight, _learning_rate(opt_state),
                          grad_norm, held_out)
            history.steps.append(record)
            report(record)
            stop_unless_finite(record, checkpointer)
            if checkpointer is not None and ((checkpoint_every and step % checkpoint_every == 0) or step == steps):
                _on_every_process(f"saving a checkpoint into {checkpointer.folder}", lambda: checkpointer.save(
                    step, parts, opt_state, rows_consumed=rows_consumed, devices=mesh.size))
    finally:  # however the run ends, the model holds its weights as parts, a flat one a layer
        opt_state = None  # first: the layers are briefly held twice while they are cut apart
        parts = shard.unstack_layers(parts)
        model.params = {}  # which clears weight_source: set it after
        model.weight_source = shard.ShardedWeights(parts, layouts, mesh)
        model.training_mesh = None
    return parts, history


def evaluate(model: JaxModel, batches: Iterable[Row]) -> float:
    """The token-weighted mean of `model.loss_packed` over `batches`: on one device if the weights are whole,
    else over the mesh of their parts, each device on Batch rows at a time (weights not read yet are built
    into parts over every device first, and stay parts, as `train` would build them)."""
    model.check_whole("evaluate")
    if "loss_packed" not in model.entries:
        raise ValueError(f"evaluate needs the loss_packed entry; the model was loaded with entries {model.entries}")
    rows = list(batches)
    for index, row in enumerate(rows):
        row.check_ids(model.checked.dims["Vocab"], f"evaluate, row {index}")
    if not any(row.weights.sum() for row in rows):
        raise ValueError("evaluate got no rows with loss weight")
    _check_positions(rows[0], model.generics["MaxSeq"])
    source = model.weight_source
    # Weights train could not take as parts (not cast to f32) are read whole, as before.
    if source is None or not model.cast_dtype:
        return _evaluate_whole(model, rows)
    if not isinstance(source, shard.ShardedWeights):
        mesh = default_mesh()
        layouts = shard.group_layouts(model.checked, shard.shards(mesh))
        parts = shard.parts_from_source(model, layouts, mesh)
        model.params = {}  # which clears weight_source: set it after
        model.weight_source = source = shard.ShardedWeights(parts, layouts, mesh)
    return _evaluate_sharded(model, rows, source)


def _evaluate_whole(model: JaxModel, rows: list[Row]) -> float:
    batch = model.generics["Batch"]
    loss_sum = weight_sum = 0.0
    for start in range(0, len(rows), batch):
        chunk = _padded(rows[start:start + batch], batch)
        weight = float(sum(row.weights.sum() for row in chunk))
        if weight:
            loss_sum += float(model.loss_packed(*map(jnp.asarray, _stack(chunk, model.generics["MaxSeq"])))) * weight
            weight_sum += weight
    return loss_sum / weight_sum


def _evaluate_sharded(model: JaxModel, rows: list[Row], weights: shard.ShardedWeights) -> float:
    mesh = weights.mesh
    rows_a_step = mesh.size * model.generics["Batch"]
    placement = NamedSharding(mesh, _rows_spec(mesh))
    functions = {}  # by the attention kernel the rows take, as in train (every process sees the same rows)
    loss_sum = weight_sum = 0.0
    for start in range(0, len(rows), rows_a_step):  # every process holds every row, and places its own
        chunk = _padded(rows[start:start + rows_a_step], rows_a_step)
        weight = float(sum(row.weights.sum() for row in chunk))
        if weight:
            arrays = _stack(chunk, model.generics["MaxSeq"])
            kernel = _attention_kernel(model, mesh, arrays[LOSS_PACKED_INPUTS.index("segments")])
            if kernel not in functions:
                functions[kernel] = _evaluate_function(model, weights.layouts, mesh, kernel)
            inputs = [shard.from_host(array, placement) for array in arrays]
            loss_sum += float(functions[kernel](weights.parts, *inputs).addressable_data(0))
            weight_sum += weight
    return loss_sum / weight_sum


def _padded(chunk: list[Row], size: int) -> list[Row]:
    """`chunk` filled up to `size` rows with rows of zero loss weight."""
    blank = chunk[0]
    weightless = Row(blank.tokens, blank.targets, blank.positions, blank.segments, 0 * blank.weights, 0)
    return chunk + [weightless] * (size - len(chunk))


def _check(model, mesh: Mesh) -> None:
    if not isinstance(model, JaxModel):
        raise TypeError(f"linnet.jax.train takes a model from nest.load(..., backend='jax_source'), "
                        f"got {type(model).__name__}")
    if "loss_packed" not in model.entries:
        raise ValueError(f"train needs the loss_packed entry; the model was loaded with entries {model.entries}")
    if not model.cast_dtype:
        raise ValueError("train keeps f32 master parts and gathers them in the compute dtype: "
                         "load the model with cast_dtype=True")
    if len(mesh.axis_names) != 1 and tuple(mesh.axis_names) != ("replicate", "shard"):
        raise ValueError(f"train takes a mesh of one axis (the parts split over every device) or of two named "
                         f"('replicate', 'shard') (split inside each replica), got axes {mesh.axis_names}")
    if jax.process_count() > 1:
        if mesh.size != jax.device_count():
            raise ValueError(f"over several processes train's mesh holds every device of every process: "
                             f"{jax.device_count()}, got {mesh.size}")
        for replica in mesh.devices.reshape(-1, shard.shards(mesh)):
            if len({device.process_index for device in replica}) > 1:
                raise ValueError(f"over several processes each replica lies inside one process (its 'shard' axis "
                                 f"over that process's devices: linnet.jax.train.default_mesh()); the mesh "
                                 f"{dict(mesh.shape)} splits the parts across processes")


def lr_schedule(peak: float, name: str, warmup: int, steps: int, floor: float = 0.0) -> optax.Schedule:
    """The learning rate of linnet.schedules' `name` ("constant", "linear" or "cosine") over `steps` from `peak`,
    after a linear warm-up of `warmup` steps, falling to `floor` times `peak`: the same as PyTorch's
    linnet.torch.train.lr_schedule, step for step."""
    factor = lr_factor(name, warmup, steps, floor, xp=jnp)
    return lambda count: peak * factor(count)


def default_mesh() -> Mesh:
    """Every device: one axis in one process; across processes (machines) ("replicate", "shard"), a
    replica a process, its parts split over that process's devices."""
    devices = np.array(jax.devices())
    if jax.process_count() == 1:
        return Mesh(devices, ("data",))
    by_process = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(by_process).reshape(jax.process_count(), -1), ("replicate", "shard"))


def own_rows(rows: Iterable[Row], mesh: Mesh, batch: int) -> Iterator[Row]:
    """This process's rows of a run over `mesh` (Batch rows a device) from the rows of the whole run, in
    the order one process would place them on the same mesh: what each process hands `train`."""
    rows_a_step, own = mesh.size * batch, _own_devices(mesh) * batch
    first = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()][0] * batch
    for index, row in enumerate(rows):
        if first <= index % rows_a_step < first + own:
            yield row


def _own_consumed(consumed: int, rows_a_step: int, own: int) -> int:
    """How many of this process's rows the run resumed from used: its share of each step's."""
    if own == rows_a_step:
        return consumed
    if consumed % rows_a_step:
        raise ValueError(f"the checkpoint's run used {consumed} rows, not a whole number of this run's steps of "
                         f"{rows_a_step} rows, so each process's share of them is not known: resume with as many "
                         f"rows a step as it had (devices x Batch), or in one process")
    return consumed // rows_a_step * own


def _own_devices(mesh: Mesh) -> int:
    return sum(device.process_index == jax.process_index() for device in mesh.devices.flat)


def _of_all(mesh: Mesh) -> str:
    return f", of {mesh.size} devices in {jax.process_count()} processes" if jax.process_count() > 1 else ""


def _rows_spec(mesh: Mesh) -> PartitionSpec:
    """The rows of a batch split over every device of the mesh, replicas first."""
    return PartitionSpec(tuple(mesh.axis_names))


def _batches_spec(mesh: Mesh) -> PartitionSpec:
    """A step's [accumulate, rows, MaxSeq] inputs: every device takes its rows of each batch."""
    return PartitionSpec(None, tuple(mesh.axis_names))


def _stack(rows: list[Row], positions: int) -> list[np.ndarray]:
    _check_positions(rows[0], positions)
    return stack_rows(rows)


def _check_positions(row: Row, positions: int) -> None:
    if len(row.tokens) != positions:
        raise ValueError(f"rows of {len(row.tokens)} positions, but the model was loaded for MaxSeq {positions}: "
                         f"pack(examples, {positions})")


def _attention_kernel(model: JaxModel, mesh: Mesh, segments: np.ndarray) -> int | None:
    """The fast attention's kernel for these rows (prims_jax.rows_kernel), chosen on the host, where it
    is a choice (fast numerics on a GPU): the step then holds no lax.switch, whose branch index XLA reads
    back on the host, or runs as a conditional inside its command buffers (docs/design/jax_speed.md, "Note:
    the attention kernel chosen on the host")."""
    if model.numerics != "fast" or mesh.devices.flat[0].platform != "gpu":
        return None
    return prims_jax.rows_kernel(segments)


def _on_every_process(what: str, action: Callable[[], T]) -> T:
    """`action()` here; over several processes, each learns whether every one's succeeded, and all raise where
    any failed (the first process's save, say), rather than leave the others waiting in the next collective."""
    try:
        result, failure = action(), None
    except Exception as error:
        result, failure = None, error
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.asarray(multihost_utils.process_allgather(np.int32(failure is not None)))
        if failure is None and failed.any():
            raise RuntimeError(f"{what} failed on process {', '.join(map(str, np.flatnonzero(failed)))}; "
                               f"its own error says why")
    if failure is not None:
        raise failure
    return result


def _same_step_on_every_process(step: int, folder: Path) -> None:
    """Each process reads the checkpoint folder itself: all must have found the same step."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    steps = np.asarray(multihost_utils.process_allgather(np.int64(step))).tolist()
    if len(set(steps)) > 1:
        found = ", ".join(f"step {s} on process {i}" for i, s in enumerate(steps))
        raise ValueError(f"the processes found different checkpoints to resume from ({found}; {folder} on "
                         f"process {jax.process_index()}): every process resumes from the folder the first one "
                         f"writes, so it must be one folder that all of them see")


def _agreed_kernel(kernel: int | None) -> int | None:
    """Over several processes, each with its own rows, the kernel that suits every process's (the higher
    number: the dense mask suits any rows, the packed layout for 16 any of up to 16 documents), so that
    every process runs the same step."""
    if kernel is None or jax.process_count() == 1:
        return kernel
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(kernel))))


def _sharded_loss_packed(model: JaxModel, layouts, axis: str, remat: bool, kernel: int | None = None):
    """The card's `loss_packed` in its sharded form, run inside shard_map over `axis`: (parts, *inputs) -> loss.
    kernel: the fast attention's, chosen on the host (_attention_kernel), or None: on the device."""
    dtype = JAX_DTYPES[model.generics[model.checked.program.compute_dtype]]
    namespace = {"gather": partial(shard.gather, layouts, axis, dtype),
                 "checkpointed": partial(shard.checkpointed, remat), "over_layers": shard.over_layers}
    primitives = {}
    if kernel is not None:
        primitives["attention"] = partial(prims_jax.attention_fast, kernel=kernel)
    # With remat the fast loss is recomputed in the backward too: its one-pass form then cost a gradient's
    # worth of memory (prims_jax.cross_entropy_chunked says what was measured).
    if remat and model.numerics == "fast":
        primitives["cross_entropy"] = partial(prims_jax.cross_entropy_chunked, recompute=True)
    return model.execute(model.emit(sharded=True, primitives=primitives).source, namespace)["loss_packed"]


def _evaluate_function(model: JaxModel, layouts, mesh: Mesh, kernel: int | None):
    """(parts, *inputs split over the mesh) -> the sum over the devices of each one's loss times its loss weight."""
    loss_packed = _sharded_loss_packed(model, layouts, shard.shard_axis(mesh), remat=False, kernel=kernel)

    def device_loss(parts, tokens, targets, positions, segments, weights):
        local = jnp.sum(weights)
        loss = loss_packed(parts, tokens, targets, positions, segments, weights).astype(jnp.float32)
        # A device given only padding has no mean to weigh (its loss may be 0/0).
        return jax.lax.psum(jnp.where(local > 0, loss * local, 0.0), tuple(mesh.axis_names))

    return jax.jit(jax.shard_map(device_loss, mesh=mesh, out_specs=PartitionSpec(),
                                 in_specs=(PartitionSpec(shard.shard_axis(mesh)), *(_rows_spec(mesh),) * 5)),
                   compiler_options=xla_options(mesh.devices.flat[0].platform))


def _step_function(model: JaxModel, layouts, mesh: Mesh, optimizer, remat: bool, parts, state_placements,
                   kernel: int | None, accumulate: int = 1, max_grad_norm: float | None = None):
    """The jitted step: (parts, opt_state, *inputs each [accumulate, rows, MaxSeq]) -> (parts, opt_state,
    (loss, loss weight, gradient norm before clipping))."""
    axis, every = shard.shard_axis(mesh), tuple(mesh.axis_names)
    part_specs = jax.tree.map(lambda part: shard.part_spec(part, axis), parts)
    loss_packed = _sharded_loss_packed(model, layouts, axis, remat, kernel)

    def device_step(parts, *inputs):
        local = jnp.sum(inputs[-1])  # the loss weight of this device's rows, over every batch of the step
        total = jnp.maximum(jax.lax.psum(local, every), jnp.finfo(jnp.float32).tiny)

        def batch_gradients(batch):
            def scaled_loss(parts):
                return loss_packed(parts, *batch) * (jnp.sum(batch[-1]) / total)

            return jax.value_and_grad(scaled_loss)(parts)

        if accumulate == 1:
            loss, gradients = batch_gradients([x[0] for x in inputs])
        else:
            def add_batch(summed, batch):
                loss, gradients = batch_gradients(batch)
                return jax.tree.map(jnp.add, summed, gradients), loss

            zeros = jax.tree.map(jnp.zeros_like, parts)
            gradients, losses = jax.lax.scan(add_batch, zeros, inputs)
            loss = jnp.sum(losses)
        # Across replicas (a 2-D mesh) the parts' gradients are summed by shard_map itself: the transpose of
        # using a part that every replica holds alike.
        return (jax.lax.psum(loss, every), jax.lax.psum(local, every)), gradients

    split = _batches_spec(mesh)
    sharded_step = jax.shard_map(device_step, mesh=mesh, in_specs=(part_specs, *(split,) * 5),
                                 out_specs=((PartitionSpec(), PartitionSpec()), part_specs))

    def step(parts, opt_state, *inputs):
        (loss, weight), gradients = sharded_step(parts, *inputs)
        norm = jnp.zeros((), jnp.float32)
        if max_grad_norm is not None:  # as torch.nn.utils.clip_grad_norm_
            norm = optax.tree.norm(gradients)
            scale = jnp.minimum(max_grad_norm / (norm + 1e-6), 1.0)
            gradients = jax.tree.map(lambda gradient: gradient * scale, gradients)
        updates, opt_state = optimizer.update(gradients, opt_state, parts)
        return optax.apply_updates(parts, updates), opt_state, (loss, weight, norm)

    # The outputs are placed as the inputs were, so that the next step neither moves them nor recompiles.
    everywhere = NamedSharding(mesh, PartitionSpec())
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(*state_placements, (everywhere,) * 3),
                   compiler_options=xla_options(mesh.devices.flat[0].platform))


def layers_separable(optimizer: optax.GradientTransformation, parts: dict) -> bool:
    """Whether `optimizer` updates the layers stacked as [Layers, part] as it updates each on its own:
    two steps on a small tree shaped as `parts` (each array 8 values, every layer different), in both
    forms. An optimizer whose state or masks follow the tree of one array a layer fails here, and so
    runs the layers as a loop."""
    rng = np.random.default_rng(0)
    small = jax.tree.map(lambda _: rng.standard_normal(8).astype(np.float32), parts)
    gradients = [jax.tree.map(lambda _: rng.standard_normal(8).astype(np.float32), parts) for _ in range(2)]

    def two_steps(params, grads):
        state = optimizer.init(params)
        for gradient in grads:
            updates, state = optimizer.update(gradient, state, params)
            params = optax.apply_updates(params, updates)
        return params

    def stacked(tree):
        return jax.tree.map(lambda node: np.stack(node) if isinstance(node, list) else node, tree,
                            is_leaf=lambda node: isinstance(node, list))

    try:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            each = stacked(two_steps(small, gradients))
            together = two_steps(stacked(small), [stacked(g) for g in gradients])
        return jax.tree.all(jax.tree.map(lambda a, b: bool(np.allclose(a, b, rtol=1e-6, atol=1e-7)), each, together))
    except Exception:  # noqa: BLE001  (a structure the optimizer cannot take stacked: run a loop)
        return False


def _learning_rate(opt_state) -> float:
    """The learning rate of this step where the optimizer exposes it (optax.inject_hyperparams), else NaN."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    return float(shard.to_host(found[0][1])) if found else float("nan")
