"""Writing weights as a Hugging Face checkpoint, streamed: SafeTensors files of at
most `max_shard_size` (with model.safetensors.index.json when there are several)
and the config.json that `transformers.AutoModelForCausalLM.from_pretrained`
needs. Each tensor is written as it arrives and dropped, so a 70B model never
sits in memory whole; the files appear in the folder only once all are complete.
Every file records the save that wrote it (SAVE_KEY in its metadata), so that a
folder whose files come from two saves is found (linnet.hf.read refuses it).

    write_hf_checkpoint(card, {name: shape, ...}, iter([(name, tensor), ...]), folder, torch.bfloat16)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterable, Iterator
from math import prod
from pathlib import Path

import torch

from linnet.cards import Card
from linnet.checkpoint.storage import fsync_dir, write_synced
from linnet.errors import NotFinite
from linnet.hf.read import INDEX, SAVE_KEY

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}  # by the cards' names
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # decimal, as huggingface_hub's
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"save_weights(dtype=...) takes one of {list(_DTYPE_NAMES)}, got {dtype}")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB", "10KB" (powers of 10)."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)\s*", size, re.IGNORECASE) if isinstance(size, str) else None
    if match is None or float(match[1]) <= 0:
        raise ValueError(f"max_shard_size takes a positive number of bytes or a string such as \"5GB\", "
                         f"\"500MB\", \"10KB\"; got {size!r}")
    return int(float(match[1]) * _SIZE_UNITS[match[2].upper()])


def plan_files(sizes: dict[str, int], max_shard_size: int | str) -> list[list[str]]:
    """The tensor names of each file, in order: consecutive tensors fill a file until the next
    would pass max_shard_size; a tensor larger than that gets a file of its own.

    huggingface_hub's splitter differs in one case only: after a tensor larger than the limit it
    goes on filling the file the tensor interrupted. Keeping each file a run of consecutive tensors
    is what lets them be written one file at a time."""
    limit = parse_size(max_shard_size)
    files: list[list[str]] = []
    current, current_size = [], 0
    for name, size in sizes.items():
        if current and (size > limit or current_size + size > limit):
            files.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
        if size > limit:
            files.append(current)
            current, current_size = [], 0
    return files + [current] if current else files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def computed_config(card: Card) -> dict:
    """The card's config, and for each key it leaves to its family's default the value the model was
    computed with: transformers' own default for a missing key may differ (MistralConfig's sliding_window
    is 4096 where the card, which TOML cannot give a null, means none)."""
    checked = card.checked()
    left_out = {decl.config_key: checked.dims[decl.name] for decl in checked.program.dims.values()
                if decl.config_key is not None and decl.config_key not in card.config}
    left_out |= {decl.config_key: checked.consts[decl.name] for decl in checked.program.consts.values()
                 if decl.config_key is not None and decl.config_key not in card.config}
    return {**card.config, **left_out}


def write_hf_checkpoint(card: Card, shapes: dict[str, tuple[int, ...]], tensors: Iterable[tuple[str, torch.Tensor]],
                        folder: Path, dtype: torch.dtype, *, max_shard_size: int | str = "5GB") -> Path:
    """Writes `tensors` (name, tensor), which must arrive in the order of `shapes`, converted to dtype.

    The files are written in a temporary folder beside `folder` and moved into it when all are
    complete (`_move_into`), replacing the weight files (model*.safetensors, the index) of an earlier
    save there; other files in `folder` stay. If anything fails before that, nothing is left behind
    and the error, a RuntimeError, names `folder`; a tensor holding inf or nan fails it so (NotFinite)."""
    check_dtype(dtype)
    folder = Path(folder)
    itemsize = dtype.itemsize
    sizes = {name: prod(shape) * itemsize for name, shape in shapes.items()}
    plan = plan_files(sizes, max_shard_size)
    names = _file_names(len(plan))
    partial = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    save = uuid.uuid4().hex
    try:
        shutil.rmtree(partial, ignore_errors=True)  # what a crashed process of the same id left
        partial.mkdir(parents=True)
        arriving = iter(tensors)
        for name, in_file in zip(names, plan):
            _write_file(partial / name, {n: shapes[n] for n in in_file}, arriving, dtype, save)
        extra = next(arriving, None)
        if extra is not None:
            raise ValueError(f"got {extra[0]} after the last of the {len(shapes)} planned tensors")
        if len(plan) > 1:
            totals = {"total_parameters": sum(prod(s) for s in shapes.values()), "total_size": sum(sizes.values())}
            index = {"metadata": {**totals, SAVE_KEY: save},
                     "weight_map": {n: file for file, in_file in zip(names, plan) for n in in_file}}
            write_synced(partial / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
        # Both names transformers has read the weights' dtype by, whatever the source's config said.
        config = {**computed_config(card), "torch_dtype": _DTYPE_NAMES[dtype], "dtype": _DTYPE_NAMES[dtype]}
        write_synced(partial / "config.json", json.dumps(config, indent=2) + "\n")
        _write_tokenizer_and_generation_config(card, partial)
        _move_into(folder, partial)
    except NotFinite as error:
        raise NotFinite(f"no weights are written to {folder} (it keeps what it held): {error}") from error
    except Exception as error:
        raise RuntimeError(f"writing the weights to {folder} failed: {type(error).__name__}: {error}") from error
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _write_file(path: Path, shapes: dict[str, tuple[int, ...]], tensors: Iterator[tuple[str, torch.Tensor]],
                dtype: torch.dtype, save: str) -> None:
    """One SafeTensors file: the header (every offset is known from the shapes), then each tensor's bytes."""
    header: dict = {"__metadata__": {"format": "pt", SAVE_KEY: save}}
    offset, itemsize = 0, dtype.itemsize
    for name, shape in shapes.items():
        end = offset + prod(shape) * itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for expected, shape in shapes.items():
            name, tensor = next(tensors, (None, None))
            if name is None:
                raise ValueError(f"the tensors ended before {expected}, {tuple(shape)}")
            if name != expected or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"expected {expected} of shape {tuple(shape)} next, "
                                 f"got {name} of shape {tuple(tensor.shape)}")
            data = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
            if data.is_floating_point() and not torch.isfinite(data).all():
                raise NotFinite(f"{name} holds inf or nan in {_DTYPE_NAMES[dtype]}")
            f.write(data.reshape(-1).view(torch.uint8).numpy().data)
            del tensor, data  # before the next arrives: a gathered group's buffer goes with its last view
        f.flush()
        os.fsync(f.fileno())


# Tokens that end a turn or a text in the shipped families' chat templates (Llama 3, Qwen, Mistral).
END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "</s>")


def _write_tokenizer_and_generation_config(card: Card, partial: Path) -> None:
    """What makes a weights folder a model that AutoTokenizer, generate and serving engines take as it is: the
    card's tokenizer (its files and chat template) and generation_config.json, the source's where it has one,
    else one whose eos_token_id holds every token that ends a turn in the tokenizer. Where the card has no
    tokenizer to load, a warning says so and the folder holds the weights and their config alone."""
    import warnings

    from transformers import AutoTokenizer, GenerationConfig

    source = card.weights.repo
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        warnings.warn(f"linnet: no tokenizer written beside the weights: {card.name}'s {source!r} has none to load "
                      f"({str(error).splitlines()[0]})")
        tokenizer = None
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    try:
        generation = GenerationConfig.from_pretrained(source)
    except (OSError, ValueError):
        generation = _generation_config(card, tokenizer)
    generation.save_pretrained(partial)


def _generation_config(card: Card, tokenizer):
    """Generation settings from the card's config and its tokenizer: its end-of-turn tokens stop generation."""
    from transformers import GenerationConfig

    configured = card.config.get("eos_token_id")
    ends = [] if configured is None else list(configured) if isinstance(configured, list) else [configured]
    if tokenizer is not None:
        vocabulary = tokenizer.get_vocab()
        ends += [tokenizer.eos_token_id] + [vocabulary[token] for token in END_TOKENS if token in vocabulary]
    ends = list(dict.fromkeys(end for end in ends if end is not None))
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    return GenerationConfig(bos_token_id=card.config.get("bos_token_id"), pad_token_id=pad,
                            eos_token_id=ends[0] if len(ends) == 1 else ends or None)


def _move_into(folder: Path, partial: Path) -> None:
    """Moves the finished files in, the index and the config last, then removes the weight files of an
    earlier save that they did not replace. Until the removal a reader finds a whole save: transformers
    takes model.safetensors before an index, and an earlier save's files stay until the new ones are in.
    Where the two saves share file names, a crash among the renames (a moment, after minutes of
    writing) leaves some files of each: each file names its save, and linnet.hf.read refuses the mix."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {path.name for path in partial.iterdir()}
    # The weight files first, then the tokenizer and generation config, the index and the config last.
    for name in sorted(written, key=lambda n: (n == "config.json", n == INDEX, not _WEIGHT_FILE.fullmatch(n))):
        os.replace(partial / name, folder / name)
    for stale in folder.iterdir():
        if _WEIGHT_FILE.fullmatch(stale.name) and stale.name not in written and stale.is_file():
            stale.unlink()
    fsync_dir(folder)
