"""Checkpoints: a run killed part-way resumes to the same losses and weights;
a checkpoint resumes at another world size; partial and corrupt ones are
passed over with a warning, and kept."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run
from safetensors.torch import load_file

from linnet import nest
from linnet.data.packing import Example, Row, pack

DRIVER = Path(__file__).parent / "train_driver.py"
LIMIT_S = 1800  # the longest test starts three torchruns of at most 600 s each


def torchrun(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DRIVER),
               str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def losses(out: Path) -> dict[int, list[float]]:
    by_step: dict[int, list[float]] = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], []).append(record["loss"])
    return by_step


def test_killed_run_resumes_to_the_same_losses_and_weights(tmp_path):
    whole = torchrun(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    marker = tmp_path / "died"
    first = torchrun(tmp_path / "crash", "--die-once", str(marker), "--die-at", "5", "--die-rank", "1")
    assert first.returncode != 0 and marker.exists()  # rank 1 was killed at step 5
    assert not (tmp_path / "crash" / "weights").exists()
    second = torchrun(tmp_path / "crash", "--die-once", str(marker), "--die-at", "5", "--die-rank", "1")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stdout and "step-00000004" in second.stdout
    expected, got = losses(tmp_path / "whole"), losses(tmp_path / "crash")
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step, values in got.items():  # steps run twice (before the kill, after the resume) agree too
        assert all(v == expected[step][0] for v in values), (step, values, expected[step])
    for name, tensor in load_file(tmp_path / "whole" / "weights" / "model.safetensors").items():
        resumed = load_file(tmp_path / "crash" / "weights" / "model.safetensors")[name]
        torch.testing.assert_close(resumed, tensor, rtol=0, atol=0)


HALF = 64


def halves(seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    examples = [Example.prompted(rng.integers(6, 512, rng.integers(3, 12)).tolist(),
                                 rng.integers(6, 512, rng.integers(2, 8)).tolist()) for _ in range(200)]
    return list(pack(examples, HALF))


def join(*parts: Row) -> Row:
    """Rows side by side as one row of 2 * HALF positions (documents stay apart: segments are renumbered)."""
    fields, offset = {k: [] for k in ("tokens", "targets", "positions", "segments", "weights")}, 0
    for part in parts:
        for key in fields:
            fields[key].append(getattr(part, key) + (offset if key == "segments" else 0))
        offset += part.segments.max() + 1
    pad = 2 * HALF - sum(len(p.tokens) for p in parts)
    arrays = {k: np.concatenate(v + [np.zeros(pad, v[0].dtype) + (offset if k == "segments" else 0)])
              for k, v in fields.items()}
    return Row(**arrays, filled=sum(p.filled for p in parts))


def zero_weight(row: Row) -> Row:
    return Row(row.tokens, row.targets, row.positions, row.segments, np.zeros_like(row.weights), row.filled)


def rows_for(world: int, step_from: int) -> list[Row]:
    """Global rows, rank-strided (rank r takes rows[r::world]): world 2's for steps 1..step_from, then a
    global batch that is the same at every world size: rows A and B (world 2), plus a weightless one
    (world 3), or A and B joined into one row (world 1). At world 3, resuming skips 3, 3 and 2 rows on
    ranks 0, 1, 2, so the next rows (global 8, 9, 10) belong to ranks 2, 0, 1."""
    data = halves(1)
    early = [join(data[i]) for i in range(2 * step_from)]
    a, b = join(data[2 * step_from]), join(data[2 * step_from + 1])
    late = {1: [join(data[2 * step_from], data[2 * step_from + 1])], 2: [a, b], 3: [zero_weight(a), a, b]}[world]
    return early + late


def resume_run(rank: int, world: int, folder: str, steps: int, save_every: int | None):
    from linnet.torch import fully_shard
    from linnet.torch.shard import gathered_weights
    from linnet.torch.train import cosine_schedule, train

    model = nest.load("tiny-llama", numerics="exact", generics={"Batch": 1, "MaxSeq": 2 * HALF, "T": "f32"},
                      cast_dtype=True, trainable=True, weights="random", entry="loss_packed")
    fully_shard(model)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=3e-3, weight_decay=0.0, eps=1e-6)
    schedule = cosine_schedule(optimizer, 1, 10)
    rows = rows_for(world, 4)
    history = train(model, iter(rows[rank::world]), optimizer=optimizer, steps=steps, schedule=schedule,
                    on_step=lambda s: None, checkpoint=folder, checkpoint_every=save_every)
    weights = {name: t.numpy() for name, t in gathered_weights(model, torch.float32)}
    return {s.step: s.loss for s in history.steps}, weights, history.resumed_from


def test_a_checkpoint_resumes_at_another_world_size(tmp_path):
    folder = str(tmp_path / "ckpt")
    run(resume_run, 2, folder, 4, 4, timeout=300)  # four steps at world 2, saved at step 4
    reference = tmp_path / "reference"
    shutil.copytree(folder, reference)
    two = run(resume_run, 2, str(reference), 5, None, timeout=300)[0]
    for world in (1, 3):
        copy = tmp_path / f"at-{world}"
        shutil.copytree(folder, copy)
        (losses_by_step, weights, resumed_from), *_ = run(resume_run, world, str(copy), 5, None, timeout=300)
        assert resumed_from == 4 and list(losses_by_step) == [5]
        np.testing.assert_allclose(losses_by_step[5], two[0][5], rtol=1e-5)
        for name, tensor in weights.items():
            assert np.linalg.norm(tensor - two[1][name]) / np.linalg.norm(two[1][name]) < 1e-5, name


def unsharded_run(folder: Path, steps: int):
    from linnet.torch.train import train

    model = nest.load("tiny-llama", generics={"Batch": 1, "MaxSeq": 2 * HALF, "T": "f32"}, cast_dtype=True,
                      trainable=True, weights="random", entry="loss_packed")
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-3)
    return train(model, iter([join(r) for r in halves(2)]), optimizer=optimizer, steps=steps, on_step=lambda s: None,
                 checkpoint=folder, checkpoint_every=2)


def test_truncated_and_unfinished_checkpoints_are_passed_over(tmp_path):
    folder = tmp_path / "ckpt"
    unsharded_run(folder, 4)
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000004"]
    rank_file = next((folder / "step-00000004").glob("rank-*.pt"))
    rank_file.write_bytes(rank_file.read_bytes()[:-100])  # truncated
    with pytest.warns(UserWarning) as caught:
        assert unsharded_run(folder, 5).resumed_from == 2
    messages = " ".join(str(w.message) for w in caught)
    assert re.search(r"passing over checkpoint .*step-00000004: rank-00000-of-00001.pt has \d+ bytes", messages)
    # steps 3 and 4 ran again; the truncated step 4 was moved aside for a person, never overwritten
    assert re.search(r"moved damaged checkpoint .*step-00000004 .* to .*step-00000004.damaged", messages)
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000004", "step-00000004.damaged", "step-00000005"]
    (folder / "step-00000005" / "MANIFEST.json").unlink()  # a checkpoint without its manifest
    (folder / "step-00000006.partial").mkdir()  # and one whose write was cut short
    with pytest.warns(UserWarning) as caught:
        assert unsharded_run(folder, 6).resumed_from == 4
    messages = " ".join(str(w.message) for w in caught)
    assert "step-00000005: no MANIFEST.json" in messages and "step-00000006.partial" in messages


def resume_holding(rank: int, world: int, folder: str) -> tuple[int, int, int]:
    """Resumes a sharded run of tiny-llama from `folder`: (the most full groups alive at once, the largest
    one's elements, the elements of this rank's parts)."""
    import weakref

    from linnet.torch.checkpoint import Checkpointer
    from linnet.torch import fully_shard

    model = fully_shard(nest.load("tiny-llama", numerics="exact", generics={"Batch": 1, "MaxSeq": 2 * HALF, "T": "f32"},
                                  cast_dtype=True, trainable=True, weights="random", entry="loss_packed"))
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=3e-3)
    alive, most, largest = [], 0, 0
    concatenate, part = torch.cat, max(p.numel() for p in model.parameters())

    def watched_cat(tensors, *args, **kwargs):  # re-splitting joins the saved parts of one group at a time
        nonlocal most, largest
        joined = concatenate(tensors, *args, **kwargs)
        if joined.numel() > part:
            alive[:] = [ref for ref in alive if ref() is not None] + [weakref.ref(joined)]
            most, largest = max(most, len(alive)), max(largest, joined.numel())
        return joined

    torch.cat = watched_cat
    try:
        assert Checkpointer(folder, model, optimizer).resume() == 4
    finally:
        torch.cat = concatenate
    return most, largest, sum(p.numel() for p in model.parameters())


def test_a_sharded_checkpoint_holds_parts_and_resumes_one_group_at_a_time(tmp_path):
    folder = tmp_path / "ckpt"
    run(resume_run, 2, str(folder), 4, 4, timeout=300)
    (saved,) = [f for f in (folder / "step-00000004").iterdir() if f.name.startswith("rank-00000")]
    parts = torch.load(saved, weights_only=False)["parts"]
    same = run(resume_holding, 2, str(folder), timeout=300, fresh=True)  # its Checkpointer holds the folder
    assert sum(p.numel() for p in parts) == same[0][2]  # what a rank saved is its parts
    assert all(most == 0 for most, _, _ in same)  # at the same world size each rank reads its own file only
    layer = sum(size for size in (96 * 96, 48 * 96, 48 * 96, 96 * 96, 256 * 96, 256 * 96, 96 * 256, 96, 96))
    for most, largest, _ in run(resume_holding, 3, str(folder), timeout=300, fresh=True):
        assert most == 1 and largest <= layer + 16  # re-split from 2 ranks' files: one group in flight at a time
