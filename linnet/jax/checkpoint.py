"""Checkpoints of a JAX training run (linnet.jax.train), crash-safe as the
PyTorch ones: linnet/checkpoint_folder.py writes the folder aside and makes it
visible with its manifest, last.

One process drives every device, so a checkpoint is one file, `state.npz`:
each part and each optimizer-state array, gathered to the host, under its
path in its pytree (`parts['layers'][3]`, `optimizer[0].mu['layers'][3]`).
The manifest holds the card, the step, the number of devices, the rows used
and each group's extent. Resuming on another number of devices re-pads each
flat array: the content up to its group's extent is the same whatever the
split, and the padding after it stays zero (its gradient is zero, so AdamW
leaves it there). Training draws no random numbers, so there is no RNG state
to keep."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from linnet import checkpoint_folder

STATE = "state.npz"
FRAMEWORK = "jax"


def _named_leaves(prefix: str, tree) -> dict[str, jax.Array]:
    return {prefix + jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class JaxCheckpointer:
    def __init__(self, folder, card_name: str, extents: dict[str, int], keep: int = 2):
        self.folder, self.card_name, self.extents, self.keep = Path(folder), card_name, extents, keep
        self.manifest: dict | None = None

    def save(self, step: int, parts, opt_state, *, rows_consumed: int, devices: int) -> Path:
        partial = checkpoint_folder.partial_path(self.folder, step)
        checkpoint_folder.begin(partial)
        arrays = {name: np.asarray(jax.device_get(leaf))
                  for name, leaf in {**_named_leaves("parts", parts), **_named_leaves("optimizer", opt_state)}.items()}
        odd = [name for name, array in arrays.items() if array.dtype.kind not in "fiub"]
        if odd:
            raise TypeError(f"cannot checkpoint {odd[0]} of dtype {arrays[odd[0]].dtype}: expected numbers")
        with open(partial / STATE, "wb") as f:
            np.savez(f, **arrays)
        manifest = {"framework": FRAMEWORK, "card": self.card_name, "step": step, "devices": devices,
                    "rows_consumed": rows_consumed, "extents": self.extents}
        return checkpoint_folder.commit(self.folder, partial, manifest, [checkpoint_folder.describe(partial / STATE)],
                                        keep=self.keep)

    def resume(self, parts, opt_state):
        """(step, parts, opt_state) from the newest complete checkpoint; (0, parts, opt_state) if none."""
        folder = checkpoint_folder.latest(self.folder)
        if folder is None:
            return 0, parts, opt_state
        manifest = checkpoint_folder.read_manifest(folder)
        if manifest.get("framework") != FRAMEWORK:
            raise ValueError(f"checkpoint {folder} was written by a PyTorch run; a JAX run resumes only from its own: "
                             f"point checkpoint= at another folder")
        if manifest["card"] != self.card_name or manifest["extents"] != self.extents:
            raise ValueError(f"checkpoint {folder} holds a run of {manifest['card']} with other weights; this run is "
                             f"{self.card_name}: point checkpoint= at another folder")
        with np.load(folder / STATE) as saved:
            parts = self._restore("parts", parts, saved, folder)
            opt_state = self._restore("optimizer", opt_state, saved, folder)
        self.manifest = manifest
        print(f"linnet: resuming from {folder} (step {manifest['step']}, saved on {manifest['devices']} devices)",
              flush=True)
        return manifest["step"], parts, opt_state

    def _restore(self, prefix: str, tree, saved, folder: Path):
        paths, structure = jax.tree_util.tree_flatten_with_path(tree)
        leaves = []
        for path, fresh in paths:
            name = prefix + jax.tree_util.keystr(path)
            if name not in saved:
                raise ValueError(f"checkpoint {folder} has no {name}: it was written with another optimizer")
            array = saved[name]
            if array.shape != fresh.shape:
                array = _repad(array, fresh.shape, name, folder)
            leaves.append(jax.device_put(array.astype(fresh.dtype), fresh.sharding))
        return jax.tree_util.tree_unflatten(structure, leaves)


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
