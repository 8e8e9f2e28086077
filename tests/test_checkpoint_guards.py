"""A run that cannot be lost: a checkpoint folder belongs to one run at a time
(a second live run is refused at start, a dead run's lock is taken over); a
folder whose checkpoints are all damaged stops the run and is left as it
was; a folder that is not a directory, read-only or full fails before the
first step, a write that fails for a full or read-only disk says so, and a
save makes room first by deleting the oldest checkpoints, never the newest."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run

from linnet.checkpoint import folder as cf
from linnet import nest
from linnet.checkpoint import lock as folder_lock
from linnet.checkpoint import storage
from linnet.torch.checkpoint import Checkpointer
from linnet.checkpoint.lock import LOCK, FolderInUse
from linnet.data.packing import Example, pack
from linnet.checkpoint.storage import StorageError

LIMIT_S = 300  # seconds a test here may take (tests/conftest.py's bounded)
ROW = 64


def rows(count: int = 40, vocab: int = 512) -> list:
    rng = np.random.default_rng(3)
    examples = [Example.prompted(rng.integers(6, vocab, rng.integers(3, 12)).tolist(),
                                 rng.integers(6, vocab, rng.integers(2, 8)).tolist()) for _ in range(20 * count)]
    return list(pack(examples, ROW))[:count]


def torch_model():
    return nest.load("tiny-llama", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, cast_dtype=True, trainable=True,
                     weights="random", entry="loss_packed")


def torch_run(folder: Path, steps: int, every: int | None = 1, on_step=None):
    from linnet.torch.train import train

    model = torch_model()
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-3)
    return train(model, iter(rows()), optimizer=optimizer, steps=steps, on_step=on_step or (lambda s: None),
                 checkpoint=folder, checkpoint_every=every)


def jax_run(folder: Path, steps: int, every: int | None = 1):
    import jax
    import optax
    from jax.sharding import Mesh

    from linnet.jax.train import train

    model = nest.load("tiny-llama", backend="jax_source", entry="loss_packed", cast_dtype=True, weights="random",
                      generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, seed=0)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    return train(model, rows(), optimizer=optax.adamw(1e-3), steps=steps, mesh=mesh, on_step=lambda s: None,
                 checkpoint=folder, checkpoint_every=every)[1]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


Usage = namedtuple("Usage", "total used free")


def a_dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def write_lock(folder: Path, **record) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK).write_text(json.dumps({"host": socket.gethostname(), "started": "2024-01-01T00:00:00",
                                              **record}))


@pytest.fixture(scope="module")
def model():
    return torch_model()


def checkpointer(folder: Path, model) -> Checkpointer:
    return Checkpointer(folder, model, torch.optim.AdamW(list(model.parameters())))


# One run a folder.

def test_a_second_checkpointer_on_the_folder_is_refused_until_the_first_closes(tmp_path, model):
    folder = tmp_path / "ckpt"
    first = checkpointer(folder, model)
    with pytest.raises(FolderInUse) as refused:
        checkpointer(folder, model)
    message = str(refused.value)
    assert str(folder) in message and f"pid {os.getpid()} on {socket.gethostname()}" in message
    assert "this process: close() the Checkpointer" in message
    first.close()
    assert not (folder / LOCK).exists()  # released: the lock file goes
    with checkpointer(folder, model):
        assert json.loads((folder / LOCK).read_text())["pid"] == os.getpid()
    assert not (folder / LOCK).exists()


HOLD = """
import sys, time
from pathlib import Path
from linnet.checkpoint import lock as folder_lock
lock = folder_lock.take(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(300)
"""


def test_a_live_run_in_another_process_is_named_and_its_lock_taken_over_once_it_is_killed(tmp_path, model, capsys):
    folder = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        in_use = rf"{re.escape(str(folder))} is in use by another run \(pid {holder.pid} on "
        with pytest.raises(FolderInUse, match=in_use):
            checkpointer(folder, model)
    finally:
        holder.kill()  # SIGKILL: no chance to release; the kernel lets go of its flock
        holder.wait(timeout=60)
    with checkpointer(folder, model):
        pass
    out = capsys.readouterr().out
    assert f"taking over checkpoint folder {folder} from pid {holder.pid}" in out and "ended without releasing" in out


def test_a_lock_naming_a_process_that_does_not_exist_is_taken_over(tmp_path, model, capsys):
    folder = tmp_path / "ckpt"
    dead = a_dead_pid()
    write_lock(folder, pid=dead)
    with checkpointer(folder, model):
        assert json.loads((folder / LOCK).read_text())["pid"] == os.getpid()
    out = capsys.readouterr().out
    assert f"taking over checkpoint folder {folder} from pid {dead} on {socket.gethostname()}" in out


def test_a_lock_naming_a_live_process_of_this_machine_is_refused_without_flock_too(tmp_path, model):
    """A holder whose file system has no flock: its record alone says it lives."""
    folder = tmp_path / "ckpt"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        write_lock(folder, pid=sleeper.pid)
        with pytest.raises(FolderInUse, match=rf"pid {sleeper.pid} on .*if that run is over, delete .*LOCK"):
            checkpointer(folder, model)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=60)
    with checkpointer(folder, model):  # and once it is gone, taken over
        pass


def test_a_lock_of_another_machine_counts_on_flock(tmp_path, model, monkeypatch, capsys):
    folder = tmp_path / "ckpt"
    write_lock(folder, host="another-machine", pid=1)
    with checkpointer(folder, model):  # its flock is free: that run let go
        pass
    assert "from pid 1 on another-machine" in capsys.readouterr().out
    write_lock(folder, host="another-machine", pid=1)
    monkeypatch.setattr(folder_lock, "_flock", lambda fd: None)  # a file system without flock: nothing can tell
    with pytest.raises(FolderInUse, match="pid 1 on another-machine"):
        checkpointer(folder, model)


def hold_at_every_rank(rank: int, world: int, folder: str) -> str:
    try:
        checkpointer(Path(folder), torch_model())
    except Exception as error:  # noqa: BLE001  (the test looks at what each rank raised)
        return f"{type(error).__name__}: {error}"
    return "taken"


def test_every_rank_learns_that_the_folder_is_held(tmp_path):
    """As a user error on every rank (one line in the examples), naming the first rank's FolderInUse."""
    folder = tmp_path / "ckpt"
    lock = folder_lock.take(folder)
    try:
        first, second = run(hold_at_every_rank, 2, str(folder), timeout=120, fresh=True)
    finally:
        lock.release()
    assert first.startswith(f"FolderInUse: checkpoint folder {folder} is in use by another run (pid {os.getpid()}")
    assert second.startswith("UserError: could not take checkpoint folder") and "rank 0: FolderInUse" in second


def test_train_lets_the_folder_go_however_it_ends(tmp_path, model):
    folder = tmp_path / "ckpt"
    torch_run(folder, 2)
    assert names(folder) == ["step-00000001", "step-00000002"]  # no lock left
    with pytest.raises(ValueError, match="past steps=1"):
        torch_run(folder, 1)
    assert LOCK not in names(folder)
    with checkpointer(folder, model):
        pass


def test_a_jax_checkpointer_holds_its_folder_too(tmp_path):
    from linnet.jax.checkpoint import JaxCheckpointer

    folder = tmp_path / "ckpt"
    first = JaxCheckpointer(folder, "tiny-llama", {}, 1)
    with pytest.raises(FolderInUse, match=f"{re.escape(str(folder))} is in use by another run"):
        JaxCheckpointer(folder, "tiny-llama", {}, 1)
    first.close()
    with JaxCheckpointer(folder, "tiny-llama", {}, 1):
        assert (folder / LOCK).exists()
    assert not (folder / LOCK).exists()


# A folder whose checkpoints are all damaged.

def damage_all(folder: Path) -> None:
    """The newest truncated, the one before with a flipped byte."""
    *_, before, newest = sorted(folder.glob("step-????????"))
    state = max(newest.glob("*.*"), key=lambda p: p.stat().st_size)
    state.write_bytes(state.read_bytes()[:-100])
    state = max(before.glob("*.*"), key=lambda p: p.stat().st_size)
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))


def test_a_folder_of_damaged_checkpoints_stops_the_run_and_stays_as_it_was(tmp_path):
    folder = tmp_path / "ckpt"
    torch_run(folder, 2)
    damage_all(folder)
    before = snapshot(folder)
    steps = []
    with pytest.raises(cf.DamagedCheckpoints) as stopped:
        torch_run(folder, 4, on_step=steps.append)
    message = str(stopped.value)
    assert f"every checkpoint in {folder} is damaged" in message
    assert "step-00000002: rank-00000-of-00001.pt has" in message and "(truncated or overwritten)" in message
    assert "step-00000001: rank-00000-of-00001.pt does not match its SHA-256" in message
    assert steps == [] and snapshot(folder) == before  # no step taken, no byte changed, no lock left


def resume_damaged(rank: int, world: int, folder: str) -> str:
    try:
        checkpointer(Path(folder), torch_model()).resume()
    except Exception as error:  # noqa: BLE001  (the test looks at what each rank raised)
        return f"{type(error).__name__}: {error}"
    return "resumed"


def test_every_rank_stops_on_a_folder_of_damaged_checkpoints(tmp_path):
    folder = tmp_path / "ckpt"
    torch_run(folder, 2)
    damage_all(folder)
    first, second = run(resume_damaged, 2, str(folder), timeout=120, fresh=True)
    assert first.startswith(f"DamagedCheckpoints: every checkpoint in {folder} is damaged")
    assert second.startswith("UserError: could not find the newest checkpoint")
    assert "rank 0: DamagedCheckpoints" in second


def test_a_jax_folder_of_damaged_checkpoints_stops_the_run_and_stays_as_it_was(tmp_path):
    folder = tmp_path / "ckpt"
    jax_run(folder, 2)
    damage_all(folder)
    before = snapshot(folder)
    with pytest.raises(cf.DamagedCheckpoints, match=r"(?s)step-00000002: array-\d+.npy has .*step-00000001: array"):
        jax_run(folder, 4)
    assert snapshot(folder) == before


# Storage.

def test_a_file_where_the_folder_should_be_fails_before_the_first_step(tmp_path, model):
    blocker = tmp_path / "ckpt"
    blocker.write_text("not a folder")
    for folder in (blocker, blocker / "under"):
        not_a_directory = f"checkpoint folder {re.escape(str(folder))} is not a directory"
        with pytest.raises(StorageError, match=not_a_directory) as failed:
            checkpointer(folder, model)
        assert failed.value.errno == errno.ENOTDIR
    assert blocker.read_text() == "not a folder"


def test_a_read_only_folder_fails_before_the_first_step(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):  # root writes anyway: a read-only file system, simulated
            def read_only(path):
                raise OSError(errno.EROFS, "Read-only file system", str(path))

            monkeypatch.setattr(storage, "_write_probe", read_only)
        steps = []
        with pytest.raises(StorageError, match="read-only") as failed:
            torch_run(folder, 2, on_step=steps.append)
        assert str(folder) in str(failed.value) and failed.value.errno in (errno.EROFS, errno.EACCES) and steps == []
    finally:
        folder.chmod(0o755)
    assert names(folder) == []


def test_a_full_disk_fails_before_the_first_step(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 1000, 1000))
    steps = []
    with pytest.raises(StorageError, match=rf"no space left on device for checkpoints in {re.escape(str(folder))}: "
                                              rf"a checkpoint needs [\d.]+ GB, 1e-06 GB free") as failed:
        torch_run(folder, 2, on_step=steps.append)
    assert failed.value.errno == errno.ENOSPC and steps == [] and names(folder) == []


def test_a_write_that_fails_for_a_full_or_read_only_disk_says_so(tmp_path, monkeypatch):
    written = torch.save
    for code, said in [(errno.ENOSPC, "no space left on device: could not write"),
                       (errno.EROFS, "read-only file system: could not write")]:
        def fail(state, f, code=code):
            written(state, f)
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(torch, "save", fail)
        folder = tmp_path / f"ckpt-{code}"
        path = folder / "step-00000001.partial" / "rank-00000-of-00001.pt"
        with pytest.raises(StorageError, match=f"{said} {re.escape(str(path))}"):
            torch_run(folder, 1)
        assert names(folder) == []  # what the failed save wrote is gone


def test_a_full_disk_is_named_when_the_writer_only_counts_bytes(tmp_path, monkeypatch):
    """torch's own writer on a full disk says "unexpected pos 108224 vs 108112", numpy's "49152 requested and
    35808 written": the disk says why."""
    full = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 0, 0 if full else 10**12))

    def unexpected_pos(state, f):
        full.append(True)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 108224 vs 108112")

    monkeypatch.setattr(torch, "save", unexpected_pos)
    with pytest.raises(StorageError, match=r"no space left on device: could not write .*rank-00000-of-00001.pt "
                                              r"\(0 GB free\)") as failed:
        torch_run(tmp_path / "torch", 1)
    assert "unexpected pos" in str(failed.value.__cause__)

    def requested_and_written(f, array):
        full.append(True)
        raise OSError("49152 requested and 35808 written")

    full.clear()
    monkeypatch.setattr(np, "save", requested_and_written)
    with pytest.raises(StorageError, match=r"no space left on device: could not write .*array-00000.npy"):
        jax_run(tmp_path / "jax", 1)
    assert names(tmp_path / "jax") == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full: a device that is always full")
def test_a_real_full_device_is_named(tmp_path, monkeypatch):
    import linnet.torch.checkpoint

    monkeypatch.setattr(linnet.torch.checkpoint, "_rank_file", lambda rank, world: "/dev/full")  # partial / it: itself
    with pytest.raises(StorageError, match="no space left on device: could not write /dev/full") as failed:
        torch_run(tmp_path / "ckpt", 1)
    assert failed.value.__cause__.errno == errno.ENOSPC


def test_a_save_makes_room_by_deleting_the_oldest_checkpoint_first(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ckpt"
    torch_run(folder, 4)
    assert names(folder) == ["step-00000003", "step-00000004"]
    one = du(folder / "step-00000004")
    capacity = du(folder) + one // 2  # room for half a checkpoint more: keeping two needs the oldest gone first
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(capacity, du(folder), capacity - du(folder)))
    seen, written = [], torch.save

    def save(state, f):
        seen.append(names(folder))
        written(state, f)

    monkeypatch.setattr(torch, "save", save)
    torch_run(folder, 5)
    assert seen == [[LOCK, "step-00000004", "step-00000005.partial"]]  # step 3 went before step 5 was written
    assert names(folder) == ["step-00000004", "step-00000005"]
    assert f"removing {folder / 'step-00000003'} to make room for the next checkpoint" in capsys.readouterr().out


def test_a_disk_too_full_even_without_the_older_checkpoints_fails_before_the_first_step(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    torch_run(folder, 4)
    before = snapshot(folder)
    capacity = du(folder) + 1000
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(capacity, du(folder), capacity - du(folder)))
    steps = []
    with pytest.raises(StorageError, match=r"a checkpoint needs [\d.e-]+ GB, [\d.e-]+ GB free \(and [\d.e-]+ GB "
                                              r"in older checkpoints that could go\)"):
        torch_run(folder, 6, on_step=steps.append)
    assert steps == [] and snapshot(folder) == before  # nothing deleted in vain


def test_the_newest_good_checkpoint_is_never_deleted_to_make_room(tmp_path, monkeypatch):
    for step in (1, 2):
        partial = cf.partial_path(tmp_path, step)
        cf.begin(partial)
        (partial / "state.bin").write_bytes(b"x" * 1000)
        cf.commit(tmp_path, partial, {"step": step}, [cf.describe(partial / "state.bin")], keep=2)
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: Usage(10**6, 0, 1500 if (tmp_path / "step-00000001").exists() else 2500))
    cf.make_room(tmp_path, 2000)
    assert names(tmp_path) == ["step-00000002"]
    with pytest.raises(StorageError, match="no space left on device"):
        cf.make_room(tmp_path, 3000)
    assert names(tmp_path) == ["step-00000002"]
