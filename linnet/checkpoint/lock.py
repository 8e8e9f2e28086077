"""One run a checkpoint folder: two runs saving into one folder would
overwrite and prune each other's checkpoints, so a run takes the folder
before its first step and holds it until it ends.

`take` checks that the folder is a directory this process can write into
(linnet/checkpoint/storage.py) and takes its `LOCK` file: a `FolderLock`, which holds
the file locked with flock and records who took it (host, pid, process
start, boot, when). A second live run is refused with `FolderInUse`, naming
the holder; a dead run's lock is taken over, with a note: the kernel lets go
of a dead process's flock, and where the file system has no flock, the
record decides (a holder on this machine whose process, found in /proc, is
gone, or a machine restarted since)."""

from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import warnings
from datetime import datetime
from pathlib import Path
from typing import Self

from linnet.errors import UserError
from linnet.checkpoint.storage import check_writable_directory, storage_errors

try:
    import fcntl
except ImportError:  # not POSIX: the lock file's record alone says who holds a folder
    fcntl = None

LOCK = "LOCK"


class FolderInUse(RuntimeError, UserError):
    """Another run, still alive, holds the checkpoint folder."""


def take(folder: Path) -> FolderLock:
    """Before the first step: checks that `folder` is a directory (or can be made one) that this process can
    write into, and takes it for this run. Raises StorageError or FolderInUse, naming the folder."""
    check_writable_directory(folder)
    return FolderLock.take(folder)


class HoldsFolder:
    """A checkpointer's hold on its folder, as both frameworks' share it: `self.lock` is its FolderLock (None
    on a rank that does not hold it), and close(), or leaving a `with` block, lets the folder go."""

    lock: FolderLock | None = None

    def close(self) -> None:
        """Lets the folder go, for another run to take."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exception) -> None:
        self.close()


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

