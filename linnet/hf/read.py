"""Weights under Hugging Face names: where they are, what must be there, and
reading them one tensor at a time.

A checkpoint is a folder of SafeTensors files (one `model.safetensors`, or
shards listed by `model.safetensors.index.json`), given explicitly, or found
in the local Hugging Face cache for the card's repo id without a network call.
Every name and shape is checked from the files' headers before any tensor is
read, so a wrong checkpoint fails at once and says what is wrong; so is a
folder whose files two of Linnet's saves wrote (one cut short as it moved its
files in: each records its save under SAVE_KEY).

A loaded model holds where its weights come from (`RandomWeights` or
`CheckpointWeights`) until they are first needed: whole, or, when the model is
sharded first, only this rank's part of each group (`SliceReader` reads the
rows that cover a range of a group's flat buffer, and counts the bytes)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Iterator

from linnet.cardlang.check import Checked
from linnet.cardlang.program import GroupDecl

INDEX = "model.safetensors.index.json"
SAVE_KEY = "linnet_save"  # in the metadata of each file linnet.hf.write writes, and of its index: the save


@dataclass(frozen=True)
class WeightSpec:
    """One tensor of a model: where it lives in `params` and in a checkpoint."""

    group: str  # the group's key in params ("embedding", "layers", "head")
    index: int | None  # the layer, in a repeated group
    name: str  # the weight's name in its group
    checkpoint_name: str
    shape: tuple[int, ...]
    init: str  # "normal" or "ones"


@dataclass(frozen=True)
class RandomWeights:
    """Normal(0, std) matrices and unit norms, drawn in checkpoint order from one generator seeded `seed`."""

    seed: int
    std: float


@dataclass(frozen=True)
class CheckpointWeights:
    """A checked checkpoint: each tensor name -> the file that holds it."""

    files: dict[str, Path]


def weight_specs(checked: Checked) -> list[WeightSpec]:
    """Every tensor the model owns, in checkpoint order; tied weights appear once."""
    specs = []
    for group in checked.program.groups.values():
        indices = [None] if group.repeat is None else range(checked.repeat(group.name))
        for index in indices:
            for weight in group.weights:
                if checked.is_tied(weight):
                    continue
                name = weight.checkpoint_name.format(i=index) if index is not None else weight.checkpoint_name
                specs.append(WeightSpec(group.key, index, weight.name, name, checked.weight_shape(weight), weight.init))
    return specs


def grouped(weights) -> dict:
    """(spec, tensor) pairs as a model's params: params[group][name], or params[group][layer][name]."""
    params: dict = {}
    for spec, tensor in weights:
        if spec.index is None:
            params.setdefault(spec.group, {})[spec.name] = tensor
        else:
            layers = params.setdefault(spec.group, [])
            while len(layers) <= spec.index:
                layers.append({})
            layers[spec.index][spec.name] = tensor
    return params


def group_specs(checked: Checked, specs: list[WeightSpec]) -> Iterator[tuple[GroupDecl, int | None, list[WeightSpec]]]:
    """Each group of weights in checkpoint order: (its declaration, its layer or None, its specs in flat order)."""
    by_group: dict = {}
    for spec in specs:
        by_group.setdefault((spec.group, spec.index), []).append(spec)
    for decl in checked.program.groups.values():
        for index in [None] if decl.repeat is None else range(checked.repeat(decl.name)):
            yield decl, index, by_group.get((decl.key, index), [])


def tied_names(checked: Checked) -> dict[str, str]:
    """Checkpoint names of tied weights -> the name of the weight they are."""
    groups = checked.program.groups
    out = {}
    for group in groups.values():
        for weight in group.weights:
            if checked.is_tied(weight):
                target_group, target = weight.tied_to
                out[weight.checkpoint_name] = next(w for w in groups[target_group].weights
                                                   if w.name == target).checkpoint_name
    return out


def locate(repo_or_folder: str | os.PathLike) -> Path:
    """A folder holding a checkpoint: the path itself, or the HF cache's snapshot of a repo id."""
    path = Path(repo_or_folder)
    if path.is_dir():
        return path
    if path.suffix == ".safetensors" and path.is_file():
        return path.parent
    from linnet.cards.huggingface import snapshot

    folder = snapshot(str(repo_or_folder))
    if folder is None:
        raise FileNotFoundError(
            f"no weights for {str(repo_or_folder)!r}: it is neither a folder nor a repo in the local Hugging Face "
            f"cache. Download it first (`huggingface-cli download {repo_or_folder}`), pass weights=<folder>, or "
            f"weights='random' for random weights.")
    return folder


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Each tensor name in the checkpoint -> the file that holds it."""
    index = folder / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.exists()})
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not there: {', '.join(absent)}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no SafeTensors files (*.safetensors or model.safetensors.index.json) in {folder}")
    from safetensors import safe_open

    files = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                files[name] = shard
    return files


def check_checkpoint(checked: Checked, files: dict[str, Path]) -> list[WeightSpec]:
    """Names and shapes against the card, from the headers; raises naming every difference."""
    from safetensors import safe_open

    specs = weight_specs(checked)
    expected = {s.checkpoint_name for s in specs}
    ignorable = set(tied_names(checked))  # some checkpoints store a tied head anyway
    missing = sorted(expected - set(files))
    extra = sorted(set(files) - expected - ignorable)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if extra:
        problems.append(f"not in the card {len(extra)}: {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    by_file: dict[Path, list[WeightSpec]] = {}
    for spec in specs:
        if spec.checkpoint_name in files:
            by_file.setdefault(files[spec.checkpoint_name], []).append(spec)
    saves = {}
    for file, file_specs in by_file.items():
        with safe_open(file, framework="pt") as f:
            saves[file.name] = (f.metadata() or {}).get(SAVE_KEY)
            for spec in file_specs:
                shape = tuple(f.get_slice(spec.checkpoint_name).get_shape())
                if shape != spec.shape:
                    problems.append(f"{spec.checkpoint_name} has shape {shape} in {file.name}, "
                                    f"the card expects {spec.shape}")
    folder = next(iter(files.values())).parent
    if problems:
        raise ValueError(f"the checkpoint in {folder} does not match card {checked.program.path}:\n  "
                         + "\n  ".join(problems))
    _check_one_save(folder, saves)
    return specs


def _check_one_save(folder: Path, saves: dict[str, str | None]) -> None:
    """Where Linnet wrote any of the files, one save wrote them all (and the index that lists them)."""
    if (folder / INDEX).exists():
        saves[INDEX] = json.loads((folder / INDEX).read_text()).get("metadata", {}).get(SAVE_KEY)
    if any(saves.values()) and len(set(saves.values())) > 1:
        listed = ", ".join(f"{name}: {save or 'none'}" for name, save in sorted(saves.items()))
        raise ValueError(f"the weights in {folder} come from more than one save ({SAVE_KEY} {listed}): a "
                         f"save_weights was cut short as it moved its files in. Save the weights again.")


def read_tensors(specs: list[WeightSpec], files: dict[str, Path],
                 device: str = "cpu") -> Iterator[tuple[WeightSpec, object]]:
    """Each spec with its tensor, one file open at a time, straight onto `device`."""
    from safetensors import safe_open

    by_file: dict[Path, list[WeightSpec]] = {}
    for spec in specs:
        by_file.setdefault(files[spec.checkpoint_name], []).append(spec)
    for file, file_specs in by_file.items():
        with safe_open(file, framework="pt", device=str(device)) as f:
            for spec in file_specs:
                yield spec, f.get_tensor(spec.checkpoint_name)


class SliceReader:
    """Ranges of a checkpoint's tensors, each read as the fewest whole rows that cover it
    (`safe_open(...).get_slice`); every file is opened once, and closed with the reader, and
    `bytes_read` counts what was read."""

    def __init__(self, files: dict[str, Path]):
        self.files, self.bytes_read, self._open = files, 0, {}

    def read(self, spec: WeightSpec, start: int, end: int):
        """Elements [start, end) of `spec`'s tensor, flattened, in the dtype it is stored in."""
        path = self.files[spec.checkpoint_name]
        if path not in self._open:
            from safetensors import safe_open

            self._open[path] = safe_open(path, framework="pt")
        row = prod(spec.shape[1:])  # 1 for a vector
        first, last = start // row, -(-end // row)
        rows = self._open[path].get_slice(spec.checkpoint_name)[first:last]
        self.bytes_read += rows.numel() * rows.element_size()
        return rows.reshape(-1)[start - first * row:end - first * row]

    def read_flat(self, specs: list[WeightSpec], offsets: tuple[int, ...], start: int, end: int):
        """Elements [start, end) of a group's flat f32 buffer (`specs` at `offsets`), zero in the padding."""
        import torch

        out = torch.zeros(end - start, dtype=torch.float32)
        for spec, offset in zip(specs, offsets):
            lo, hi = max(start, offset), min(end, offset + prod(spec.shape))
            if lo < hi:
                out[lo - start:hi - start] = self.read(spec, lo - offset, hi - offset)
        return out
