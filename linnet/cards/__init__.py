"""Instance cards: a model's name, family, weights and numbers, in TOML.

A card names its family's architecture program (`family = "llama"` is
`llama.arch` beside the card or among the shipped ones), where its weights and
tokenizer come from (`[weights] repo`, a Hugging Face repo id or a folder
beside the card) and the numbers of its published config.json (`[config]`).

`resolve` also makes a card of a Hugging Face model folder or of a hub id in
the local Hugging Face cache (linnet/cards/huggingface.py), and takes a `Card`
held in memory as it is. A card is read afresh each time it is resolved, and
what it builds follows its own `config`, never a file read earlier."""

from __future__ import annotations

import difflib
import functools
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from linnet.cardlang import CardError, check_program, parse_program
from linnet.cardlang.check import Checked
from linnet.cards import huggingface
from linnet.errors import UserError

CARDS_DIR = Path(__file__).parent
_TOP_KEYS = {"name", "family", "weights", "config"}
_WEIGHTS_KEYS = {"repo", "init"}
# Keys of a config.json that no family computes with: generation and caching settings, bookkeeping, the
# context length a model was published with (positions past it are computed all the same), and a window
# that a family which does not read it refuses to use (Qwen's, used only with use_sliding_window).
INERT_CONFIG_KEYS = frozenset({
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "torch_dtype",
    "dtype", "transformers_version", "use_cache", "initializer_range", "pretraining_tp", "use_mrope",
    "sliding_window", "max_window_layers",
})


class UnknownCard(UserError, KeyError):
    """A card name that is neither shipped, nor a path to a .toml card or a model folder, nor a hub id in the
    local Hugging Face cache (a KeyError, as it always was)."""

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
    # the card file (config.json for a model folder): where errors point, and where a family program
    # beside it is looked for
    path: Path
    weights: Weights
    config: dict

    @property
    def program_path(self) -> Path:
        beside = self.path.parent / f"{self.family}.arch"
        return beside if beside.exists() else CARDS_DIR / f"{self.family}.arch"

    def checked(self) -> Checked:
        """The family program checked against this card's own config (not the file's, if they differ). A .toml
        card's [config] holds only keys that its family reads or INERT_CONFIG_KEYS: a misspelled key would
        otherwise leave its setting to the family's default. A model folder's config.json keeps the many keys
        transformers writes; the family refuses those it does not compute."""
        program = self.program_path
        try:
            source = program.read_text(encoding="utf-8")
        except OSError as error:
            raise CardError(str(self.path), None, f"family {self.family!r}: cannot read its program {program}: "
                                                  f"{error.strerror or error}") from None
        checked = _checked(str(program), source, json.dumps(self.config, sort_keys=True, default=repr), str(self.path))
        if self.path.suffix == ".toml":
            _check_config_keys(self, checked)
        return checked


def _check_config_keys(card: Card, checked: Checked) -> None:
    read = {decl.config_key for decl in (*checked.program.dims.values(), *checked.program.consts.values())
            if decl.config_key is not None}
    known = read | INERT_CONFIG_KEYS
    for key in card.config:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(read), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise CardError(str(card.path), _line_of(card.path, key),
                            f"[config] {key} is not a setting {Path(checked.program.path).name} reads{hint}: "
                            f"it would change nothing, and the setting meant would keep its default")


def _line_of(path: Path, key: str) -> int | None:
    """The line of a card file where `key = ...` is written, if it is found."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    return next((number for number, line in enumerate(lines, 1) if line.split("=")[0].strip() == key), None)


def shipped() -> list[str]:
    return sorted(p.stem for p in CARDS_DIR.glob("*.toml"))


def resolve(card: str | Path | Card) -> Card:
    """A card: a `Card` as it is; a shipped card's name (`llama-3.2-1b`); a path to a .toml card; a Hugging
    Face model folder (config.json and SafeTensors); or a hub id (`meta-llama/Llama-3.2-1B`) whose snapshot
    is in the local Hugging Face cache."""
    if isinstance(card, Card):
        return card
    path = Path(card)
    if path.name == str(card) and (CARDS_DIR / f"{card}.toml").exists():  # a name, not a path: ./NAME is the folder
        return _load_card(CARDS_DIR / f"{card}.toml")
    if path.suffix == ".toml":
        return _load_card(path.resolve())
    if path.is_dir():
        return _folder_card(path.resolve(), name=path.resolve().name)
    if str(card).count("/") == 1 and not path.exists() and (folder := huggingface.snapshot(str(card))):
        return _folder_card(folder, name=str(card))
    hub = (f"; {card!r} is not in the local Hugging Face cache either (download it first: "
           f"`huggingface-cli download {card}`)" if str(card).count("/") == 1 and not path.is_absolute() else "")
    raise UnknownCard(f"unknown card {card!r}{_did_you_mean(str(card))}{hub}: give a shipped card's name "
                      f"({', '.join(shipped())}), a path to a .toml card, a Hugging Face model folder, or a hub id "
                      "in the local Hugging Face cache")


def _folder_card(folder: Path, name: str) -> Card:
    config = huggingface.read_config(folder)
    family = huggingface.family_of(config, folder, CARDS_DIR)
    return Card(name, family, folder / "config.json", Weights(str(folder), None), huggingface.card_config(config))


def config_card(config: dict, name: str, weights: str | None = None) -> Card:
    """A card of a transformers model's config, as its config.json holds it (`config.to_diff_dict()`): the
    family of its model_type, its numbers translated as a model folder's are, and its weights in the folder
    `weights` (None: the model holds them)."""
    where = Path(weights) if weights else Path(name)
    family = huggingface.family_of(config, where, CARDS_DIR)
    return Card(name, family, where / "config.json", Weights(weights or "", None), huggingface.card_config(config))


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, shipped(), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
        detail = "; ".join(filter(None, [missing and f"missing {sorted(missing)}",
                                         unknown and f"unknown {sorted(unknown)}"]))
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


# Parsing and checking are cached by content (the program's source, the config as JSON), so an edited
# card or program is never served from the cache.
@functools.lru_cache(maxsize=64)
def _program(path: str, source: str):
    return parse_program(source, path)


@functools.lru_cache(maxsize=64)
def _checked(program_path: str, program_source: str, config_json: str, card_path: str) -> Checked:
    return check_program(_program(program_path, program_source), json.loads(config_json), card_path)
