"""User errors: mistakes in what a user gives linnet (a command line, a card, a data file), which a
command reports as one line from the first process, without a traceback, and ends with exit status 2.
Any other exception is a bug, and keeps its traceback.

    from linnet.errors import ArgumentParser, UserError, exit_on_user_error

    exit_on_user_error()                        # at the top of a script
    parser = ArgumentParser(...)                 # its mistakes are user errors too
    raise UserError(f"{path}:{line}: the row has no 'output'")

Which exceptions count, deliberately: `UserError` and its subclasses, which keep their own base too: the
card language's `CardError` (a mistake in a card, `path:line: message`) and `GenericsError` (generics
that do not match a card); and the checkpoint folder's `FolderInUse` (another run holds it),
`DamagedCheckpoints` (every checkpoint in it is damaged) and `StorageError` (an OSError: it is not a
directory, read-only or full), each of which says what to do. A plain
ValueError, KeyError or RuntimeError is not one: raised deep inside, it may be a bug, and its traceback
is the clue. Under torchrun every rank finds the same mistake (they read the same options and files); the
first says it and exits, the others wait silently until torchrun stops them, and torchrun adds its
summary. A mistake that one rank alone finds (the first takes the checkpoint folder) reaches the others
through linnet.torch.agree as a UserError naming it, so that it stays one line there too."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

__all__ = ["NotFinite", "positive_number", "non_negative_number", "ArgumentParser", "UserError",
           "at_least", "exit_on_user_error", "first_process"]

EXIT_STATUS = 2  # as argparse's usage errors
FIRST_SPEAKS_WITHIN = 15.0  # seconds another rank waits for the first to report the same mistake


class UserError(ValueError):
    """A mistake in what the user gave, whose message says what, where and what to do. A ValueError, so
    that code catching ValueError for bad input catches it too."""


class NotFinite(UserError):
    """A training step whose loss, or whose weights or optimizer state after its update, are inf or nan (a
    learning rate too large, data that overflows, a diverging run): training stops at that step on every
    rank and saves nothing that holds it, so a checkpoint folder keeps resuming from the last good step."""


def first_process() -> bool:
    """Whether this process is the one that speaks: rank 0 of torch.distributed (or of torchrun's RANK
    before the process group exists), or a process alone."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def exit_on_user_error(prefix: str = "error") -> None:
    """From now on, a user error that reaches the top of the program prints `prefix: message` on the first
    process, ends the process group if there is one, and exits with status 2 at once, without a
    traceback; another rank waits to be stopped first (see _let_the_first_speak). Other exceptions go on
    to the hook that was there (the traceback)."""
    previous = sys.excepthook

    def hook(kind, error, traceback):
        if not isinstance(error, UserError):
            return previous(kind, error, traceback)
        if first_process():
            _say(f"{prefix}: {error}")
        else:
            _let_the_first_speak(f"{prefix} (rank {os.environ.get('RANK')}): {error}")
        _end_process_group()
        sys.stdout.flush()
        os._exit(EXIT_STATUS)  # now: no waiting on other ranks, threads or exit handlers

    sys.excepthook = hook


def _let_the_first_speak(line: str) -> None:
    """torchrun stops every process as soon as one exits, so a rank that exited at once could end the
    run before the first has said what went wrong. So the others wait: torchrun stops them when the
    first exits (they then exit with the same status); if it has not within FIRST_SPEAKS_WITHIN, the
    first found no such mistake, and this rank says it."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_STATUS))
    time.sleep(FIRST_SPEAKS_WITHIN)
    _say(line)


def _say(line: str) -> None:
    """To the process's own stderr: init_process_group's hook points sys.stderr at a buffer that it
    writes out only after the hook it wraps (this one, which does not return) returns."""
    stderr = sys.__stderr__ or sys.stderr
    stderr.write(line + "\n")
    stderr.flush()


def _end_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # exiting anyway: the user's message has been said
            dist.destroy_process_group()


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are UserErrors (one line, see exit_on_user_error) rather than a
    usage message from every rank, and whose help the first process alone prints."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")

    def print_help(self, file=None) -> None:
        if first_process():
            super().print_help(file)


def at_least(minimum: int):
    """An argparse `type`: a whole number of at least `minimum`, or a message that says so."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return whole_number


def positive_number(text: str) -> float:
    """An argparse `type`: a finite number above zero (a learning rate), or a message that says so."""
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def non_negative_number(text: str) -> float:
    """An argparse `type`: a finite number of at least zero (a norm, where 0 turns clipping off)."""
    value = _number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
