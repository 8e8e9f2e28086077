"""Checkpoints of a JAX training run (linnet.jax.train), crash-safe as the
PyTorch ones: linnet/checkpoint/folder.py writes the folder aside and makes it
visible with its manifest, last.

One process drives every device (or one a machine, each holding a copy of
every part: the first writes, every one resumes). A checkpoint holds one `.npy` file an
array: each part and each optimizer-state array, gathered to the host one at
a time (so the host never holds more than the largest), listed in the
manifest under its path in its pytree (`parts['layers'][3]`,
`optimizer[0].mu['layers'][3]`) with its dtype (bf16 is stored as its bits).
The manifest also holds the card, its groups' counts and shapes, the step,
the number of devices, the rows used, each group's extent and the
optimizer's settings. Resuming on another number of devices re-pads each
flat array: the content up to its group's extent is the same whatever the
split, and the padding after it stays zero (its gradient is zero, so AdamW
leaves it there). Training draws no random numbers, so there is no RNG
state to keep.

A JaxCheckpointer holds its folder from its creation until close(). Resuming
refuses a checkpoint of another card or of other shapes (a layer more or
less), naming each difference; it follows this run's optimizer settings,
with a note where they differ: optax keeps them in the optimizer (which is
this run's), except those of `optax.inject_hyperparams`, which live in the
state and are kept as this run set them."""

from __future__ import annotations

import functools
import itertools
import numbers
import re
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linnet.checkpoint import folder as checkpoint_folder
from linnet.checkpoint import lock as folder_lock
from linnet.checkpoint import resume_check
from linnet.jax.shard import from_host, to_host
from linnet.checkpoint.storage import storage_errors
from linnet.errors import NotFinite

FRAMEWORK = "jax"
NPY_HEADER = 128  # bytes before an .npy file's data


def _named_leaves(prefix: str, tree) -> dict[str, jax.Array]:
    return {prefix + jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_finite(step: int, parts, opt_state) -> None:
    """Raises NotFinite where a part or a floating array of the optimizer state holds inf or nan, naming how many
    and the first. The flags are computed where the arrays lie, one scalar each, the same on every process."""
    leaves = {**_named_leaves("parts", parts), **_named_leaves("optimizer", opt_state)}
    named = [(name, leaf) for name, leaf in leaves.items() if jnp.issubdtype(leaf.dtype, jnp.floating)]
    if not named:
        return
    flags = _all_finite([leaf for _, leaf in named])
    bad = [name for (name, _), flag in zip(named, flags) if not bool(flag.addressable_data(0))]
    if bad:
        raise NotFinite(f"step {step} is not saved: after its update {len(bad)} of the {len(named)} arrays of parts "
                        f"and optimizer state hold inf or nan (the first: {bad[0]})")


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> list[jax.Array]:
    return [jnp.all(jnp.isfinite(leaf)) for leaf in leaves]


def _saved_leaves(prefix: str, tree):
    """(name, array) of each array a checkpoint holds, one at a time. Layers a run stacks as one [Layers,
    part] array (linnet.jax.train's scan_layers) are saved a layer an array, named as in the list form
    (`parts['layers'][3]`): a checkpoint is the same whichever form the run held, and resumes in either."""
    for name, leaf in _named_leaves(prefix, tree).items():
        if getattr(leaf, "ndim", 0) == 2:
            for index in range(leaf.shape[0]):
                yield f"{name}[{index}]", leaf[index]
        else:
            yield name, leaf


def _is_hyperparameter(name: str) -> bool:
    """A setting `optax.inject_hyperparams` keeps in the state (the learning rate): this run's wins on resuming."""
    return ".hyperparams[" in name


class JaxCheckpointer(folder_lock.HoldsFolder):
    """Saves a run's parts and optimizer state into `folder` and resumes from them, holding the folder (its
    lock) from its creation until close().

    description: the model's groups, counts and shapes (resume_check.model_description); steps, row_length,
    optimizer_settings (optimizer_settings(optimizer)) and devices: what this run asked for, which a checkpoint
    records and a resumed run compares with its own."""

    def __init__(self, folder, card_name: str, extents: dict[str, int], rows_a_step: int, keep: int = 2, *,
                 description: dict | None = None, steps: int | None = None, row_length: int | None = None,
                 optimizer_settings: dict | None = None, devices: int | None = None, writer: bool = True):
        self.folder, self.card_name, self.extents, self.keep = Path(folder), card_name, extents, keep
        self.rows_a_step, self.description, self.steps, self.row_length = rows_a_step, description, steps, row_length
        self.optimizer_settings, self.devices = optimizer_settings, devices
        self.hyperparameters: dict[str, float] | None = None  # this run's injected ones, before a resume
        self.manifest: dict | None = None
        self.saved_step = 0  # the step of the newest checkpoint in the folder: saved by this run, or resumed
        self.known: dict[str, str | None] = {}  # what was found of the folder's checkpoints
        self.writer = writer  # False: a process that resumes from the folder but leaves it to the first to write
        self.lock = folder_lock.take(self.folder) if writer else None

    def check_room(self, parts, opt_state) -> None:
        """Before the first step: fails now, not at the first save, if the disk cannot hold a checkpoint."""
        if self.writer:
            checkpoint_folder.check_room(self.folder, _bytes_needed(parts, opt_state), self.known)

    def save(self, step: int, parts, opt_state, *, rows_consumed: int, devices: int) -> Path | None:
        """Writes a checkpoint (the writer; None elsewhere), each array fetched from this process's devices,
        which hold every part whole (linnet.jax.train keeps a replica inside a process). Every process calls
        it: a state that is not finite is refused on each (NotFinite) before the folder is touched, so no
        checkpoint is pruned for it."""
        _check_finite(step, parts, opt_state)
        if not self.writer:  # the writer's failure reaches every process (linnet.jax.train agrees on the save)
            self.saved_step = step
            return None
        partial = checkpoint_folder.partial_path(self.folder, step)
        checkpoint_folder.make_room(self.folder, _bytes_needed(parts, opt_state), self.known)
        checkpoint_folder.begin(partial)
        try:
            arrays, files = {}, []
            leaves = itertools.chain(_saved_leaves("parts", parts), _saved_leaves("optimizer", opt_state))
            for index, (name, leaf) in enumerate(leaves):
                array = to_host(leaf)
                dtype = str(array.dtype)
                if array.dtype.kind not in "fiub":  # bf16 and the like: numpy keeps their bits, not their type
                    array = array.view(f"u{array.dtype.itemsize}")
                file = f"array-{index:05d}.npy"
                _write_array(partial / file, array)
                del array
                arrays[name] = {"file": file, "dtype": dtype}
                files.append(checkpoint_folder.describe(partial / file))
            manifest = {"framework": FRAMEWORK, "card": self.card_name, "step": step, "devices": devices,
                        "rows_a_step": self.rows_a_step, "rows_consumed": rows_consumed, "extents": self.extents,
                        "arrays": arrays, "model": self.description, "steps": self.steps,
                        "row_length": self.row_length, "optimizer_settings": self.optimizer_settings,
                        "hyperparameters": self._asked_hyperparameters(opt_state)}
            saved = checkpoint_folder.commit(self.folder, partial, manifest, files, keep=self.keep, known=self.known)
        except Exception:  # what the save wrote takes no room
            checkpoint_folder.discard(partial)
            raise
        self.saved_step = step
        return saved

    def _asked_hyperparameters(self, opt_state) -> dict[str, float]:
        """The injected settings this run asked for: as they were before any step (a schedule's first value)."""
        return self.hyperparameters if self.hyperparameters is not None else _hyperparameters(opt_state)

    def resume(self, parts, opt_state):
        """(step, parts, opt_state) from the newest complete checkpoint; (0, parts, opt_state) if none."""
        self.hyperparameters = _hyperparameters(opt_state)  # fresh: what this run asked for
        folder = checkpoint_folder.latest(self.folder, self.known)
        if folder is None:
            return 0, parts, opt_state
        manifest = checkpoint_folder.read_manifest(folder)
        resume_check.check_framework(manifest, FRAMEWORK, folder)
        self._check_same_model(folder, manifest, parts)
        self._check_same_optimizer_state(folder, manifest, opt_state)
        notes = self._differences(manifest)
        parts = self._restore("parts", parts, manifest, folder)
        opt_state = self._restore("optimizer", opt_state, manifest, folder)
        self.manifest = manifest
        now = f", now {self.devices}" if self.devices is not None else ""
        resume_check.print_resumed(f"resuming from {folder} (step {manifest['step']}, saved on "
                                   f"{manifest['devices']} devices{now})", notes)
        self.saved_step = manifest["step"]
        return manifest["step"], parts, opt_state

    def _check_same_model(self, folder: Path, manifest: dict, parts) -> None:
        """Refuses a checkpoint of another card, or of other shapes (a layer more or less), naming each difference."""
        differences = []
        if manifest["card"] != self.card_name:
            differences.append(f"card: {manifest['card']} in the checkpoint, {self.card_name} in this run")
        if manifest.get("model") is not None and self.description is not None:
            differences += resume_check.model_differences(manifest["model"], self.description)
        else:  # a manifest from before the shapes were recorded: the counts show in the parts' names
            saved, mine = group_counts(manifest["arrays"]), group_counts(_named_leaves("parts", parts))
            differences += _count_differences(saved, mine)
        if not differences:
            for group in sorted(manifest["extents"].keys() | self.extents.keys()):
                saved, mine = manifest["extents"].get(group), self.extents.get(group)
                if saved != mine:
                    differences.append(f"group {group}: {saved} elements in the checkpoint, {mine} in this run")
        if not differences:
            differences += _name_differences("parts", manifest["arrays"], _named_leaves("parts", parts))
        if differences:
            raise ValueError(resume_check.does_not_fit(folder, self.card_name, differences))

    @staticmethod
    def _check_same_optimizer_state(folder: Path, manifest: dict, opt_state) -> None:
        differences = _name_differences("optimizer", manifest["arrays"], _named_leaves("optimizer", opt_state))
        if differences:
            raise ValueError(f"checkpoint {folder} was written with another optimizer (its state holds other "
                             f"arrays): {'; '.join(differences)}. Resume with the checkpoint's optimizer, or point "
                             f"checkpoint= at another folder")

    def _differences(self, manifest: dict) -> list[str]:
        """The settings in which this run differs from the checkpoint's, as notes: this run follows its own."""
        notes = []
        for what, saved, mine in [("rows a step", manifest["rows_a_step"], self.rows_a_step),
                                  ("steps", manifest.get("steps"), self.steps),
                                  ("row length", manifest.get("row_length"), self.row_length)]:
            if saved is not None and mine is not None and saved != mine:
                notes.append(f"{what}: {saved} in the checkpoint, {mine} in this run")
        for name, saved, mine in _setting_differences(manifest.get("hyperparameters"), self.hyperparameters):
            notes.append(f"{_short_hyperparameter(name)}: {resume_check.show(saved)} in the checkpoint, "
                         f"{resume_check.show(mine)} in this run")
        for name, saved, mine in _setting_differences(manifest.get("optimizer_settings"), self.optimizer_settings):
            gloss = " (minus the learning rate)" if name.split(".")[-1] == "step_size" else ""
            notes.append(f"optax's {name}{gloss}: {resume_check.show(saved)} in the checkpoint, "
                         f"{resume_check.show(mine)} in this run")
        return notes

    def _restore(self, prefix: str, tree, manifest: dict, folder: Path):
        paths, structure = jax.tree_util.tree_flatten_with_path(tree)
        names = [prefix + jax.tree_util.keystr(path) for path, _ in paths]
        # Every array checked before any is placed: a checkpoint that does not fit leaves the run as it was.
        saved = [None if _is_hyperparameter(name) else self._saved(name, fresh, manifest, folder)
                 for name, (_, fresh) in zip(names, paths)]
        leaves = []
        for (_, fresh), array in zip(paths, saved):
            if array is None:  # this run's setting, kept
                leaves.append(fresh)
                continue
            leaves.append(from_host(array(), fresh.sharding))
            fresh.delete()  # the fresh state goes as the saved one arrives: never two copies on a device
        return jax.tree_util.tree_unflatten(structure, leaves)

    @staticmethod
    def _saved(name: str, fresh, manifest: dict, folder: Path):
        """A function that reads the saved array for `fresh`, shaped as it is; raises now if there is none."""
        entry = manifest["arrays"][name]  # every name was checked to be there
        mapped = np.load(folder / entry["file"], mmap_mode="r").view(jnp.dtype(entry["dtype"]))
        if mapped.dtype != fresh.dtype:
            raise ValueError(f"checkpoint {folder}: {name} is {mapped.dtype}, this run's optimizer keeps {fresh.dtype}")
        if mapped.shape == fresh.shape:
            return lambda: np.array(mapped)
        _repad(mapped, fresh.shape, name, folder)  # checked now, cut again when placed
        return lambda: _repad(mapped, fresh.shape, name, folder)


def _write_array(path: Path, array: np.ndarray) -> None:
    """np.save through a Python file, a full or read-only disk said plainly (numpy's own words are
    "49152 requested and 35808 written")."""
    with storage_errors(path, "write", array.nbytes + NPY_HEADER), open(path, "wb") as f:
        np.save(f, array)


def _bytes_needed(parts, opt_state) -> int:
    """The bytes one checkpoint takes: every array whole, and its .npy header."""
    leaves = jax.tree_util.tree_leaves((parts, opt_state))
    return sum(leaf.nbytes + NPY_HEADER for leaf in leaves) + checkpoint_folder.HEADROOM


def _hyperparameters(opt_state) -> dict[str, float]:
    """The settings optax.inject_hyperparams keeps in the state, by name."""
    return {name: float(np.asarray(leaf)) for name, leaf in _named_leaves("optimizer", opt_state).items()
            if _is_hyperparameter(name) and np.size(leaf) == 1}


def _short_hyperparameter(name: str) -> str:
    """`optimizer[1].hyperparams['learning_rate']` -> `learning_rate`."""
    match = re.search(r"\.hyperparams\['([^']+)'\]$", name)
    return match.group(1) if match else name


def _setting_differences(saved: dict | None, mine: dict | None) -> list[tuple[str, object, object]]:
    if not saved or not mine:  # not recorded (an older checkpoint), or nothing to compare
        return []
    return [(name, saved[name], mine[name]) for name in sorted(saved.keys() & mine.keys()) if saved[name] != mine[name]]


_GROUP_ITEM = re.compile(r"^parts\['([^']+)'\](?:\[(\d+)\])?$")


def group_counts(names) -> dict[str, int]:
    """How many of each group parts hold, from their names (`parts['layers'][2]`: at least 3 layers)."""
    counts: dict[str, int] = {}
    for name in names:
        match = _GROUP_ITEM.match(name)
        if match:
            group, index = match.group(1), match.group(2)
            counts[group] = max(counts.get(group, 0), 1 if index is None else int(index) + 1)
    return counts


def _count_differences(saved: dict[str, int], mine: dict[str, int]) -> list[str]:
    differences = []
    for group in sorted(saved.keys() | mine.keys()):
        if saved.get(group) != mine.get(group):
            differences.append(f"number of {group}: {saved.get(group, 0)} in the checkpoint, {mine.get(group, 0)} "
                               f"in this run")
    return differences


def _name_differences(prefix: str, saved: dict, mine: dict) -> list[str]:
    """The arrays under `prefix` that only the checkpoint, or only this run, holds (a few of each, named)."""
    saved_names = {n for n in saved if n.startswith(prefix)}
    differences = []
    for where, names in [("the checkpoint", saved_names - mine.keys()), ("this run", mine.keys() - saved_names)]:
        if names:
            listed = ", ".join(sorted(names)[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            differences.append(f"only in {where}: {listed}")
    return differences


def optimizer_settings(optimizer) -> dict[str, float]:
    """The numbers an optax optimizer was built with (b1, eps, weight_decay, step_size: minus the learning
    rate, a schedule's values), by name, read from the closures of its update function: optax keeps them
    there and not in its state, so a checkpoint records them for a resumed run to say which of its settings
    changed. Best effort: the names are optax's own (a name two settings share, with other values, is
    given with its place), and what cannot be read is left out."""
    found: dict[str, float] = {}
    try:
        _closure_numbers(optimizer.update, "", found, set(), 0)
    except Exception:  # noqa: BLE001  (an optimizer this cannot read is compared on nothing)
        return {}
    by_name: dict[str, set] = {}
    for path, value in found.items():
        by_name.setdefault(path.split(".")[-1], set()).add(value)
    return {(path.split(".")[-1] if len(by_name[path.split(".")[-1]]) == 1 else path): value
            for path, value in found.items()}


def _closure_numbers(value, path: str, found: dict, seen: set, depth: int) -> None:
    if id(value) in seen or depth > 24:
        return
    seen.add(id(value))
    if isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _closure_numbers(item, f"{path}[{index}]", found, seen, depth + 1)
    elif isinstance(value, functools.partial):
        _closure_numbers(value.func, path, found, seen, depth + 1)
        _closure_numbers(value.args, f"{path}.args", found, seen, depth + 1)
    elif isinstance(value, types.FunctionType) and value.__closure__:
        for name, cell in zip(value.__code__.co_freevars, value.__closure__):
            try:
                content = cell.cell_contents
            except ValueError:  # a cell not filled yet
                continue
            where = f"{path}.{name}".lstrip(".")
            if isinstance(content, numbers.Real) and not isinstance(content, bool):
                found[where] = int(content) if isinstance(content, numbers.Integral) else float(content)
            elif callable(content) or isinstance(content, (tuple, list)):
                _closure_numbers(content, where, found, seen, depth + 1)


def _repad(array: np.ndarray, shape: tuple, name: str, folder: Path) -> np.ndarray:
    """A flat array saved over another number of devices, cut or zero-padded to this split's length."""
    if array.ndim != 1 or len(shape) != 1:
        raise ValueError(f"checkpoint {folder}: {name} has shape {array.shape}, this run expects {shape}")
    out = np.zeros(shape, array.dtype)
    keep = min(array.shape[0], shape[0])
    if np.any(array[keep:]):
        raise ValueError(f"checkpoint {folder}: {name} holds {array.shape[0]} values, more than the {shape[0]} "
                         f"this run's layout has room for")
    out[:keep] = array[:keep]
    return out
