"""The disk under a checkpoint folder, apart from what the folder holds: a
folder that is not a directory, is read-only or is full is found and named
before the first step or the moment a write fails, with what to do, rather
than surfacing as an OSError deep in a writer (or numpy's "49152 requested
and 35808 written").

`check_writable_directory` checks, before the first step, that the folder is
a directory (or can be made one) that this process can write into;
`storage_errors` turns a write's failure for a full, read-only or misplaced
folder into a `StorageError` naming the path and the cause; `free_space`,
`total_size` and `gb` measure the disk and the checkpoints for
linnet/checkpoint/folder.py's check_room and make_room; `write_synced` and
`fsync_dir` make a file and a folder's new entries durable (linnet/hf/write.py's
weights too)."""

from __future__ import annotations

import errno
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from linnet.errors import UserError


class StorageError(OSError, UserError):
    """The checkpoint folder's storage cannot take a checkpoint: its errno says why (ENOTDIR, EROFS, EACCES,
    ENOSPC), its message names the path and what to do."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.errno = code

    def __reduce__(self):  # crosses processes (the ranks' agreement) with its errno
        return type(self), (self.errno, str(self))


def check_writable_directory(folder: Path) -> None:
    """Before the first step: checks that `folder` is a directory (or can be made one) that this process can
    write into. Raises StorageError, naming the folder."""
    _check_directory(folder)
    _check_writable(folder)


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
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and needed is not None and free_space(path) < needed):
        why = " (disk quota exceeded)" if code == errno.EDQUOT else ""
        return StorageError(errno.ENOSPC, f"no space left on device{why}: could not {doing} {path} "
                                          f"({gb(free_space(path))} free): free some space, keep fewer checkpoints, "
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


def free_space(path: Path) -> int:
    """Bytes free on the disk that holds `path` (or would, for a path not made yet)."""
    existing = next(p for p in [path, *path.parents] if p.exists())
    return shutil.disk_usage(existing).free


def total_size(path: Path) -> int:
    """Bytes in the files under the folder `path`."""
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file())


def gb(size: int) -> str:
    return f"{size / 1e9:.3g} GB"


def fsync_dir(path: Path) -> None:
    """Syncs a folder, so that the entries made or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, text: str) -> None:
    """Writes `text` to `path` and syncs it, so that it survives a power loss."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
