"""Checkpoints of a JAX training run (linnet.jax.train), crash-safe as the
PyTorch ones: linnet/checkpoint_folder.py writes the folder aside and makes it
visible with its manifest, last.

One process drives every device. A checkpoint holds one `.npy` file an
array: each part and each optimizer-state array, gathered to the host one at
a time (so the host never holds more than the largest), listed in the
manifest under its path in its pytree (`parts['layers'][3]`,
`optimizer[0].mu['layers'][3]`) with its dtype (bf16 is stored as its bits).
The manifest also holds the card, the step, the number of devices, the rows
used and each group's extent. Resuming on another number of devices re-pads
each flat array: the content up to its group's extent is the same whatever
the split, and the padding after it stays zero (its gradient is zero, so
AdamW leaves it there). Training draws no random numbers, so there is no RNG
state to keep."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linnet import checkpoint_folder

FRAMEWORK = "jax"


def _named_leaves(prefix: str, tree) -> dict[str, jax.Array]:
    return {prefix + jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class JaxCheckpointer:
    def __init__(self, folder, card_name: str, extents: dict[str, int], rows_a_step: int, keep: int = 2):
        self.folder, self.card_name, self.extents, self.keep = Path(folder), card_name, extents, keep
        self.rows_a_step = rows_a_step
        self.manifest: dict | None = None

    def save(self, step: int, parts, opt_state, *, rows_consumed: int, devices: int) -> Path:
        partial = checkpoint_folder.partial_path(self.folder, step)
        checkpoint_folder.begin(partial)
        arrays, files = {}, []
        leaves = {**_named_leaves("parts", parts), **_named_leaves("optimizer", opt_state)}
        for index, (name, leaf) in enumerate(leaves.items()):
            array = np.asarray(jax.device_get(leaf))
            dtype = str(array.dtype)
            if array.dtype.kind not in "fiub":  # bf16 and the like: numpy keeps their bits, not their type
                array = array.view(f"u{array.dtype.itemsize}")
            file = f"array-{index:05d}.npy"
            np.save(partial / file, array)
            del array
            arrays[name] = {"file": file, "dtype": dtype}
            files.append(checkpoint_folder.describe(partial / file))
        manifest = {"framework": FRAMEWORK, "card": self.card_name, "step": step, "devices": devices,
                    "rows_a_step": self.rows_a_step, "rows_consumed": rows_consumed, "extents": self.extents,
                    "arrays": arrays}
        return checkpoint_folder.commit(self.folder, partial, manifest, files, keep=self.keep)

    def resume(self, parts, opt_state):
        """(step, parts, opt_state) from the newest complete checkpoint; (0, parts, opt_state) if none."""
        folder = checkpoint_folder.latest(self.folder)
        if folder is None:
            return 0, parts, opt_state
        manifest = checkpoint_folder.read_manifest(folder)
        checkpoint_folder.check_framework(manifest, FRAMEWORK, folder)
        if manifest["card"] != self.card_name:
            raise ValueError(f"checkpoint {folder} holds a run of {manifest['card']}, this run is {self.card_name}: "
                             f"point checkpoint= at another folder")
        differ = [g for g in self.extents if manifest["extents"].get(g) != self.extents[g]]
        if differ or manifest["extents"].keys() != self.extents.keys():
            group = differ[0] if differ else min(manifest["extents"].keys() ^ self.extents.keys())
            raise ValueError(f"checkpoint {folder} holds group {group} with {manifest['extents'].get(group)} elements, "
                             f"this run's has {self.extents.get(group)}: another card configuration")
        if manifest["rows_a_step"] != self.rows_a_step:
            warnings.warn(f"linnet: checkpoint {folder} took {manifest['rows_a_step']} rows a step; this run takes "
                          f"{self.rows_a_step}: the global batch changes from here on")
        parts = self._restore("parts", parts, manifest, folder)
        opt_state = self._restore("optimizer", opt_state, manifest, folder)
        self.manifest = manifest
        print(f"linnet: resuming from {folder} (step {manifest['step']}, saved on {manifest['devices']} devices)",
              flush=True)
        return manifest["step"], parts, opt_state

    def _restore(self, prefix: str, tree, manifest: dict, folder: Path):
        paths, structure = jax.tree_util.tree_flatten_with_path(tree)
        saved = [self._saved(prefix + jax.tree_util.keystr(path), fresh, manifest, folder) for path, fresh in paths]
        # Every array checked before any is placed: a checkpoint that does not fit leaves the run as it was.
        leaves = []
        for (_, fresh), array in zip(paths, saved):
            leaves.append(jax.device_put(array(), fresh.sharding))
            fresh.delete()  # the fresh state goes as the saved one arrives: never two copies on a device
        return jax.tree_util.tree_unflatten(structure, leaves)

    @staticmethod
    def _saved(name: str, fresh, manifest: dict, folder: Path):
        """A function that reads the saved array for `fresh`, shaped as it is; raises now if there is none."""
        entry = manifest["arrays"].get(name)
        if entry is None:
            raise ValueError(f"checkpoint {folder} has no {name}: it was written with another optimizer")
        mapped = np.load(folder / entry["file"], mmap_mode="r").view(jnp.dtype(entry["dtype"]))
        if mapped.dtype != fresh.dtype:
            raise ValueError(f"checkpoint {folder}: {name} is {mapped.dtype}, this run's optimizer keeps {fresh.dtype}")
        if mapped.shape == fresh.shape:
            return lambda: np.array(mapped)
        _repad(mapped, fresh.shape, name, folder)  # checked now, cut again when placed
        return lambda: _repad(mapped, fresh.shape, name, folder)


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
