"""The checkpoint folder both frameworks write through: visible only when
complete, pruned without touching what it cannot vouch for, and every kind of
damage found and named."""

from __future__ import annotations

import json
import warnings

from linnet import checkpoint_folder as cf


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
    assert "other.bin is missing" in problem_with(lambda m: {**m, "files": {**m["files"], "other.bin": m["files"]["state.bin"]}})
    (checkpoint / cf.MANIFEST).write_text("{not json")
    assert "unreadable" in cf.find_problem(checkpoint)
    (checkpoint / cf.MANIFEST).write_text(json.dumps(manifest))
    (checkpoint / "state.bin").write_bytes(b"0123456780")
    assert "does not match its SHA-256" in cf.find_problem(checkpoint)
    (checkpoint / "state.bin").write_bytes(b"01234")
    assert "has 5 bytes, the manifest says 10" in cf.find_problem(checkpoint)
