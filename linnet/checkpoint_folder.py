"""A checkpoint as a folder that becomes visible only when complete, for
either framework's training loop (linnet/checkpoint.py for PyTorch,
linnet/jax/checkpoint.py for JAX).

`step-00000010.partial/` is filled with the state files, each synced; then
`MANIFEST.json` (the run's facts and each file's size and SHA-256) is written
and synced last, and the folder renamed to `step-00000010/`. A crash at any
moment leaves either a `.partial` folder or a complete checkpoint. `latest`
takes the newest folder whose manifest and files check out and passes over
any other with a warning naming it; when every checkpoint is damaged it
stops the run, naming each one and its problem, rather than start over on
top of them.

A damaged checkpoint is never deleted or overwritten: pruning passes over
it, and a new checkpoint of its step moves it aside to `step-N.damaged`,
for a person to look at.

A folder belongs to one run at a time: `take` checks, before the first
step, that the folder is a directory this process can write into, and
takes its `LOCK` file (see `FolderLock`). `check_room` says before the
first step whether the disk can hold one more checkpoint; `make_room`
deletes the oldest checkpoints (never the newest good one) before a save
that would not fit. A write that fails for a full or read-only disk raises
`StorageError` naming the path and the cause, not the writer's byte counts."""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import shutil
import socket
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: the lock file's record alone says who holds a folder
    fcntl = None

MANIFEST = "MANIFEST.json"
LOCK = "LOCK"
FORMAT = 1
HEADROOM = 1 << 20  # bytes a checkpoint takes beyond its tensors: the manifest, pickle's and .npy's framing


class FolderInUse(RuntimeError):
    """Another run, still alive, holds the checkpoint folder."""


class DamagedCheckpoints(RuntimeError):
    """Every checkpoint in the folder is damaged: the run can neither resume nor start over on top of them."""


class StorageError(OSError):
    """The checkpoint folder's storage cannot take a checkpoint: its errno says why (ENOTDIR, EROFS, EACCES,
    ENOSPC), its message names the path and what to do."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.errno = code

    def __reduce__(self):  # crosses processes (the ranks' agreement) with its errno
        return type(self), (self.errno, str(self))


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
    _fsync_dir(partial.parent)
    if created:
        _fsync_dir(partial.parent.parent)


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
    with storage_errors(partial / MANIFEST, "write"), open(partial / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, default=default)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(partial)
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
    _fsync_dir(folder)
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
    for older in sorted(folder.glob("step-????????"), reverse=True):
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


def _leftovers(folder: Path) -> list[Path]:
    """Folders of interrupted writes: never checkpoints, and no other run writes here while this one holds it."""
    return sorted([*folder.glob("step-????????.partial"), *folder.glob("step-????????.old")])


def _remove(checkpoint: Path, known: dict[str, str | None] | None) -> None:
    shutil.rmtree(checkpoint)
    if known is not None:
        known.pop(checkpoint.name, None)


def latest(folder: Path, known: dict[str, str | None] | None = None) -> Path | None:
    """The newest complete checkpoint in `folder`, warning about each one passed over; None if it holds none.
    Raises DamagedCheckpoints, naming each and its problem, when it holds checkpoints and all are damaged:
    starting over would overwrite and prune them."""
    if not folder.exists():
        return None
    passed_over = []
    for candidate in sorted(folder.glob("step-????????"), reverse=True):
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


# What the model was: a resumed run compares it with its own.

def model_description(checked) -> dict:
    """Each group of the card (by its key in the parameters: "layers") with its count and its weights'
    shapes: what a checkpoint must match to be resumed, whatever the sharding."""
    description = {}
    for decl in checked.program.groups.values():
        weights = {w.name: list(checked.weight_shape(w)) for w in decl.weights if not checked.is_tied(w)}
        description[decl.key] = {"count": checked.repeat(decl.name), "weights": weights}
    return description


def model_differences(saved: dict, mine: dict) -> list[str]:
    """Each way two model descriptions differ, as a phrase ("number of layers: 3 in the checkpoint, 2 in this run")."""
    differences = []
    for group in sorted(saved.keys() | mine.keys()):
        if group not in mine or group not in saved:
            where = "the checkpoint" if group in saved else "this run"
            differences.append(f"group {group}: only in {where}")
            continue
        if saved[group]["count"] != mine[group]["count"]:
            differences.append(f"number of {group}: {saved[group]['count']} in the checkpoint, "
                               f"{mine[group]['count']} in this run")
        old, new = saved[group]["weights"], mine[group]["weights"]
        for weight in sorted(old.keys() | new.keys()):
            if old.get(weight) != new.get(weight):
                differences.append(f"{group}.{weight}: shape {_shape(old.get(weight))} in the checkpoint, "
                                   f"{_shape(new.get(weight))} in this run")
    return differences


def _shape(shape: list[int] | None) -> str:
    return "none" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def does_not_fit(checkpoint: Path, card: str, differences: list[str]) -> str:
    """The message that refuses a checkpoint of another model."""
    return (f"checkpoint {checkpoint} does not fit this run of {card}: {'; '.join(differences)}. It was written "
            f"for another model: load the card it was written with, or point checkpoint= at another folder")


def show(value) -> str:
    """A setting as a note shows it: floats short, lists bracketed."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def print_resumed(headline: str, notes: list[str]) -> None:
    """What a resume says: where it resumed from, then each setting that differs from the checkpoint's."""
    print(f"linnet: {headline}", flush=True)
    if notes:
        print("linnet: this run's settings differ from the checkpoint's; it follows its own:", flush=True)
        for note in notes:
            print(f"linnet:   {note}", flush=True)


# The folder: a directory this process can write into, held by one run, with room for a checkpoint.

def take(folder: Path) -> FolderLock:
    """Before the first step: checks that `folder` is a directory (or can be made one) that this process can
    write into, and takes it for this run. Raises StorageError or FolderInUse, naming the folder."""
    _check_directory(folder)
    _check_writable(folder)
    return FolderLock.take(folder)


def _check_directory(folder: Path) -> None:
    if folder.is_dir():
        return
    blocker = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        what = "a file is there" if blocker == folder else f"{blocker} is a file"
        raise StorageError(errno.ENOTDIR, f"checkpoint folder {folder} is not a directory ({what}): point "
                                          f"checkpoint= at a folder")
    with storage_errors(folder, "create"):
        folder.mkdir(parents=True, exist_ok=True)


def _check_writable(folder: Path) -> None:
    """Writes and removes a probe file: what the first save would find out, found out before the first step."""
    with storage_errors(folder, "write into"):
        _write_probe(folder / f".probe-{socket.gethostname()}-{os.getpid()}")


def _write_probe(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"linnet")
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


@contextmanager
def storage_errors(path: Path, doing: str, needed: int | None = None) -> Iterator[None]:
    """Turns a write's failure for a full, read-only or misplaced folder into a StorageError that says so and
    names `path`; any other failure goes on as it was. `needed`: the bytes being written, to tell a full disk
    from a writer that does not say (numpy's "49152 requested and 35808 written")."""
    try:
        yield
    except StorageError:
        raise
    except (OSError, RuntimeError) as error:
        translated = _storage_error(error, path, doing, needed)
        if translated is None:
            raise
        raise translated from error


def _storage_error(error: Exception, path: Path, doing: str, needed: int | None) -> StorageError | None:
    code = getattr(error, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and needed is not None and _free(path) < needed):
        why = " (disk quota exceeded)" if code == errno.EDQUOT else ""
        return StorageError(errno.ENOSPC, f"no space left on device{why}: could not {doing} {path} "
                                          f"({_gb(_free(path))} free): free some space, keep fewer checkpoints, "
                                          f"or point checkpoint= at another disk")
    if code == errno.EROFS:
        return StorageError(errno.EROFS, f"read-only file system: could not {doing} {path}: point checkpoint= "
                                         f"at a folder on a writable disk")
    if code in (errno.EACCES, errno.EPERM):
        return StorageError(errno.EACCES, f"{path} is read-only for this process (permission denied): could not "
                                          f"{doing} it: give it write permission, or point checkpoint= elsewhere")
    if code == errno.ENOTDIR:
        return StorageError(errno.ENOTDIR, f"not a directory: could not {doing} {path} (a file lies on its path): "
                                           f"point checkpoint= at a folder")
    return None


def _free(path: Path) -> int:
    """Bytes free on the disk that holds `path` (or would, for a path not made yet)."""
    existing = next(p for p in [path, *path.parents] if p.exists())
    return shutil.disk_usage(existing).free


def _gb(size: int) -> str:
    return f"{size / 1e9:.3g} GB"


def _size(path: Path) -> int:
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file())


def _removable(folder: Path, known: dict[str, str | None] | None) -> list[Path]:
    """What make_room may delete, first to last: leftovers of interrupted writes, then the good checkpoints,
    oldest first, all but the newest. A damaged checkpoint is never among them."""
    good = [c for c in sorted(folder.glob("step-????????")) if _problem_of(c, known) is None]
    return _leftovers(folder) + good[:-1]


def check_room(folder: Path, needed: int, known: dict[str, str | None] | None = None) -> None:
    """Before the first step: raises StorageError unless the disk can hold a checkpoint of `needed` bytes,
    counting what make_room could delete for it."""
    free = _free(folder)
    if free < needed:
        removable = sum(_size(p) for p in _removable(folder, known))
        if free + removable < needed:
            raise _no_room(folder, needed, free, removable)


def make_room(folder: Path, needed: int, known: dict[str, str | None] | None = None) -> None:
    """Before a save: where the disk cannot hold a checkpoint of `needed` bytes besides those there, deletes
    leftovers and the oldest good checkpoints until it can (never the newest good one: a run always has one
    to resume), so that keeping two does not need room for three. Raises StorageError, deleting nothing,
    when even that would not make room."""
    free = _free(folder)
    if free >= needed:
        return
    removable = _removable(folder, known)
    if free + sum(_size(p) for p in removable) < needed:
        raise _no_room(folder, needed, free, sum(_size(p) for p in removable))
    for path in removable:
        print(f"linnet: removing {path} to make room for the next checkpoint ({_gb(needed)} needed, "
              f"{_gb(free)} free)", flush=True)
        _remove(path, known)
        free = _free(folder)
        if free >= needed:
            break
    _fsync_dir(folder)
    if free < needed:
        raise _no_room(folder, needed, free, 0)


def _no_room(folder: Path, needed: int, free: int, removable: int) -> StorageError:
    could_go = f" (and {_gb(removable)} in older checkpoints that could go)" if removable else ""
    return StorageError(errno.ENOSPC, f"no space left on device for checkpoints in {folder}: a checkpoint needs "
                                      f"{_gb(needed)}, {_gb(free)} free{could_go}. Free some space, or point "
                                      f"checkpoint= at another disk")


# The lock.

class FolderLock:
    """This run's hold on a checkpoint folder: its `LOCK` file, which records who took it (host, pid, process
    start, when) and which it holds locked with flock while it lives. The kernel lets go of a flock when its
    process dies, however it dies, so a dead run's lock is taken over (with a note); where the file system
    has no flock, the record decides: a holder on this machine whose process is gone. Released by release(),
    or at the process's exit."""

    def __init__(self, folder: Path, fd: int, record: dict):
        self.folder, self.path, self.fd, self.record = folder, folder / LOCK, fd, record
        atexit.register(self.release)

    @classmethod
    def take(cls, folder: Path) -> FolderLock:
        path = folder / LOCK
        for _ in range(10):  # again while the file found was removed by a holder letting go
            with storage_errors(path, "open"):
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                taken = _take_file(folder, fd)
            except BaseException:
                os.close(fd)
                raise
            if taken is not None:
                return cls(folder, fd, taken)
            os.close(fd)
        raise FolderInUse(f"could not take checkpoint folder {folder}: its {LOCK} file kept being replaced")

    def release(self) -> None:
        """Lets the folder go: removes the lock file (where it is still this run's) and its flock."""
        if self.fd is None:
            return
        atexit.unregister(self.release)
        try:
            if _same_file(self.fd, self.path) and _read_record(self.fd) == self.record:
                self.path.unlink()
        except OSError as error:  # the next run takes it over: this process will be gone
            warnings.warn(f"linnet: could not remove {self.path} ({error}); the next run takes it over")
        finally:
            os.close(self.fd)
            self.fd = None


def _take_file(folder: Path, fd: int) -> dict | None:
    """This process's record, written into the open lock file `fd`; None if the file was replaced meanwhile.
    Raises FolderInUse if a live run holds it."""
    locked = _flock(fd)
    if not _same_file(fd, folder / LOCK):
        return None
    holder = _read_record(fd)
    if locked is False:
        raise FolderInUse(_in_use(folder, holder, locked))
    me = _this_process()
    # A record of this very process under a flock taken here: an earlier hold let go without removing it.
    named = None if holder is None else (holder.get("host"), holder.get("pid"))
    stale_own = locked is True and named == (me["host"], me["pid"])
    if holder is not None and not stale_own and not _holder_gone(holder, locked):
        raise FolderInUse(_in_use(folder, holder, locked))
    _write_record(fd, me)
    if holder is not None and not stale_own:
        print(f"linnet: taking over checkpoint folder {folder} from {_who(holder)}, which ended without "
              f"releasing it", flush=True)
    return json.loads(json.dumps(me))


def _flock(fd: int) -> bool | None:
    """True: locked; False: another open file holds it; None: this file system (or OS) has no flock."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (a holder letting go removes it)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _read_record(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    try:
        record = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # empty, or cut short by a crash: nobody is named
    return record if isinstance(record, dict) else None


def _write_record(fd: int, record: dict) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)
    os.fsync(fd)


def _this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
            "boot": _boot_id(), "started": datetime.now().astimezone().isoformat(timespec="seconds")}


def _holder_gone(holder: dict, locked: bool | None) -> bool:
    """Whether the run a lock record names has ended. On this machine its process tells (a pid reused by
    another process has another start time); on another machine only the file system's lock can, and a
    flock taken here means its holder let go."""
    if holder.get("host") != socket.gethostname():
        return locked is True
    if holder.get("boot") and _boot_id() and holder["boot"] != _boot_id():
        return True  # this machine restarted since
    return not _alive(holder.get("pid"), holder.get("process_start"))


def _alive(pid, process_start: int | None) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc to say more
    state, start = stat
    return state not in ("Z", "X") and (process_start is None or start == process_start)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of a process, from /proc; None where there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (command)", which may hold spaces
    return fields[0], int(fields[19])


def _process_start(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _who(holder: dict | None) -> str:
    if holder is None:
        return "a process that has not written who it is yet"
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}"


def _in_use(folder: Path, holder: dict | None, locked: bool | None) -> str:
    message = (f"checkpoint folder {folder} is in use by another run ({_who(holder)}): two runs saving into one "
               f"folder overwrite each other's checkpoints. Wait for that run to end, or point checkpoint= at "
               f"another folder")
    if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        message += " (that run is this process: close() the Checkpointer that holds the folder first)"
    elif locked is not False:
        message += f" (if that run is over, delete {folder / LOCK})"
    return message

