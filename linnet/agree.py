"""Errors that one rank finds reach every rank, so that no rank is left
waiting in a collective for a rank that has stopped.

    together(lambda: torch.save(state, path), f"write {path}")   # each rank its file
    first_rank_does(lambda: write(folder), "write the weights")     # called by every rank

runs the action on this rank (or, with first_rank_does, on the first only), then every rank learns (one all-gather) whether
any rank failed: the failing ranks raise their own exception, the others a
RuntimeError that names the failing ranks and their messages. A training loop
that already all-reduces each step counts its problems in that all-reduce and
calls `raise_together` (no collective unless something failed)."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _messages(problem: str | None) -> list[str | None]:
    if _world() == 1:
        return [problem]
    messages: list[str | None] = [None] * _world()
    dist.all_gather_object(messages, problem)
    return messages


def _describe(messages: list[str | None]) -> str:
    return "; ".join(f"rank {rank}: {message}" for rank, message in enumerate(messages) if message)


def together(action: Callable[[], T], what: str) -> T | None:
    """action() on this rank (None where a rank has nothing to do: pass a no-op), agreed by all."""
    try:
        result, error = action(), None
    except Exception as raised:  # noqa: BLE001  (every failure must reach the other ranks)
        result, error = None, raised
    messages = _messages(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if any(messages):
        raise RuntimeError(f"could not {what}: {_describe(messages)}")
    return result


def first_rank_does(action: Callable[[], T], what: str) -> T | None:
    """action() on the first rank alone, agreed by all: every rank must call it."""
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return together(action if first else (lambda: None), what)


def raise_together(problem: str | None, ranks_with_problems: float, error: type[Exception] = ValueError) -> None:
    """Every rank raises `error` with every rank's message when any rank found a problem (counted
    in an all-reduce that they all ran); nothing happens, and nothing is sent, otherwise."""
    if ranks_with_problems:
        raise error(_describe(_messages(problem)))
