"""Errors a card author can make, each naming the card file and line."""

from __future__ import annotations

from linnet.errors import UserError


class CardError(UserError):
    """A mistake in a card: `path:line: message`."""

    def __init__(self, path: str, line: int | None, message: str):
        self.path, self.line, self.message = path, line, message
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")


class GenericsError(UserError):
    """Generics passed at load that do not match what the card declares."""
