"""Instance cards: a model's name, family, weights and numbers, in TOML.

A card names its family's architecture program (`family = "llama"` is
`llama.arch` beside the card or among the shipped ones), where its weights and
tokenizer come from (`[weights] repo`, a Hugging Face repo id or a folder
beside the card) and the numbers of its published config.json (`[config]`)."""

from __future__ import annotations

import difflib
import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path

from linnet.cardlang import CardError, check_program, parse_program
from linnet.cardlang.check import Checked
from linnet.errors import UserError

CARDS_DIR = Path(__file__).parent
_TOP_KEYS = {"name", "family", "weights", "config"}
_WEIGHTS_KEYS = {"repo", "init"}


class UnknownCard(UserError, KeyError):
    """A card name that is neither shipped nor a path to a .toml card (a KeyError, as it always was)."""

    __str__ = UserError.__str__  # the message, not KeyError's quoted repr of it


class MissingCardFile(UserError, FileNotFoundError):
    """A path to a .toml card with no file there (a FileNotFoundError, as it always was)."""


@dataclass(frozen=True)
class Weights:
    repo: str  # a Hugging Face repo id, or an absolute folder path for a local card
    init: str | None  # "random" for a card with no published weights


@dataclass(frozen=True)
class Card:
    name: str
    family: str
    path: Path
    weights: Weights
    config: dict

    @property
    def program_path(self) -> Path:
        beside = self.path.parent / f"{self.family}.arch"
        return beside if beside.exists() else CARDS_DIR / f"{self.family}.arch"

    def checked(self) -> Checked:
        return _checked(str(self.program_path), self.path)


def shipped() -> list[str]:
    return sorted(p.stem for p in CARDS_DIR.glob("*.toml"))


def resolve(card: str | Path | Card) -> Card:
    """A shipped card by name (`llama-3.2-1b`), or a card file by path."""
    if isinstance(card, Card):
        return card
    path = Path(card)
    if path.suffix != ".toml":
        path = CARDS_DIR / f"{card}.toml"
        if not path.exists():
            raise UnknownCard(f"unknown card {card!r}{_did_you_mean(str(card))}: the shipped cards are "
                              f"{', '.join(shipped())}; or give a path to a .toml card")
    return _load_card(path.resolve())


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, shipped(), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@functools.lru_cache(maxsize=None)
def _load_card(path: Path) -> Card:
    if not path.exists():
        raise MissingCardFile(f"no card file at {path}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise CardError(str(path), _toml_line(error), f"not valid TOML: {error}") from None
    except UnicodeDecodeError as error:
        raise CardError(str(path), None, f"not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                                         f"{error.start}): a card is a TOML file") from None
    except OSError as error:
        raise CardError(str(path), None, f"cannot read the card: {error.strerror or error}") from None
    unknown = set(data) - _TOP_KEYS
    missing = _TOP_KEYS - set(data)
    if unknown or missing:
        detail = "; ".join(filter(None, [missing and f"missing {sorted(missing)}", unknown and f"unknown {sorted(unknown)}"]))
        raise CardError(str(path), None, f"a card has exactly the keys {sorted(_TOP_KEYS)}: {detail}")
    for key, kind, described in (("name", str, "a string"), ("family", str, "a string"), ("weights", dict, "a table"),
                                 ("config", dict, "a table")):
        if not isinstance(data[key], kind):
            raise CardError(str(path), None, f"{key} must be {described}, got {data[key]!r}")
    weights = data["weights"]
    if "repo" not in weights or set(weights) - _WEIGHTS_KEYS or not isinstance(weights["repo"], str):
        raise CardError(str(path), None, f"[weights] takes repo (required, a string) and init, got {weights}")
    if weights.get("init") not in (None, "random"):
        raise CardError(str(path), None, f'[weights] init must be "random" if given, got {weights["init"]!r}')
    repo = weights["repo"]
    local = path.parent / repo
    if repo.startswith((".", "/")) or local.is_dir():
        repo = str(local.resolve())
    card = Card(data["name"], data["family"], path, Weights(repo, weights.get("init")), data["config"])
    if not card.program_path.exists():
        raise CardError(str(path), None, f"family {card.family!r} has no program: expected {card.program_path}")
    return card


def _toml_line(error: tomllib.TOMLDecodeError) -> int | None:
    text = str(error)
    marker = "(at line "
    return int(text.split(marker)[1].split(",")[0]) if marker in text else None


@functools.lru_cache(maxsize=None)
def _program(path: str):
    return parse_program(Path(path).read_text(), path)


@functools.lru_cache(maxsize=None)
def _checked(program_path: str, card_path: Path) -> Checked:
    return check_program(_program(program_path), _load_card(card_path).config, str(card_path))
