"""linnet.metrics: each step's metrics as a JSON line (appended by a resumed run), in TensorBoard's event
files and in W&B; the FLOPs a token, and the MFU they give."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest

from linnet import nest
from linnet.history import Step
from linnet.metrics import Metrics, flops_per_token, parameters, peak_flops

pytestmark = pytest.mark.quick

STEPS = [Step(1, 5.0, 0.5, 4096, 2000.0, 1e-4, 1.5), Step(2, 4.0, 0.25, 4096, 2000.0, 2e-4, 0.9, 3.5)]


def test_each_step_is_a_json_line_and_a_resumed_run_appends(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    metrics = Metrics(path, flops_per_token=1e9, devices=2, peak_flops=peak_flops("NVIDIA H100 80GB HBM3"),
                      peak_memory=lambda: 12.5)
    metrics(STEPS[0])
    metrics.close()
    again = Metrics(path, flops_per_token=1e9, devices=2, peak_flops=989e12)
    again(STEPS[1])
    again.close()
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first == {"step": 1, "loss": 5.0, "grad_norm": 1.5, "lr": 1e-4, "held_out_loss": None, "seconds": 0.5,
                     "tokens": 4096, "tokens_per_s": 8192.0, "tflops_per_device": pytest.approx(4.096),
                     "mfu": pytest.approx(4.096e12 / 989e12), "peak_memory_gib": 12.5}
    assert second["step"] == 2 and second["held_out_loss"] == 3.5 and second["peak_memory_gib"] is None


def test_other_ranks_write_nothing_and_an_unknown_device_has_no_mfu(tmp_path):
    metrics = Metrics(tmp_path / "metrics.jsonl", writer=False)
    metrics(STEPS[0])
    assert not (tmp_path / "metrics.jsonl").exists()
    assert peak_flops("cpu") is None
    assert Metrics(tmp_path / "m.jsonl", flops_per_token=1e9).record(STEPS[0])["mfu"] is None


def test_tensorboard_gets_every_metric(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = Metrics(tmp_path / "metrics.jsonl")
    for step in STEPS:
        metrics(step)
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 5.0), (2, 4.0)]
    assert [e.value for e in events.Scalars("train/held_out_loss")] == [3.5]


def test_wandb_gets_every_metric_when_asked(tmp_path, monkeypatch):
    logged = []
    run = types.SimpleNamespace(log=lambda values, step: logged.append((step, values)), finish=lambda: None)
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda project, config: run if project == "sft" else None
    monkeypatch.setitem(sys.modules, "wandb", fake)
    metrics = Metrics(tmp_path / "metrics.jsonl", wandb_project="sft")
    metrics(STEPS[0])
    metrics.close()
    assert logged[0][0] == 1 and logged[0][1]["loss"] == 5.0 and "held_out_loss" not in logged[0][1]


def test_wandb_asked_for_but_not_installed_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "wandb" else object())
    with pytest.raises(ValueError, match="W&B project 'sft' asked for, but wandb is not installed"):
        Metrics(tmp_path / "metrics.jsonl", wandb_project="sft")


def test_flops_a_token_count_the_matrix_products_and_attention():
    model = nest.load("tiny-llama", weights="random", entry="loss_packed",
                      generics={"Batch": 1, "MaxSeq": 64, "T": "f32"})
    checked = model.checked
    d, layers, vocab = checked.dims["D"], checked.dims["Layers"], checked.dims["Vocab"]
    head = 0 if checked.consts["tied"] else vocab * d  # an embedding looked up is no matrix product
    assert parameters(model) == sum(tensor.numel() for _, tensor in model.named_weights())
    assert flops_per_token(model, 64) == 6 * (parameters(model) - head) + 6 * layers * 64 * d
