"""The card language: architecture programs parsed with `ast` (never executed),
checked for shapes and dtypes with named dimensions, then handed to the emitters."""

from linnet.cardlang.errors import CardError
from linnet.cardlang.program import Program
from linnet.cardlang.check import check_program
from linnet.cardlang.parse import parse_program

__all__ = ["CardError", "Program", "check_program", "parse_program"]
