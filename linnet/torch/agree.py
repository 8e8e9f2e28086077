"""Errors that one rank finds reach every rank, so that no rank is left
waiting in a collective for a rank that has stopped.

    together(lambda: torch.save(state, path), f"write {path}")   # each rank its file
    first_rank_does(lambda: write(folder), "write the weights")     # called by every rank
    agree_on_check(lambda: check(inputs), "loss_packed()", group)   # before a sharded forward

runs the action on this rank (or, with first_rank_does, on the first only), then every rank learns
(one all-gather) whether any rank failed: the failing ranks raise their own exception, the others a
RuntimeError that names the failing ranks and their messages (a UserError
where each failing rank's was a user error, linnet.errors.UserError, so
that every rank reports it as one line). A training loop
that already all-reduces each step counts its problems in that all-reduce and
calls `raise_together` (no collective unless something failed). `agree_on_check`
is the cheap one for every call: one all-reduce of one integer, and the
messages only when a check failed; then every rank raises the same error.

Agreements travel on the CPU, over Gloo (`cpu_group`): the group itself where
it already takes CPU tensors, otherwise a Gloo group of its ranks made once. So
they cost no GPU synchronisation, and a rank that waits in one while another
writes a file is not bound by a short NCCL timeout; a peer that dies ends them
at once (its sockets close)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from linnet.errors import NotFinite, UserError

T = TypeVar("T")

# group name -> (the group, the Gloo group of its ranks). Names come again after destroy_process_group
# and a new init: a group made for an earlier group of that name is not this one's.
_CPU_GROUPS: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
# raised again by name
_KINDS = {kind.__name__: kind for kind in (ValueError, TypeError, RuntimeError, UserError, NotFinite)}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _group(group: dist.ProcessGroup | str | None) -> dist.ProcessGroup:
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group or dist.group.WORLD


def cpu_group(group: dist.ProcessGroup | str | None = None) -> dist.ProcessGroup:
    """A group of `group`'s ranks (default: every rank) that takes CPU tensors: `group` itself
    where it does (Gloo, or "cpu:gloo,cuda:nccl"), else a Gloo group made on the first call,
    which every rank of `group` must make at the same point (any collective call is one)."""
    group = _group(group)
    if torch.device("cpu") in group._device_types:
        return group
    made = _CPU_GROUPS.get(group.group_name)
    if made is None or made[0] is not group:
        ranks = dist.get_process_group_ranks(group)
        made = _CPU_GROUPS[group.group_name] = (
            group, dist.new_group(ranks, backend="gloo", use_local_synchronization=True))
    return made[1]


def _messages(problem, group: dist.ProcessGroup | str | None = None) -> list:
    """Every rank's `problem` (anything picklable: None for none), in rank order."""
    if _world() == 1:
        return [problem]
    group = cpu_group(group)
    messages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, problem, group=group)
    return messages


def _describe(messages: list[str | None]) -> str:
    return "; ".join(f"rank {rank}: {message}" for rank, message in enumerate(messages) if message)


def _kind(error: Exception) -> str:
    """The name the other ranks know `error` by: its own where they know that kind (a NotFinite), UserError for
    any other user error (a FolderInUse, a CardError: linnet.errors.UserError), so that it stays one on every
    rank; otherwise its own."""
    if type(error).__name__ in _KINDS:
        return type(error).__name__
    return UserError.__name__ if isinstance(error, UserError) else type(error).__name__


def together(action: Callable[[], T], what: str, group: dist.ProcessGroup | str | None = None) -> T | None:
    """action() on this rank (None where a rank has nothing to do: pass a no-op), agreed by every rank
    of `group` (a group or its name; default: every rank)."""
    try:
        result, error = action(), None
    except Exception as raised:  # noqa: BLE001  (every failure must reach the other ranks)
        result, error = None, raised
    problems = _messages(None if error is None else (_kind(error), f"{type(error).__name__}: {error}"), group)
    if error is not None:
        raise error
    if any(problems):
        users = all(issubclass(_KINDS.get(problem[0], Exception), UserError) for problem in problems if problem)
        message = f"could not {what}: {_describe([problem and problem[1] for problem in problems])}"
        raise UserError(message) if users else RuntimeError(message)
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


def agree_on_check(check: Callable[[], None], what: str, group: dist.ProcessGroup | str | None = None) -> None:
    """check() on every rank of `group` (a group or its name; default: every rank), which must all
    call this at the same point. If it raised on any rank, every rank raises the same error: of
    the failing ranks' type where they agree on ValueError, TypeError or RuntimeError, a UserError
    where each raised a user error (else a RuntimeError), naming each failing rank and its
    message; on a failing rank it is chained to its own exception. Costs one all-reduce of one
    integer on the CPU (Gloo: no GPU synchronisation); the messages are gathered only when a
    check failed. Under torch.compile's tracing, and in one process, only check() runs."""
    if torch.compiler.is_compiling() or not (dist.is_available() and dist.is_initialized()):
        return check()
    group = cpu_group(group)
    if dist.get_world_size(group) == 1:
        return check()
    try:
        check()
        error = None
    except Exception as raised:  # noqa: BLE001  (every failure must reach the other ranks)
        error = raised
    failed = torch.tensor([int(error is not None)], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    problems = _messages(None if error is None else (_kind(error), str(error)), group)
    kinds = {problem[0] for problem in problems if problem}
    kind = _KINDS.get(kinds.pop(), RuntimeError) if len(kinds) == 1 else RuntimeError
    agreed = kind(f"{what}: {_describe([problem and problem[1] for problem in problems])}")
    raise agreed from error
