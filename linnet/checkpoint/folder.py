"""A checkpoint as a folder that becomes visible only when complete, for
either framework's training loop (linnet/torch/checkpoint.py for PyTorch,
linnet/jax/checkpoint.py for JAX).

`step-00000010.partial/` is filled with the state files, each synced; then
`MANIFEST.json` (the run's facts and each file's size and SHA-256) is written
and synced last, and the folder renamed to `step-00000010/`. A crash at any
moment leaves either a `.partial` folder or a complete checkpoint; a pruned
checkpoint is renamed to `.deleting` before it is deleted, and one saved again
goes to `.old` until the new one is in place (where a crash leaves it, it is
still found). `latest`
takes the newest folder whose manifest and files check out and passes over
any other with a warning naming it; when every checkpoint is damaged it
stops the run, naming each one and its problem, rather than start over on
top of them.

A damaged checkpoint is never deleted or overwritten: pruning passes over
it, and a new checkpoint of its step moves it aside to `step-N.damaged`,
for a person to look at.

`check_room` says before the first step whether the disk can hold one more
checkpoint; `make_room` deletes the oldest checkpoints (never the newest
good one) before a save that would not fit. Around them: linnet/checkpoint/lock.py
holds the folder for one run, linnet/checkpoint/storage.py checks that it is a writable
directory and names a full or read-only disk (StorageError), and
linnet/checkpoint/resume_check.py compares a checkpoint with the run that resumes it."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

from linnet.errors import UserError
from linnet.checkpoint.storage import StorageError, free_space, fsync_dir, gb, storage_errors, total_size, write_synced

MANIFEST = "MANIFEST.json"
FORMAT = 1
HEADROOM = 1 << 20  # bytes a checkpoint takes beyond its tensors: the manifest, pickle's and .npy's framing


class DamagedCheckpoints(RuntimeError, UserError):
    """Every checkpoint in the folder is damaged: the run can neither resume nor start over on top of them."""


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
    with storage_errors(partial, "create"):
        partial.mkdir(parents=True)
    fsync_dir(partial.parent)
    if created:
        fsync_dir(partial.parent.parent)


def discard(partial: Path) -> None:
    """Removes what a failed save wrote, so that it takes no room (a crash leaves it to the next save)."""
    shutil.rmtree(partial, ignore_errors=True)


def describe(path: Path) -> tuple[str, int, str]:
    """Syncs a state file written into a `.partial` folder; (name, bytes, SHA-256) for the manifest."""
    with storage_errors(path, "sync"), open(path, "rb+") as f:
        os.fsync(f.fileno())  # where a file system that allocates late finds it has no room
    return path.name, path.stat().st_size, sha256(path)


def commit(folder: Path, partial: Path, manifest: dict, files: list[tuple[str, int, str]], *, keep: int,
           default=None, known: dict[str, str | None] | None = None) -> Path:
    """Writes the manifest last, renames the `.partial` folder into place, keeps the newest `keep`.

    known: what the caller already knows of the folder's checkpoints (name -> problem, None for a good one),
    kept up to date here, so that a run checks each checkpoint it did not write once, not at every save."""
    manifest = {"format": FORMAT, **manifest, "files": {name: {"bytes": size, "sha256": digest}
                                                        for name, size, digest in files}}
    with storage_errors(partial / MANIFEST, "write"):
        write_synced(partial / MANIFEST, json.dumps(manifest, indent=1, default=default))
    fsync_dir(partial)
    final = folder / partial.name.removesuffix(".partial")
    if final.exists() and _problem_of(final, known) is not None:
        _set_aside(final, _problem_of(final, known))
    if final.exists():  # the same step saved again: the old one goes aside first, never half-deleted in place
        aside = folder / f"{final.name}.old"
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
        os.rename(partial, final)
        shutil.rmtree(aside)
    else:
        os.rename(partial, final)
    if known is not None:
        known[final.name] = None  # its files were hashed as they were written
    fsync_dir(folder)
    _prune(folder, final, keep, known)
    return final


def _set_aside(checkpoint: Path, problem: str) -> Path:
    """Moves a damaged checkpoint out of the way of a new one of its step, to `step-N.damaged` (or
    `.damaged-2`, ...), where nothing of linnet's deletes it."""
    target, copy = checkpoint.with_name(f"{checkpoint.name}.damaged"), 2
    while target.exists():
        target, copy = checkpoint.with_name(f"{checkpoint.name}.damaged-{copy}"), copy + 1
    os.rename(checkpoint, target)
    warnings.warn(f"linnet: moved damaged checkpoint {checkpoint} ({problem}) to {target}, to save its step "
                  f"again; it stays there for a person to look at")
    return target


def _prune(folder: Path, newest: Path, keep: int, known: dict[str, str | None] | None) -> None:
    """Keeps `newest` and the good checkpoints before it, `keep` in all; drops older good ones and the
    leftovers of interrupted writes before it. A later or damaged folder is left for a person (damaged
    ones are checked in full first: a corrupt checkpoint is evidence, and is never deleted silently)."""
    kept = 1
    for older in _checkpoints(folder):
        if older.name >= newest.name:
            continue
        problem = _problem_of(older, known)
        if problem is not None:
            warnings.warn(f"linnet: leaving damaged checkpoint {older} in place ({problem}): it is neither "
                          f"counted nor deleted")
        elif kept < keep:
            kept += 1
        else:
            _remove(older, known)
    for leftover in _leftovers(folder):
        if leftover.name[: len(newest.name)] < newest.name:
            shutil.rmtree(leftover)


def _checkpoints(folder: Path) -> list[Path]:
    """The checkpoints, newest first: each `step-N`, and a `step-N.old` whose `step-N` is missing. That is
    the complete checkpoint of a step being saved again, moved aside just before the new one would have
    taken its name, when the save stopped there (commit)."""
    plain = list(folder.glob("step-????????"))
    orphans = [old for old in folder.glob("step-????????.old") if not old.with_suffix("").exists()]
    return sorted(plain + orphans, key=lambda path: path.name, reverse=True)


def _leftovers(folder: Path) -> list[Path]:
    """Folders of interrupted writes and deletions: never checkpoints, and no other run writes here while this
    one holds it."""
    orphans = set(_checkpoints(folder))
    return sorted([*folder.glob("step-????????.partial"), *folder.glob("step-????????*.deleting"),
                   *(old for old in folder.glob("step-????????.old") if old not in orphans)])


def _remove(checkpoint: Path, known: dict[str, str | None] | None) -> None:
    """Renamed first, so that a deletion cut short leaves a leftover that the next save sweeps away, not a
    damaged checkpoint (which nothing deletes)."""
    doomed = checkpoint.with_name(f"{checkpoint.name}.deleting")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(checkpoint, doomed)
    if known is not None:
        known.pop(checkpoint.name, None)
    shutil.rmtree(doomed)


def latest(folder: Path, known: dict[str, str | None] | None = None) -> Path | None:
    """The newest complete checkpoint in `folder`, warning about each one passed over; None if it holds none.
    Raises DamagedCheckpoints, naming each and its problem, when it holds checkpoints and all are damaged:
    starting over would overwrite and prune them."""
    if not folder.exists():
        return None
    passed_over = []
    for candidate in _checkpoints(folder):
        problem = _problem_of(candidate, known)
        if problem is None:
            for partial in sorted(folder.glob("*.partial")):
                warnings.warn(f"linnet: passing over {partial}: an unfinished checkpoint (its write was interrupted)")
            for damaged, why in passed_over:
                warnings.warn(f"linnet: passing over checkpoint {damaged}: {why}")
            return candidate
        passed_over.append((candidate, problem))
    if passed_over:
        listed = "".join(f"\n  {damaged.name}: {why}" for damaged, why in passed_over)
        raise DamagedCheckpoints(f"every checkpoint in {folder} is damaged, so this run can neither resume nor "
                                 f"start over (that would overwrite and prune them):{listed}\nNothing was changed. "
                                 f"Move them elsewhere to look at them, or point checkpoint= at another folder.")
    for partial in sorted(folder.glob("*.partial")):
        warnings.warn(f"linnet: passing over {partial}: an unfinished checkpoint (its write was interrupted)")
    return None


def _problem_of(checkpoint: Path, known: dict[str, str | None] | None) -> str | None:
    """find_problem, once a checkpoint where the caller keeps what it found (`known`)."""
    if known is None:
        return find_problem(checkpoint)
    if checkpoint.name not in known:
        known[checkpoint.name] = find_problem(checkpoint)
    return known[checkpoint.name]


def read_manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / MANIFEST).read_text())


def newest_manifest(folder: Path) -> dict | None:
    """The manifest of the newest checkpoint in `folder` whose manifest reads, its files unchecked: cheap, for
    planning a run (how many rows it resumes past), not for resuming it (`latest`). None where there is none."""
    for checkpoint in _checkpoints(Path(folder)) if Path(folder).is_dir() else []:
        try:
            return read_manifest(checkpoint)
        except (OSError, ValueError):
            continue
    return None


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


# Room for the next checkpoint.

def _removable(folder: Path, known: dict[str, str | None] | None) -> list[Path]:
    """What make_room may delete, first to last: leftovers of interrupted writes, then the good checkpoints,
    oldest first, all but the newest. A damaged checkpoint is never among them."""
    good = [c for c in reversed(_checkpoints(folder)) if _problem_of(c, known) is None]
    return _leftovers(folder) + good[:-1]


def check_room(folder: Path, needed: int, known: dict[str, str | None] | None = None) -> None:
    """Before the first step: raises StorageError unless the disk can hold a checkpoint of `needed` bytes,
    counting what make_room could delete for it."""
    free = free_space(folder)
    if free < needed:
        removable = sum(total_size(p) for p in _removable(folder, known))
        if free + removable < needed:
            raise _no_room(folder, needed, free, removable)


def make_room(folder: Path, needed: int, known: dict[str, str | None] | None = None) -> None:
    """Before a save: where the disk cannot hold a checkpoint of `needed` bytes besides those there, deletes
    leftovers and the oldest good checkpoints until it can (never the newest good one: a run always has one
    to resume), so that keeping two does not need room for three. Raises StorageError, deleting nothing,
    when even that would not make room."""
    free = free_space(folder)
    if free >= needed:
        return
    removable = _removable(folder, known)
    if free + sum(total_size(p) for p in removable) < needed:
        raise _no_room(folder, needed, free, sum(total_size(p) for p in removable))
    for path in removable:
        print(f"linnet: removing {path} to make room for the next checkpoint ({gb(needed)} needed, "
              f"{gb(free)} free)", flush=True)
        _remove(path, known)
        free = free_space(folder)
        if free >= needed:
            break
    fsync_dir(folder)
    if free < needed:
        raise _no_room(folder, needed, free, 0)


def _no_room(folder: Path, needed: int, free: int, removable: int) -> StorageError:
    could_go = f" (and {gb(removable)} in older checkpoints that could go)" if removable else ""
    return StorageError(errno.ENOSPC, f"no space left on device for checkpoints in {folder}: a checkpoint needs "
                                      f"{gb(needed)}, {gb(free)} free{could_go}. Free some space, or point "
                                      f"checkpoint= at another disk")
