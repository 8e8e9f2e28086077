"""The benchmark table's CPU parts: the start every system shares (benchmarks/shared_start.py)
loads the same in Linnet and in transformers, its rows are each system's, and the table and plot
render from a run's JSON files (benchmarks/table.py). The runs themselves need GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import table  # noqa: E402
from common import load_rows  # noqa: E402


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("start")
    subprocess.run([sys.executable, "shared_start.py", "--card", "tiny-llama", "--out", str(out), "--rows", "6",
                    "--held-out", "2", "--tokens", "128", "--device", "cpu"], cwd=BENCHMARKS, check=True, timeout=300)
    return out


def test_the_shared_start_loads_alike_in_linnet_and_transformers(start):
    from transformers import LlamaForCausalLM

    from linnet import nest

    row = load_rows(start / "held_out.npz")[0]
    tokens = torch.from_numpy(row.tokens)[None]
    linnet = nest.load("tiny-llama", entry="logits", generics={"Batch": 1, "MaxSeq": 128, "T": "f32"},
                       weights=start / "init")
    hf = LlamaForCausalLM.from_pretrained(start / "init", torch_dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(linnet(tokens), hf(input_ids=tokens.long()).logits, rtol=1e-4, atol=1e-4)


def test_the_shared_rows_are_packed_tasks_split_by_rank(start):
    rows, held = load_rows(start / "rows.npz"), load_rows(start / "held_out.npz")
    assert len(rows) == 6 and len(held) == 2
    assert all(r.tokens.shape == (128,) and r.weights.sum() > 0 and r.tokens.max() < 512 for r in rows + held)
    assert not any(np.array_equal(r.tokens, h.tokens) for r in rows for h in held)  # held out: trained on by none
    second_of_three = load_rows(start / "rows.npz", rank=1, world=3)
    assert [r.tokens.tolist() for r in second_of_three] == [rows[1].tokens.tolist(), rows[4].tokens.tolist()]


def test_the_table_and_plot_render_from_a_runs_files(tmp_path):
    (tmp_path / "machine.json").write_text(json.dumps(dict(date="2026-12-03", gpus=["NVIDIA H200"], torch="2.11.0",
                                                           setting=", 1 GPU, 30 steps of one 4096-token row a GPU")))
    (tmp_path / "1b").mkdir()
    runs = {"linnet-torch": dict(step_s=0.0774, tok_s=52914, peak_gib=21.84, loss_start=6.2, loss_end=2.1),
            "fsdp2": dict(step_s=0.118, tok_s=34700, peak_gib=26.9, loss_start=6.2, loss_end=2.2),
            "ceiling": dict(step_s=0.0759, tok_s=53960, peak_gib=23.4)}
    for key, result in runs.items():
        system = next(s for s in table.SYSTEMS if s.key == key)
        (tmp_path / "1b" / f"{key}.json").write_text(json.dumps(dict(
            system=system.name, key=key, shape="1b", status=0, saving=False, result=result, log=f"1b/{key}.log")))
    (tmp_path / "1b" / "trl-fsdp2.json").write_text(json.dumps(dict(
        system="TRL, FSDP2", key="trl-fsdp2", shape="1b", status=1, saving=True, result=None, log="1b/trl-fsdp2.log")))
    (tmp_path / "8b").mkdir()  # a shape measured the next day, whose one run did not fit
    (tmp_path / "8b" / "linnet-jax-no-remat.json").write_text(json.dumps(dict(
        system="Linnet, JAX, --no-remat", key="linnet-jax-no-remat", shape="8b", date="2026-12-04", status=1,
        saving=False, result=None, log="8b/linnet-jax-no-remat.log",
        error="RESOURCE_EXHAUSTED: Out of memory while trying to allocate")))
    markdown, plot = table.render(tmp_path)
    lines = markdown.splitlines()
    assert lines[0] == ("Measured 2026-12-03 to 2026-12-04 on NVIDIA H200 (torch 2.11.0), 1 GPU, "
                        "30 steps of one 4096-token row a GPU.")
    assert "### llama-3.2-1b (measured 2026-12-03)" in lines and "### llama-3.1-8b (measured 2026-12-04)" in lines
    assert "| Linnet, JAX, --no-remat | out of memory: see 8b/linnet-jax-no-remat.log | | | |" in lines
    assert "| Linnet, PyTorch | 0.077 s | 52.9K | 21.8 GiB | 6.200 to 2.100 |" in lines
    assert "| plain compiled ceiling | 0.076 s | 54.0K | 23.4 GiB |  |" in lines
    assert "| TRL, FSDP2 (memory-saving option) | failed (1): see 1b/trl-fsdp2.log | | | |" in lines
    assert lines.index("| Linnet, PyTorch | 0.077 s | 52.9K | 21.8 GiB | 6.200 to 2.100 |") < lines.index(
        "| FSDP2, eager | 0.118 s | 34.7K | 26.9 GiB | 6.200 to 2.200 |")  # the systems' order
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "table.md").read_text() == markdown


def test_a_simulated_world_runs_the_scripts_alone_on_random_rows():
    linnet = next(s for s in table.SYSTEMS if s.key == "linnet-torch")
    argv = table.command(linnet, "8b", 8, Path("START"), gpus=1, sim=4, saving=False)
    assert argv[1].endswith("sim_world.py") and "--init" not in argv and argv[2] == "benchmarks/step.py"
    argv = table.command(linnet, "8b", 30, Path("START"), gpus=4, sim=None, saving=True)
    assert argv[3:5] == ["--standalone", "--nproc_per_node=4"] and argv[-2:] == ["--recompute", "full"]
    assert "START/rows.npz" in argv
