"""What a user gives the fine-tuning examples, checked before the first step, so that a mistake costs
seconds rather than a run: the rows of a JSON-lines file or of a `datasets` data set saved to disk
(chat `messages`, `prompt`/`completion` or alpaca rows, linnet.data.chat; read with errors that name
the file, the line and what is wrong), the held-out split, enough packed rows for the steps asked for,
the warm-up, and the folder the trained weights go to.

    rows = data_rows("data/tasks.jsonl")                 # shuffled (seed 0), at most 8400
    training, held_out = split_held_out(rows, 200, "data/tasks.jsonl")
    example = example_maker(tokenizer)                   # a row as an Example (linnet.data.chat)
    batches = rows_for_run(pack(map(example, training), 4096), steps=30, ranks=world, checkpoint="ckpt")

Every check raises a `linnet.errors.UserError`, whose message names the examples' options (--held-out,
--steps, --tokens, --warmup, --out) where one of them is what to change."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np

from linnet.checkpoint import storage
from linnet.checkpoint.folder import newest_manifest
from linnet.data import chat
from linnet.data.chat import ROW_FORMATS, check_row
from linnet.errors import UserError
from linnet.data.packing import Example, Row

__all__ = ["check_chat_template", "check_out_folder", "check_resume", "data_rows", "enough_held_out", "example_maker",
           "lr_floor", "metrics_path", "read_rows", "rows_for_run", "split_held_out", "warmup_steps"]

ALPACA = "tatsu-lab/alpaca"
T = TypeVar("T")


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON-lines file, one JSON object a line (blank lines skipped), or of a `datasets` data set
    saved to disk (a folder; its "train" split where it has several), each checked by chat.check_row."""
    if Path(path).is_dir():
        return _dataset_rows(Path(path))
    rows = []
    try:
        with open(path, "rb") as file:
            for number, line in enumerate(file, 1):
                text = _decoded(line, path, number)
                if text.strip():
                    rows.append(_row(text, path, number))
    except OSError as error:
        raise UserError(f"cannot read the data file {path}: {error.strerror or error}") from None
    if not rows:
        raise UserError(f"{path} holds no rows: give one row a line, each {ROW_FORMATS}")
    return rows


def _dataset_rows(folder: Path) -> list[dict]:
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(folder))
    except (OSError, ValueError) as error:
        raise UserError(f"--data {folder} is a folder, but not a data set that datasets' save_to_disk wrote "
                        f"({str(error).splitlines()[0]}): give a JSON-lines file or such a folder") from None
    if isinstance(data, DatasetDict):
        if "train" not in data:
            raise UserError(f"--data {folder} holds the splits {', '.join(data)}, and no 'train' split to train on")
        data = data["train"]
    if not len(data):
        raise UserError(f"{folder} holds no rows: each row is {ROW_FORMATS}")
    try:
        return [check_row(row, f"{folder} row {index + 1}") for index, row in enumerate(data.to_list())]
    except ValueError as error:
        raise UserError(str(error)) from None


def _decoded(line: bytes, path, number: int) -> str:
    try:
        return line.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{path}:{number}: not UTF-8 text (byte {line[error.start]:#04x} at column "
                        f"{error.start + 1}): save the file as UTF-8") from None


def _row(text: str, path, number: int) -> dict:
    try:
        row = json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as error:
        raise UserError(f"{path}:{number}: not valid JSON ({error.msg}, column {error.colno}): "
                        f"each line is {ROW_FORMATS}") from None
    try:
        return check_row(row, f"{path}:{number}")
    except ValueError as error:
        raise UserError(str(error)) from None


def data_rows(path: str | None, *, seed: int = 0, most: int = 8400) -> list[dict]:
    """Up to `most` rows of `path` (None: the Hugging Face hub's tatsu-lab/alpaca) in a shuffled order:
    the order `datasets`' shuffle(seed) gives, so a run sees the rows it saw when it read them that way."""
    if path is None:
        from datasets import load_dataset

        try:
            rows = load_dataset(ALPACA, split="train").to_list()
        except (OSError, ConnectionError, ValueError) as error:  # offline, and not in the local cache
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise UserError(f"no --data given, and the hub's {ALPACA} cannot be read ({reason}): give --data a "
                            f"JSON-lines file or a data set saved to disk, or download {ALPACA} first") from None
    else:
        rows = read_rows(path)
    order = np.random.default_rng(seed).permutation(len(rows))[:most]
    return [rows[index] for index in order]


def metrics_path(metrics: str | None, checkpoint: str | None, wandb_project: str | None) -> str | None:
    """Where the step metrics go: --metrics, else metrics.jsonl in the --checkpoint folder, else nowhere; or a
    UserError, before anything is built, for a --wandb project without wandb installed."""
    if wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise UserError(f"--wandb {wandb_project}: wandb is not installed: pip install wandb, or leave --wandb out")
    if metrics is None and checkpoint is not None:
        return os.path.join(checkpoint, "metrics.jsonl")
    return metrics


def lr_floor(floor: float) -> float:
    """--lr-floor, a fraction of --lr: at most 1, or a UserError."""
    if floor > 1:
        raise UserError(f"--lr-floor {floor} is a fraction of --lr, from 0 to 1: the learning rate at the last step "
                        f"is --lr times it")
    return floor


def example_maker(tokenizer):
    """chat.example for the rows of --data, with the tokenizer bound; a row it cannot read is a UserError."""

    def example(row: dict) -> Example:
        try:
            return chat.example(tokenizer, row)
        except ValueError as error:
            raise UserError(f"a row of --data ({_short(row)}): {error}") from None

    return example


def _short(row: dict) -> str:
    text = json.dumps(row, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def split_held_out(rows: list[T], held_out: int, source: str | None) -> tuple[list[T], list[T]]:
    """(the rows to train on, the first `held_out` rows): the held-out rows give the loss before and after."""
    if held_out >= len(rows):
        raise UserError(f"{source or ALPACA} has {len(rows)} rows, and --held-out {held_out} of them are kept for "
                        f"the held-out loss, which leaves none to train on: lower --held-out (at most "
                        f"{len(rows) - 1}) or give more rows")
    return rows[held_out:], rows[:held_out]


def rows_for_run(rows: Iterable[Row], steps: int, ranks: int, checkpoint: str | os.PathLike | None = None,
                 ranks_are: str = "processes", accumulate: int = 1) -> list[Row]:
    """The packed rows of the whole run, one stream whatever the number of ranks (rank r of this run takes
    rows[r::ranks]): those that the run `checkpoint` resumes from used already, at whatever number of ranks
    it ran, then `accumulate` a rank for each step left; packing no more than that. Or a UserError, before
    the first step, that says how many there are and what to change."""
    manifest = newest_manifest(Path(checkpoint)) if checkpoint is not None else None
    done, used = (manifest["step"], manifest["rows_consumed"]) if manifest else (0, 0)
    a_step = ranks * accumulate
    needed = used + max(0, steps - done) * a_step
    taken = list(itertools.islice(rows, needed))
    if taken and not any(row.weights.any() for row in taken):
        raise UserError(f"--tokens {len(taken[0].tokens)} leaves no answer in the packed rows: each row is a piece "
                        f"of a prompt, with nothing to learn: raise --tokens to hold at least one whole example")
    if len(taken) < needed:
        resumed = f" after the {used} that the run it resumes used (to step {done})" if used else ""
        most = (len(taken) - used) // a_step + done
        each = "one" if accumulate == 1 else f"--accumulate {accumulate}"
        raise UserError(f"--steps {steps} on {ranks} {ranks_are} takes {needed} packed rows ({each} a step on each"
                        f"{resumed}), but the training rows pack into {_rows(taken)}: lower --steps (to "
                        f"{max(most, 0)} at most), lower --tokens, or give more rows")
    return taken


def check_resume(checkpoint: str | os.PathLike | None, card_name: str, steps: int) -> None:
    """Before anything is built: a run that would resume from `checkpoint` is of the same card, and asks for
    at least the steps its newest checkpoint has taken (what the training loop refuses, once compiled)."""
    manifest = newest_manifest(Path(checkpoint)) if checkpoint is not None else None
    if manifest is None:
        return
    if manifest.get("card") not in (None, card_name):
        raise UserError(f"--checkpoint {checkpoint} holds a run of {manifest['card']}, not of --card {card_name}: "
                        f"resume it with --card {manifest['card']}, or point --checkpoint at another folder")
    if manifest["step"] > steps:
        raise UserError(f"--checkpoint {checkpoint} is at step {manifest['step']}, past --steps {steps}: give "
                        f"--steps {manifest['step']} or more to resume it, or point --checkpoint at another folder")


def check_chat_template(tokenizer, card_name: str) -> None:
    """The examples write each row as a chat: the card's tokenizer must have a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{card_name}'s tokenizer has no chat template, and the examples write each row as a "
                        f"chat: use an instruct card, or a tokenizer folder whose tokenizer_config.json has one")


def enough_held_out(rows: Iterable[Row], ranks: int, held_out: int) -> list[Row]:
    """The packed held-out rows, at least one for each of `ranks` (each evaluates its own); or a UserError."""
    rows = list(rows)
    if len(rows) < ranks:
        raise UserError(f"--held-out {held_out}: the held-out rows pack into {_rows(rows)}, fewer than the "
                        f"{ranks} processes, each of which evaluates at least one: raise --held-out")
    return rows


def _rows(rows: list[Row]) -> str:
    return f"{len(rows)} rows of --tokens {len(rows[0].tokens)}" if rows else "none"


def warmup_steps(warmup: int | None, steps: int, default: int = 3) -> int:
    """The steps of linear warm-up: `warmup` if given, else `default` or fewer, always fewer than `steps`
    (the learning rate then decays over the rest)."""
    if warmup is None:
        return min(default, steps - 1)
    if not 0 <= warmup < steps:
        raise UserError(f"--warmup {warmup} must be less than --steps {steps}: the learning rate rises over the "
                        f"warm-up and decays over the steps after it; lower --warmup or raise --steps")
    return warmup


def check_out_folder(path: str | os.PathLike | None, card=None) -> None:
    """Raises unless the trained weights can be written to the folder `path` (None: nothing to check):
    it is a folder or can be made one, it and the folder beside it, where the files are first
    written, take a new file, and, given the `card` (a name, path or Card), its disk has room for the
    card's weights in bf16. Under torch.distributed the first rank checks (it alone writes), and
    every rank raises what it found, so that all stop together before the first step."""
    if path is None:
        return
    needed = None if card is None else _bf16_bytes(card)
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return _check_out_folder(Path(path), needed)
    from linnet.torch.agree import cpu_group

    problem = [None]
    if dist.get_rank() == 0:
        try:
            _check_out_folder(Path(path), needed)
        except UserError as error:
            problem = [str(error)]
    dist.broadcast_object_list(problem, src=0, group=cpu_group())
    if problem[0] is not None:
        raise UserError(problem[0])


def _bf16_bytes(card) -> int:
    import math

    from linnet import nest
    from linnet.hf.read import weight_specs

    return 2 * sum(math.prod(spec.shape) for spec in weight_specs(nest.resolve(card).checked()))


def _check_out_folder(folder: Path, needed: int | None = None) -> None:
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out {folder} is a file, not a folder: give a folder for the trained weights")
    # The files are written in a folder made beside `folder`, then moved in: both places must take a file.
    for place in (folder.parent, folder):
        existing = next(p for p in itertools.chain([place], place.parents) if p.exists())
        if not existing.is_dir():
            raise UserError(f"--out {folder} cannot be made: {existing} is a file, not a folder")
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as error:
            raise UserError(f"--out {folder} cannot be written: {existing} does not take a new file "
                            f"({error.strerror or error}); give a folder you can write to") from None
    if needed is not None and storage.free_space(folder) < needed:
        raise UserError(f"--out {folder}: no space left for the trained weights: they need {storage.gb(needed)} "
                        f"in bf16, "
                        f"and {storage.gb(storage.free_space(folder))} is free there; free some or give another folder")
