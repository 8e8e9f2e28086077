"""Resuming compares the checkpoint with what this run asked for: a new
learning rate is followed, with a note, and is the optimizer's from the
first resumed step (PyTorch's schedule is stepped to the checkpoint's step
with it; JAX's injected one is kept as this run set it); a card with
another number of layers is refused, naming the difference, in PyTorch and
in JAX, from manifests that record the model's shapes and from older ones
that do not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import torch
from distributed import run
from hf_models import BASE, write_card
from jax.sharding import Mesh

from linnet import nest
from linnet.data.packing import Example, pack

LIMIT_S = 300  # seconds a test here may take (tests/conftest.py's bounded)
ROW = 64
VOCAB = BASE["vocab_size"]


@pytest.fixture(scope="module")
def cards(tmp_path_factory) -> dict[int, Path]:
    """Two cards of one name, "test-llama": one of 2 layers, one of 3."""
    out = {}
    for layers in (2, 3):
        folder = tmp_path_factory.mktemp(f"layers-{layers}")
        out[layers] = write_card(folder, {**BASE, "num_hidden_layers": layers}, None,
                                 repo="no-weights: random ones are drawn")
    return out


def rows(count: int = 24) -> list:
    rng = np.random.default_rng(5)
    examples = [Example.prompted(rng.integers(0, VOCAB, rng.integers(3, 12)).tolist(),
                                 rng.integers(0, VOCAB, rng.integers(2, 8)).tolist()) for _ in range(20 * count)]
    return list(pack(examples, ROW))[:count]


def torch_model(card):
    return nest.load(card, generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, cast_dtype=True, trainable=True,
                     weights="random", entry="loss_packed")


class Stop(Exception):
    """A run stopped part-way, as by a crash."""


def torch_run(card, folder: Path | None, steps: int, lr: float = 3e-3, stop_after: int | None = None):
    """A run whose cosine schedule is planned for 6 steps whatever `steps` says, saving every 2 steps, stopped
    after step `stop_after` if given; (history, optimizer)."""
    from linnet.torch.train import cosine_schedule, train

    def on_step(step):
        if step.step == stop_after:
            raise Stop(step.step)

    model = torch_model(card)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=lr)
    history = train(model, iter(rows()), optimizer=optimizer, steps=steps, schedule=cosine_schedule(optimizer, 1, 6),
                    on_step=on_step, checkpoint=folder, checkpoint_every=2)
    return history, optimizer


def jax_run(card, folder: Path, steps: int, optimizer):
    from linnet.jax.train import train

    model = nest.load(card, backend="jax_source", entry="loss_packed", cast_dtype=True, weights="random", seed=0,
                      generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"})
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    return train(model, rows(), optimizer=optimizer, steps=steps, mesh=mesh, on_step=lambda s: None,
                 checkpoint=folder)[1]


def forget_the_model_shapes(folder: Path) -> None:
    """Makes the checkpoints' manifests as they were before they recorded the model's shapes."""
    for manifest_path in folder.glob("step-*/MANIFEST.json"):
        manifest = json.loads(manifest_path.read_text())
        del manifest["model"]
        manifest_path.write_text(json.dumps(manifest))


# A new learning rate.

def test_a_new_learning_rate_is_followed_with_a_note(cards, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    torch_run(cards[2], folder, 2, lr=3e-3)
    capsys.readouterr()
    resumed, optimizer = torch_run(cards[2], folder, 4, lr=1e-3)
    out = capsys.readouterr().out
    assert resumed.resumed_from == 2
    assert "learning rate: 0.003 in the checkpoint, 0.001 in this run" in out
    assert "from step 2 on, this run's optimizer settings and schedule apply" in out
    straight, straight_optimizer = torch_run(cards[2], None, 4, lr=1e-3)  # the same schedule at the new rate
    assert [s.lr for s in resumed.steps] == [s.lr for s in straight.steps[2:]]
    assert optimizer.param_groups[0]["initial_lr"] == 1e-3
    assert optimizer.param_groups[0]["lr"] == straight_optimizer.param_groups[0]["lr"]


def test_the_same_settings_resume_without_a_note(cards, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    with pytest.raises(Stop):
        torch_run(cards[2], folder, 4, stop_after=3)  # saved at step 2
    capsys.readouterr()
    resumed, _ = torch_run(cards[2], folder, 4)
    out = capsys.readouterr().out
    assert "resuming from" in out and "differ from the checkpoint's" not in out
    straight, _ = torch_run(cards[2], None, 4)
    assert [s.lr for s in resumed.steps] == [s.lr for s in straight.steps[2:]]


def test_jax_follows_a_new_learning_rate_kept_in_the_optimizer_state(cards, tmp_path, capsys):
    """optax.inject_hyperparams keeps the learning rate in the state: the checkpoint's must not win."""
    folder = tmp_path / "ckpt"
    jax_run(cards[2], folder, 2, optax.inject_hyperparams(optax.adamw)(learning_rate=3e-3))
    capsys.readouterr()
    resumed = jax_run(cards[2], folder, 3, optax.inject_hyperparams(optax.adamw)(learning_rate=6e-3))
    out = capsys.readouterr().out
    assert resumed.resumed_from == 2 and resumed.steps[0].lr == pytest.approx(6e-3)
    assert "learning_rate: 0.003 in the checkpoint, 0.006 in this run" in out


def test_jax_notes_a_new_learning_rate_of_a_plain_optax_optimizer(cards, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    jax_run(cards[2], folder, 1, optax.adamw(3e-3))
    capsys.readouterr()
    jax_run(cards[2], folder, 2, optax.adamw(6e-3, b1=0.8))
    out = capsys.readouterr().out
    assert "optax's step_size (minus the learning rate): -0.003 in the checkpoint, -0.006 in this run" in out
    assert "optax's b1: 0.9 in the checkpoint, 0.8 in this run" in out


# Another number of layers.

def test_pytorch_refuses_a_checkpoint_with_another_number_of_layers(cards, tmp_path):
    for saved, mine in [(3, 2), (2, 3)]:
        folder = tmp_path / f"{saved}-into-{mine}"
        torch_run(cards[saved], folder, 2)
        with pytest.raises(ValueError, match=rf"{re.escape(str(folder))}/step-00000002 does not fit this run of "
                                             rf"test-llama: number of layers: {saved} in the checkpoint, {mine} in "
                                             rf"this run\. It was written for another model"):
            torch_run(cards[mine], folder, 4)
        forget_the_model_shapes(folder)  # an older manifest: the parameters' shapes are compared when read
        with pytest.raises(ValueError, match=rf"does not fit .*{len(list(torch_model(cards[saved]).parameters()))} "
                                             rf"tensors in the checkpoint"):
            torch_run(cards[mine], folder, 4)


def sharded_run(rank: int, world: int, card: str, folder: str, steps: int) -> str | None:
    from linnet.torch import fully_shard
    from linnet.torch.train import train

    model = fully_shard(torch_model(card))
    try:
        train(model, iter(rows()[rank::world]), optimizer=torch.optim.AdamW(list(model.parameters())), steps=steps,
              on_step=lambda s: None, checkpoint=folder)
    except ValueError as error:
        return str(error)
    return None


def test_pytorch_names_the_layers_of_a_sharded_checkpoint_from_an_older_manifest(cards, tmp_path):
    folder = tmp_path / "ckpt"
    assert run(sharded_run, 2, str(cards[3]), str(folder), 1, timeout=200) == [None, None]
    forget_the_model_shapes(folder)  # the layouts of the parts still count the layers
    for message in run(sharded_run, 2, str(cards[2]), str(folder), 2, timeout=200):
        assert "number of layers: 3 in the checkpoint, 2 in this run" in message


def test_jax_refuses_a_checkpoint_with_another_number_of_layers(cards, tmp_path):
    for saved, mine in [(3, 2), (2, 3)]:
        folder = tmp_path / f"{saved}-into-{mine}"
        jax_run(cards[saved], folder, 1, optax.adamw(3e-3))
        for manifest in ("as written", "older"):
            if manifest == "older":
                forget_the_model_shapes(folder)  # the parts' names still count the layers
            with pytest.raises(ValueError, match=rf"{re.escape(str(folder))}/step-00000001 does not fit this run "
                                                 rf"of test-llama: number of layers: {saved} in the checkpoint, "
                                                 rf"{mine} in this run\. It was written for another model"):
                jax_run(cards[mine], folder, 2, optax.adamw(3e-3))
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000001"]  # left as it was
