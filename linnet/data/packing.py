"""Packing examples into rows of a fixed number of positions.

    rows = pack((Example.prompted(prompt, answer) for ...), 4096)

Each row holds whole documents side by side: tokens, the next token to
predict at each position (targets), positions that restart at each document,
segment ids (attention never crosses a segment) and per-position loss weights.

Rules:
- best fit: each example goes into the open row it fills most tightly; up to
  `open_rows` rows stay open, and when one more is needed the fullest is
  emitted. Deterministic: the same examples in the same order give the same rows.
- a document that fits in a row is never split;
- a document longer than a row is cut into pieces of one row each (the last
  piece packed like any example); positions keep counting across its pieces,
  and a piece's last target is the next piece's first token;
- padding has token `pad`, weight 0 and a segment of its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

__all__ = ["LOSS_PACKED_INPUTS", "Example", "Row", "fill_ratio", "pack", "stack_rows"]


@dataclass(frozen=True)
class Example:
    """One document: its tokens and the loss weight on predicting each next token."""

    tokens: tuple[int, ...]
    weights: tuple[float, ...]  # weights[t]: the weight of predicting tokens[t + 1]; len(tokens) - 1 of them

    def __post_init__(self) -> None:
        # As tuples (a list would pass here and fail in pack), and one weight a predicted token: with one a
        # token, the last would weigh a prediction of the padding that follows the document.
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "weights", tuple(self.weights))
        if len(self.weights) != len(self.tokens) - 1:
            raise ValueError(f"an Example of {len(self.tokens)} tokens needs {len(self.tokens) - 1} weights (one a "
                             f"predicted next token), got {len(self.weights)}")

    @staticmethod
    def prompted(prompt: Iterable[int], answer: Iterable[int]) -> Example:
        """A prompt and its answer: the loss is on the answer's tokens only."""
        prompt, answer = tuple(prompt), tuple(answer)
        if not prompt or not answer:
            raise ValueError(f"Example.prompted needs a prompt and an answer, "
                             f"got {len(prompt)} and {len(answer)} tokens")
        weights = (0.0,) * (len(prompt) - 1) + (1.0,) * len(answer)
        return Example(prompt + answer, weights)

    @staticmethod
    def text(tokens: Iterable[int]) -> Example:
        """Plain text: the loss is on every next token."""
        tokens = tuple(tokens)
        if len(tokens) < 2:
            raise ValueError(f"Example.text needs at least two tokens, got {len(tokens)}")
        return Example(tokens, (1.0,) * (len(tokens) - 1))

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Row:
    """One packed row, each field of shape (positions,)."""

    tokens: np.ndarray  # int32
    targets: np.ndarray  # int32
    positions: np.ndarray  # int32
    segments: np.ndarray  # int32
    weights: np.ndarray  # float32
    filled: int  # positions that hold documents; the rest is padding

    def is_one_document(self) -> bool:
        """Whether one document fills the row from its first position: then its packed loss is the
        plain causal loss (no document mask, positions from 0)."""
        return bool((self.segments == self.segments[0]).all()
                    and (self.positions == np.arange(len(self.positions))).all())

    def check_ids(self, vocab: int, where: str) -> None:
        """Raises if a token or target is not an id of a vocabulary of `vocab` (an embedding would
        read past its table: an error on one device, NaN or garbage on another)."""
        for name in ("tokens", "targets"):
            ids = getattr(self, name)
            bad = np.flatnonzero((ids < 0) | (ids >= vocab))
            if bad.size:
                raise ValueError(f"{where}: {name}[{bad[0]}] = {ids[bad[0]]} is not a token id of the model, "
                                 f"whose vocabulary has {vocab}")


LOSS_PACKED_INPUTS = ("tokens", "targets", "positions", "segments", "weights")
"""A row's fields in the order the `loss_packed` entry takes them."""


def stack_rows(rows: Sequence[Row]) -> list[np.ndarray]:
    """Rows as the `loss_packed` entry takes them: each of LOSS_PACKED_INPUTS stacked, (rows, positions)."""
    if not rows:
        raise ValueError("stack_rows needs at least one row")
    return [np.stack([getattr(row, name) for row in rows]) for name in LOSS_PACKED_INPUTS]


@dataclass
class _Piece:
    tokens: tuple[int, ...]
    targets: tuple[int, ...]
    weights: tuple[float, ...]
    first_position: int


@dataclass
class _OpenRow:
    order: int
    pieces: list[_Piece] = field(default_factory=list)
    used: int = 0


def pack(examples: Iterable[Example], tokens: int, *, pad: int = 0, open_rows: int = 64) -> Iterator[Row]:
    """Rows of exactly `tokens` positions from `examples` (a list or a generator)."""
    if tokens < 2:
        raise ValueError(f"a row needs at least 2 positions, got {tokens}")
    if open_rows < 1:
        raise ValueError(f"pack needs at least one open row, got open_rows={open_rows}")
    rows: list[_OpenRow] = []
    opened = 0
    for example in examples:
        if not isinstance(example, Example):
            raise TypeError(f"pack takes Example objects (Example.prompted, Example.text), "
                            f"got {type(example).__name__}")
        for piece in _pieces(example, tokens):
            size = len(piece.tokens)
            fits = [row for row in rows if row.used + size <= tokens]
            if fits:
                row = min(fits, key=lambda r: (tokens - r.used - size, r.order))
            else:
                if len(rows) == open_rows:
                    fullest = max(rows, key=lambda r: (r.used, -r.order))
                    rows.remove(fullest)
                    yield _build(fullest, tokens, pad)
                row = _OpenRow(opened)
                opened += 1
                rows.append(row)
            row.pieces.append(piece)
            row.used += size
    for row in sorted(rows, key=lambda r: r.order):
        yield _build(row, tokens, pad)


def _pieces(example: Example, tokens: int) -> Iterator[_Piece]:
    targets = example.tokens[1:] + (0,)
    weights = example.weights + (0.0,)  # the last token predicts nothing
    for start in range(0, len(example), tokens):
        end = min(start + tokens, len(example))
        yield _Piece(example.tokens[start:end], targets[start:end], weights[start:end], start)


def _build(row: _OpenRow, tokens: int, pad: int) -> Row:
    out = Row(
        tokens=np.full(tokens, pad, np.int32),
        targets=np.zeros(tokens, np.int32),
        positions=np.zeros(tokens, np.int32),
        segments=np.full(tokens, len(row.pieces), np.int32),
        weights=np.zeros(tokens, np.float32),
        filled=row.used,
    )
    start = 0
    for segment, piece in enumerate(row.pieces):
        span = slice(start, start + len(piece.tokens))
        out.tokens[span] = piece.tokens
        out.targets[span] = piece.targets
        out.positions[span] = np.arange(piece.first_position, piece.first_position + len(piece.tokens))
        out.segments[span] = segment
        out.weights[span] = piece.weights
        start += len(piece.tokens)
    return out


def fill_ratio(rows: Iterable[Row]) -> float:
    """The share of positions that hold documents."""
    rows = list(rows)
    return sum(r.filled for r in rows) / max(1, sum(len(r.tokens) for r in rows))
