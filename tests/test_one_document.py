"""A row that one document fills is trained through the plain causal `loss`
entry (fused causal attention, no document mask) where the model has it, and
learns exactly what `loss_packed` teaches; the ranks of a sharded model choose
together, since an entry is collective."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run
from linnet import nest
from linnet.data.packing import Example, Row, pack

ROW = 64
STEPS = 3


def one_document_rows(count: int, seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        ids = rng.integers(0, 200, ROW, dtype=np.int32)
        rows.append(Row(tokens=ids, targets=np.roll(ids, -1), positions=np.arange(ROW, dtype=np.int32),
                        segments=np.zeros(ROW, np.int32), weights=np.r_[np.ones(ROW - 1), 0.0].astype(np.float32),
                        filled=ROW))
    return rows


def packed_rows(count: int, seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    examples = [Example.prompted(rng.integers(0, 200, 9).tolist(), rng.integers(0, 200, 7).tolist())
                for _ in range(20 * count)]
    return list(pack(examples, ROW))[:count]


def test_which_rows_are_one_document():
    row = one_document_rows(1, 0)[0]
    assert row.is_one_document()
    assert not packed_rows(1, 0)[0].is_one_document()
    # a document's later piece
    continued = Row(row.tokens, row.targets, row.positions + 5, row.segments, row.weights, ROW)
    assert not continued.is_one_document()
    padded = Row(row.tokens, row.targets, row.positions, np.r_[np.zeros(ROW - 4), np.ones(4)].astype(np.int32),
                 row.weights, ROW - 4)
    assert not padded.is_one_document()


def train_recording(rank: int, world: int, entry: str | None,
                    rows_of_rank: dict) -> tuple[list[float], dict, list[str]]:
    """Trains the tiny card sharded; returns the losses, the weights, and the entries each step and evaluation
    called."""
    from linnet.torch import fully_shard
    from linnet.torch.shard import gathered_weights
    from linnet.torch.train import evaluate, train

    model = nest.load("tiny-llama", numerics="exact", generics={"Batch": 1, "MaxSeq": ROW, "T": "f32"}, cast_dtype=True,
                      trainable=True, weights="random", seed=0, entry=entry)
    fully_shard(model)
    called = []
    run_entry = model.run
    model.run = lambda name, *inputs: called.append(name) or run_entry(name, *inputs)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=3e-3, weight_decay=0.0)
    rows = rows_of_rank[rank]
    history = train(model, iter(rows), optimizer=optimizer, steps=STEPS, on_step=lambda s: None)
    evaluate(model, rows[:2])
    weights = {name: tensor.numpy() for name, tensor in gathered_weights(model, torch.float32)}
    return [s.loss for s in history.steps], weights, called


@pytest.mark.parametrize("world", [1, 2])
def test_one_document_rows_train_through_the_causal_entry_as_through_the_packed_one(world):
    rows = {rank: one_document_rows(STEPS, seed=rank) for rank in range(world)}
    causal = run(train_recording, world, None, rows, timeout=300)
    packed = run(train_recording, world, "loss_packed", rows, timeout=300)
    for (losses, weights, called), (packed_losses, packed_weights, packed_called) in zip(causal, packed):
        assert called == ["loss"] * (STEPS + 2)
        assert packed_called == ["loss_packed"] * (STEPS + 2)
        # the same arithmetic: a causal mask is a one-document mask
        np.testing.assert_array_equal(losses, packed_losses)
        for name, tensor in weights.items():
            np.testing.assert_array_equal(tensor, packed_weights[name], err_msg=name)


def test_the_ranks_take_the_packed_entry_together_when_any_row_is_packed():
    rows = {0: one_document_rows(STEPS, seed=0), 1: [*one_document_rows(1, seed=1), *packed_rows(STEPS - 1, seed=1)]}
    results = run(train_recording, 2, None, rows, timeout=300)
    for _, _, called in results:
        assert called == ["loss", "loss_packed", "loss_packed", "loss_packed", "loss_packed"]
