"""A checkpoint as a folder that becomes visible only when complete, for
either framework's training loop (linnet/checkpoint.py for PyTorch,
linnet/jax/checkpoint.py for JAX).

`step-00000010.partial/` is filled with the state files, each synced; then
`MANIFEST.json` (the run's facts and each file's size and SHA-256) is written
and synced last, and the folder renamed to `step-00000010/`. A crash at any
moment leaves either a `.partial` folder or a complete checkpoint. `latest`
takes the newest folder whose manifest and files check out and passes over
any other with a warning naming it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

MANIFEST = "MANIFEST.json"
FORMAT = 1


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_path(folder: Path, step: int) -> Path:
    """Where the checkpoint of `step` is written until it is complete."""
    return folder / f"{step_name(step)}.partial"


def begin(partial: Path) -> None:
    """Makes `partial` a fresh, empty folder (one process calls it), whatever an earlier crash left there."""
    if partial.exists():
        shutil.rmtree(partial)
    created = not partial.parent.exists()
    partial.mkdir(parents=True)
    _fsync_dir(partial.parent)
    if created:
        _fsync_dir(partial.parent.parent)


def describe(path: Path) -> tuple[str, int, str]:
    """Syncs a state file written into a `.partial` folder; (name, bytes, SHA-256) for the manifest."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return path.name, path.stat().st_size, sha256(path)


def commit(folder: Path, partial: Path, manifest: dict, files: list[tuple[str, int, str]], *, keep: int,
           default=None) -> Path:
    """Writes the manifest last, renames the `.partial` folder into place, keeps the newest `keep`."""
    manifest = {"format": FORMAT, **manifest, "files": {name: {"bytes": size, "sha256": digest}
                                                        for name, size, digest in files}}
    with open(partial / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, default=default)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(partial)
    final = folder / partial.name.removesuffix(".partial")
    if final.exists():  # the same step saved again: the old one goes aside first, never half-deleted in place
        aside = folder / f"{final.name}.old"
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
        os.rename(partial, final)
        shutil.rmtree(aside)
    else:
        os.rename(partial, final)
    _fsync_dir(folder)
    _prune(folder, final, keep)
    return final


def _prune(folder: Path, newest: Path, keep: int) -> None:
    """Keeps `newest` and the complete checkpoints before it, `keep` in all; drops older ones and
    the leftovers of interrupted writes before it. A later or damaged folder is left for a person."""
    complete = [c for c in sorted(folder.glob("step-????????")) if c.name < newest.name and (c / MANIFEST).is_file()]
    for old in complete[: max(0, len(complete) - (keep - 1))]:
        shutil.rmtree(old)
    for leftover in [*folder.glob("step-????????.partial"), *folder.glob("step-????????.old")]:
        if leftover.name[: len(newest.name)] < newest.name:
            shutil.rmtree(leftover)


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint in `folder`, warning about each one passed over."""
    if not folder.exists():
        return None
    for partial in sorted(folder.glob("*.partial")):
        warnings.warn(f"linnet: passing over {partial}: an unfinished checkpoint (its write was interrupted)")
    for candidate in sorted(folder.glob("step-????????"), reverse=True):
        problem = find_problem(candidate)
        if problem is None:
            return candidate
        warnings.warn(f"linnet: passing over checkpoint {candidate}: {problem}")
    return None


def read_manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / MANIFEST).read_text())


def check_framework(manifest: dict, framework: str, checkpoint: Path) -> None:
    """Raises unless the checkpoint was written by a run of `framework` ("torch" or "jax")."""
    found = manifest.get("framework", "torch")  # the first PyTorch checkpoints did not say
    if found != framework:
        names = {"torch": "PyTorch", "jax": "JAX"}
        raise ValueError(f"checkpoint {checkpoint} was written by a {names.get(found, found)} run; a "
                         f"{names[framework]} run resumes only from its own: point checkpoint= at another folder")


def find_problem(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint folder, or None."""
    manifest_path = checkpoint / MANIFEST
    if not manifest_path.exists():
        return f"no {MANIFEST} (incomplete)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return f"{MANIFEST} is unreadable ({error})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{MANIFEST} is not format {FORMAT}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(e, dict) and {"bytes", "sha256"} <= e.keys()
                                              for e in files.values()):
        return f"{MANIFEST} lists its files wrongly (expected name -> bytes and sha256)"
    for name, expected in files.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)"
        if sha256(path) != expected["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (corrupt)"
    return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
