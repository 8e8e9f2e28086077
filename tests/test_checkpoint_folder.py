"""The checkpoint folder both frameworks write through: visible only when
complete, pruned without touching what it cannot vouch for, every kind of
damage found and named, and a damaged checkpoint never deleted or
overwritten."""

from __future__ import annotations

import json
import warnings

import pytest

from linnet.checkpoint import folder as cf

pytestmark = pytest.mark.quick

LIMIT_S = 60  # seconds a test here may take (tests/conftest.py's bounded)


def save(folder, step: int, payload: bytes = b"state", keep: int = 2):
    partial = cf.partial_path(folder, step)
    cf.begin(partial)
    (partial / "state.bin").write_bytes(payload)
    return cf.commit(folder, partial, {"step": step}, [cf.describe(partial / "state.bin")], keep=keep)


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_commit_keeps_the_newest_complete_ones_and_clears_older_leftovers(tmp_path):
    for step in (1, 2):
        save(tmp_path, step)
    cf.begin(cf.partial_path(tmp_path, 3))  # a write that crashed
    save(tmp_path, 4)
    assert names(tmp_path) == ["step-00000002", "step-00000004"]
    assert cf.latest(tmp_path).name == "step-00000004"


def test_a_later_damaged_checkpoint_is_left_alone_and_not_counted(tmp_path):
    save(tmp_path, 9)
    (tmp_path / "step-00000009" / cf.MANIFEST).unlink()  # damaged: for a person to look at
    save(tmp_path, 3)
    save(tmp_path, 4, keep=1)
    assert names(tmp_path) == ["step-00000004", "step-00000009"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cf.latest(tmp_path).name == "step-00000004"
    assert any("step-00000009: no MANIFEST.json" in str(w.message) for w in caught)


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    save(tmp_path, 5, b"first")
    save(tmp_path, 5, b"second")
    assert names(tmp_path) == ["step-00000005"]
    assert (tmp_path / "step-00000005" / "state.bin").read_bytes() == b"second"
    assert cf.find_problem(tmp_path / "step-00000005") is None


def test_every_kind_of_damage_is_named(tmp_path):
    checkpoint = save(tmp_path, 1, b"0123456789")
    manifest = json.loads((checkpoint / cf.MANIFEST).read_text())

    def problem_with(change) -> str:
        (checkpoint / cf.MANIFEST).write_text(json.dumps(change(json.loads(json.dumps(manifest)))))
        return cf.find_problem(checkpoint)

    assert "not format 1" in problem_with(lambda m: {**m, "format": 99})
    assert "lists its files wrongly" in problem_with(lambda m: {**m, "files": ["state.bin"]})
    assert "lists its files wrongly" in problem_with(lambda m: {**m, "files": {"state.bin": 10}})
    assert "other.bin is missing" in problem_with(
        lambda m: {**m, "files": {**m["files"], "other.bin": m["files"]["state.bin"]}})
    (checkpoint / cf.MANIFEST).write_text("{not json")
    assert "unreadable" in cf.find_problem(checkpoint)
    (checkpoint / cf.MANIFEST).write_text(json.dumps(manifest))
    (checkpoint / "state.bin").write_bytes(b"0123456780")
    assert "does not match its SHA-256" in cf.find_problem(checkpoint)
    (checkpoint / "state.bin").write_bytes(b"01234")
    assert "has 5 bytes, the manifest says 10" in cf.find_problem(checkpoint)


def corrupt(checkpoint) -> None:
    state = checkpoint / "state.bin"
    state.write_bytes(b"X" + state.read_bytes()[1:])  # same size: only the SHA-256 tells


def test_a_damaged_checkpoint_is_never_pruned(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    corrupt(tmp_path / "step-00000001")
    with pytest.warns(UserWarning, match=r"leaving damaged checkpoint .*step-00000001 in place \(state.bin does not "
                                         r"match its SHA-256"):
        save(tmp_path, 3)
    with pytest.warns(UserWarning, match="leaving damaged checkpoint"):
        save(tmp_path, 4)
    assert names(tmp_path) == ["step-00000001", "step-00000003", "step-00000004"]  # 2 pruned, 1 not counted


def test_saving_the_step_of_a_damaged_checkpoint_moves_it_aside(tmp_path):
    save(tmp_path, 5, b"first")
    corrupt(tmp_path / "step-00000005")
    damaged = (tmp_path / "step-00000005" / "state.bin").read_bytes()
    for again in (b"second", b"third"):
        corrupt(tmp_path / "step-00000005")
        with pytest.warns(UserWarning, match=r"moved damaged checkpoint .*step-00000005 \(state.bin does not match"):
            save(tmp_path, 5, again)
    assert names(tmp_path) == ["step-00000005", "step-00000005.damaged", "step-00000005.damaged-2"]
    assert (tmp_path / "step-00000005.damaged" / "state.bin").read_bytes() == damaged
    assert cf.find_problem(tmp_path / "step-00000005") is None


def test_a_folder_of_damaged_checkpoints_is_named_whole_and_left_alone(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep=3)
    corrupt(tmp_path / "step-00000003")
    (tmp_path / "step-00000002" / cf.MANIFEST).unlink()
    (tmp_path / "step-00000001" / "state.bin").write_bytes(b"st")
    before = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(cf.DamagedCheckpoints) as stopped:
        cf.latest(tmp_path)
    assert str(stopped.value).splitlines()[1:4] == [
        "  step-00000003: state.bin does not match its SHA-256 in the manifest (corrupt)",
        "  step-00000002: no MANIFEST.json (incomplete)",
        "  step-00000001: state.bin has 2 bytes, the manifest says 5 (truncated or overwritten)"]
    assert {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_folder_of_interrupted_writes_alone_starts_afresh(tmp_path):
    cf.begin(cf.partial_path(tmp_path, 1))
    with pytest.warns(UserWarning, match="step-00000001.partial: an unfinished checkpoint"):
        assert cf.latest(tmp_path) is None


def test_a_deletion_cut_short_leaves_a_leftover_that_the_next_save_sweeps_away(tmp_path, monkeypatch):
    for step in (1, 2):
        save(tmp_path, step)
    rmtree = cf.shutil.rmtree

    def killed_partway(path, *args, **kwargs):  # the process dies after the first file is gone
        next(p for p in sorted(path.iterdir())).unlink()
        raise SystemExit(f"killed while deleting {path}")

    monkeypatch.setattr(cf.shutil, "rmtree", killed_partway)
    with pytest.raises(SystemExit):
        save(tmp_path, 3)  # prunes step 1
    monkeypatch.setattr(cf.shutil, "rmtree", rmtree)
    assert names(tmp_path) == ["step-00000001.deleting", "step-00000002", "step-00000003"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing damaged to warn of: the half-deleted one is no checkpoint
        assert cf.latest(tmp_path).name == "step-00000003"
        save(tmp_path, 4)
    assert names(tmp_path) == ["step-00000003", "step-00000004"]


def test_a_step_saved_again_and_cut_short_between_its_two_renames_resumes_from_the_old_one(tmp_path, monkeypatch):
    save(tmp_path, 1, keep=1)
    save(tmp_path, 2, b"first", keep=1)
    rename = cf.os.rename

    def killed_after_moving_aside(source, target):
        rename(source, target)
        if str(target).endswith(".old"):
            raise SystemExit("killed after moving the old checkpoint aside")

    monkeypatch.setattr(cf.os, "rename", killed_after_moving_aside)
    with pytest.raises(SystemExit):
        save(tmp_path, 2, b"second", keep=1)
    monkeypatch.setattr(cf.os, "rename", rename)
    assert names(tmp_path) == ["step-00000002.old", "step-00000002.partial"]
    with pytest.warns(UserWarning, match="step-00000002.partial: an unfinished checkpoint"):
        resumed = cf.latest(tmp_path)
    assert resumed.name == "step-00000002.old" and (resumed / "state.bin").read_bytes() == b"first"
    assert [p.name for p in cf._removable(tmp_path, None)] == ["step-00000002.partial"]  # never the one to resume
    save(tmp_path, 3, keep=1)
    assert names(tmp_path) == ["step-00000003"]
