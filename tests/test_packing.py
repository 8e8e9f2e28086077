"""Packing: whole documents, best fit, the long-document rule, zero-weight padding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from linnet.cardlang.parse import parse_program
from linnet.data.packing import LOSS_PACKED_INPUTS, Example, fill_ratio, pack, stack_rows

pytestmark = pytest.mark.quick

DATA = Path(__file__).parents[1] / "examples" / "sft" / "data" / "tasks.jsonl"


def examples(count: int, seed: int = 0, longest: int = 40) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(1, 100) for _ in range(rng.randrange(1, longest))]
        answer = [rng.randrange(1, 100) for _ in range(rng.randrange(1, longest))]
        out.append(Example.prompted(prompt, answer))
    return out


def documents(row) -> list[list[int]]:
    """The documents of a row, by segment, padding left out."""
    out = []
    for segment in np.unique(row.segments):
        span = row.segments == segment
        if row.weights[span].any() or segment < row.segments.max():
            out.append(row.tokens[span].tolist())
    return out


def test_prompted_weights_only_the_answer():
    example = Example.prompted([1, 2, 3], [4, 5])
    (row,) = pack([example], 8)
    assert row.tokens.tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert row.targets[:4].tolist() == [2, 3, 4, 5]
    assert row.weights.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]  # predicting 4 and 5; nothing after 5, nor in padding
    assert row.positions[:5].tolist() == [0, 1, 2, 3, 4] and row.segments.tolist() == [0] * 5 + [1] * 3
    assert row.filled == 5


def test_text_weights_every_next_token():
    (row,) = pack([Example.text([7, 8, 9])], 4)
    assert row.weights.tolist() == [1, 1, 0, 0]


def test_rows_are_exact_whole_and_deterministic():
    items = examples(300)
    rows = list(pack(items, 128))
    assert all(len(r.tokens) == 128 for r in rows)
    packed = sorted(tuple(d) for r in rows for d in documents(r))
    assert packed == sorted(tuple(e.tokens) for e in items)  # every document once, never split
    for row in rows:  # positions restart at each document
        for segment in np.unique(row.segments[: row.filled]):
            positions = row.positions[row.segments == segment]
            assert positions.tolist() == list(range(len(positions)))
    again = list(pack(iter(items), 128))  # a generator gives the same rows
    assert all((a.tokens == b.tokens).all() and (a.segments == b.segments).all() for a, b in zip(rows, again))
    assert fill_ratio(rows) > 0.95


def test_a_document_longer_than_a_row_is_cut_into_row_sized_pieces():
    long = Example.text(list(range(1, 24)))
    rows = list(pack([long, Example.text([50, 51])], 10))
    pieces = [r for r in rows if r.tokens[0] in (1, 11, 21)]
    assert [p.tokens[: p.filled].tolist() for p in pieces][:2] == [list(range(1, 11)), list(range(11, 21))]
    assert pieces[1].positions[:10].tolist() == list(range(10, 20))  # positions keep counting
    assert pieces[0].targets[9] == 11 and pieces[0].weights[9] == 1  # the cut still predicts the next piece


def test_padding_never_carries_weight():
    rows = list(pack(examples(50, longest=20), 64))
    for row in rows:
        assert not row.weights[row.filled:].any()
        assert (row.segments[row.filled:] == row.segments.max()).all()


def test_fill_on_the_example_data():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[1] / "linnet/cards/tokenizers/tiny")
    items = []
    for line in DATA.read_text().splitlines()[:1500]:
        row = json.loads(line)
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["instruction"]}],
                                             add_generation_prompt=True, tokenize=False)
        items.append(Example.prompted(tokenizer(text, add_special_tokens=False)["input_ids"],
                                      tokenizer(row["output"] + "<|eot_id|>", add_special_tokens=False)["input_ids"]))
    assert fill_ratio(pack(items, 512)) > 0.97  # measured 0.98 on the full file


def test_bad_input():
    with pytest.raises(ValueError, match="needs a prompt and an answer"):
        Example.prompted([], [1])
    with pytest.raises(TypeError, match="pack takes Example objects"):
        list(pack([[1, 2, 3]], 8))
    with pytest.raises(ValueError, match="an Example of 3 tokens needs 2 weights .* got 3"):
        Example((5, 6, 7), (1.0, 1.0, 1.0))  # one a token: the last would weigh a prediction of padding
    with pytest.raises(ValueError, match="needs 2 weights .* got 1"):
        Example([5, 6, 7], [1.0])
    assert Example([5, 6, 7], [0.0, 1.0]) == Example((5, 6, 7), (0.0, 1.0))  # lists are taken as tuples
    with pytest.raises(ValueError, match="at least one open row"):
        list(pack(examples(3), 8, open_rows=0))


@pytest.mark.parametrize("arch", sorted((Path(__file__).parents[1] / "linnet" / "cards").glob("*.arch")),
                         ids=lambda p: p.stem)
def test_the_rows_fields_are_in_the_order_every_shipped_loss_packed_takes(arch):
    program = parse_program(arch.read_text(), str(arch))
    assert [param.name for param in program.functions["loss_packed"].params] == list(LOSS_PACKED_INPUTS)


def test_stacked_rows_are_the_rows_fields_one_row_a_line():
    rows = list(pack(examples(60), 32))[:3]
    stacked = stack_rows(rows)
    for name, array in zip(LOSS_PACKED_INPUTS, stacked):
        assert array.shape == (3, 32)
        for line, row in zip(array, rows):
            np.testing.assert_array_equal(line, getattr(row, name))
    with pytest.raises(ValueError, match="at least one row"):
        stack_rows([])

