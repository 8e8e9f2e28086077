"""Checkpoints of a training run that survive a crash at any moment.

A checkpoint is a folder `step-00000010/` holding one file a rank (its parts,
its optimizer state, its RNG state) and `MANIFEST.json`, written last, with
the step, the world size, the data position, the schedule, the layouts of the
parts, and each file's size and SHA-256; linnet/checkpoint/folder.py makes it
visible only when complete and picks the newest one that checks out, and
linnet/checkpoint/resume_check.py compares it with the run that resumes it.
A checkpoint resumes at another world size: the parts and the optimizer state
are re-split from the saved parts.

A Checkpointer holds its folder from its creation until close() (train
closes it): the first rank takes the folder's lock, and every rank learns
whether it could. Resuming compares the checkpoint with this run: another
card, or other shapes or number of layers, is refused, naming each
difference; other optimizer settings (learning rate, betas, eps, weight
decay), another schedule or number of steps are followed, with a note: this
run's settings replace the checkpoint's, and its schedule is stepped to the
checkpoint's step."""

from __future__ import annotations

import copy
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from linnet.checkpoint import folder as checkpoint_folder
from linnet.checkpoint import lock as folder_lock
from linnet.checkpoint import resume_check
from linnet.errors import NotFinite
from linnet.torch.agree import agree_on_check, first_rank_does, together
from linnet.checkpoint.storage import storage_errors


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast(value):
    if _world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_objects(value) -> list:
    if _world()[1] == 1:
        return [value]
    out = [None] * _world()[1]
    dist.all_gather_object(out, value)
    return out


def _rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.pt"


class Checkpointer(folder_lock.HoldsFolder):
    """Saves a run's state into `folder` and resumes from it. It holds the folder from its creation (every rank
    creates it, the first takes the folder's lock) until close(); `with Checkpointer(...) as checkpointer:`
    closes it too. steps: the run's planned steps, which a resumed run compares with its own."""

    def __init__(self, folder, model, optimizer: torch.optim.Optimizer, schedule=None, keep: int = 2,
                 steps: int | None = None):
        self.folder, self.model, self.optimizer = Path(folder), model, optimizer
        self.schedule, self.keep = schedule, keep
        self.steps = steps
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        parts = list(model.parameters())
        self.part_index = {id(p): i for i, p in enumerate(parts)}
        missing = [i for i, p in enumerate(self.params) if id(p) not in self.part_index]
        if missing:
            raise ValueError("the optimizer trains tensors that are not the model's parameters; "
                             "build it from model.parameters()")
        self.layouts = _layouts(model)
        self.description = resume_check.model_description(model.checked)
        # What this run asked for, kept before a resume loads the checkpoint's settings over them.
        self.asked = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                      for group in optimizer.param_groups]
        self.fresh_schedule = copy.deepcopy(schedule.state_dict()) if schedule is not None else None
        self.manifest: dict | None = None
        self.saved_step = 0  # the step of the newest checkpoint in the folder: saved by this run, or resumed
        self.known: dict[str, str | None] = {}  # the first rank's findings on the folder's checkpoints
        self.lock = first_rank_does(lambda: folder_lock.take(self.folder), f"take checkpoint folder {self.folder}")

    # Room on the disk.

    def bytes_needed(self) -> int:
        """The bytes one checkpoint takes, every writing rank's file (a collective: every rank calls it)."""
        writes = _parts_of(self.model)[2]
        mine = _tensor_bytes(self.params) + _optimizer_state_bytes(self.optimizer, self.params) if writes else 0
        return sum(_gather_objects(mine)) + checkpoint_folder.HEADROOM

    def check_room(self) -> None:
        """Before the first step: fails now, not at the first save, if the disk cannot hold a checkpoint."""
        needed = self.bytes_needed()
        first_rank_does(lambda: checkpoint_folder.check_room(self.folder, needed, self.known),
                        f"find room for checkpoints in {self.folder}")

    # Saving.

    def save(self, step: int, rows_consumed: int) -> Path:
        """Saves step `step` (every rank calls it). Refuses, on every rank and before the folder is touched (no
        checkpoint is pruned for it), a state that is not finite: NotFinite."""
        rank, world = _world()
        agree_on_check(lambda: _check_finite(self.params, self.optimizer, step), f"step {step} is not saved")
        part, parts, writes = _parts_of(self.model)
        needed = self.bytes_needed()
        partial = checkpoint_folder.partial_path(self.folder, step)
        first_rank_does(lambda: self._begin(partial, needed), f"begin checkpoint {partial}")
        try:
            path = partial / _rank_file(part, parts)
            if writes:
                state = {
                    "parts": [p.detach().cpu() for p in self.params],
                    "optimizer": self.optimizer.state_dict(),
                    "rng": _rng_state(),
                }
                size = _tensor_bytes(state["parts"]) + _optimizer_state_bytes(self.optimizer, self.params)
            together(lambda: _write_state(state, path, size) if writes else None, f"write {path}")
            described = together(lambda: checkpoint_folder.describe(path) if writes else None, f"sync {path}")
            files = [f for f in _gather_objects(described) if f is not None]
            manifest = {
                "framework": "torch",
                "card": self.model.card.name,
                "step": step,
                "world": world,
                "parts_world": parts,
                "rows_consumed": rows_consumed,
                "schedule": self.schedule.state_dict() if self.schedule is not None else None,
                "layouts": self.layouts,
                "parts": [self.part_index[id(p)] for p in self.params],
                "model": self.description,
                "optimizer": {"class": type(self.optimizer).__name__, "groups": _settings(self.asked)},
                "schedule_class": type(self.schedule).__name__ if self.schedule is not None else None,
                "steps": self.steps,
                "row_length": self.model.generics.get("MaxSeq"),
            }
            first_rank_does(lambda: checkpoint_folder.commit(self.folder, partial, manifest, files, keep=self.keep,
                                                             default=_jsonable, known=self.known),
                            f"commit checkpoint {partial}")
        except Exception:  # every rank is here, past the agreement: what the save wrote takes no room
            if rank == 0:
                checkpoint_folder.discard(partial)
            raise
        self.saved_step = step
        return self.folder / checkpoint_folder.step_name(step)

    def _begin(self, partial: Path, needed: int) -> None:
        checkpoint_folder.make_room(self.folder, needed, self.known)
        checkpoint_folder.begin(partial)

    # Resuming.

    def resume(self) -> int:
        """Loads the newest complete checkpoint; returns its step (0 if there is none)."""
        rank, world = _world()
        choice = first_rank_does(self._newest, f"find the newest checkpoint in {self.folder}")
        choice = _broadcast(choice)
        if choice is None:
            return 0
        folder = self.folder / choice
        manifest = checkpoint_folder.read_manifest(folder)
        resume_check.check_framework(manifest, "torch", folder)
        self._check_same_model(folder, manifest, world)
        state = self._read(folder, manifest, *_parts_of(self.model)[:2])
        notes = self._differences(folder, manifest, state)
        self._load(state, manifest, follow=bool(notes))
        self.manifest = manifest
        if rank == 0:
            resume_check.print_resumed(f"resuming from {folder} (step {manifest['step']}, saved by "
                                       f"{manifest['world']} ranks, now {world})",
                                       notes + _quiet_differences(manifest, self.model))
        self.saved_step = manifest["step"]
        return manifest["step"]

    def _newest(self) -> str | None:
        found = checkpoint_folder.latest(self.folder, self.known)
        return None if found is None else found.name

    def _check_same_model(self, folder: Path, manifest: dict, world: int) -> None:
        """Refuses a checkpoint of another card, or of other shapes (a layer more or less), naming each difference."""
        differences = []
        if manifest["card"] != self.model.card.name:
            differences.append(f"card: {manifest['card']} in the checkpoint, {self.model.card.name} in this run")
        if "model" in manifest:
            differences += resume_check.model_differences(manifest["model"], self.description)
        if not differences and manifest["layouts"] != self.layouts:
            differences += _layout_differences(manifest["layouts"], self.layouts, self.model.checked)
        if differences:
            raise ValueError(resume_check.does_not_fit(folder, self.model.card.name, differences))
        if manifest["world"] != world and not self.layouts:
            raise ValueError(f"checkpoint {folder} was saved by {manifest['world']} ranks; an unsharded model "
                             f"resumes only at the same world size")

    def _differences(self, folder: Path, manifest: dict, state: dict) -> list[str]:
        """The settings in which this run differs from the checkpoint's and follows its own, as notes; raises
        for those it cannot follow (another optimizer, or settings that change the optimizer's state)."""
        saved = manifest.get("optimizer") or {"class": None, "groups": _settings(state["optimizer"]["param_groups"])}
        refusals, notes = _optimizer_differences(saved["groups"], _settings(self.asked))
        if saved["class"] not in (None, type(self.optimizer).__name__):
            refusals.insert(0, f"optimizer: {saved['class']} in the checkpoint, {type(self.optimizer).__name__} "
                               f"in this run")
        if refusals:
            raise ValueError(f"checkpoint {folder} cannot resume with this run's optimizer: {'; '.join(refusals)}. "
                             f"Use the checkpoint's optimizer settings, or point checkpoint= at another folder")
        saved_schedule = manifest.get("schedule_class", "a schedule" if manifest["schedule"] is not None else None)
        mine = type(self.schedule).__name__ if self.schedule is not None else None
        if (saved_schedule is None) != (mine is None) or saved_schedule not in (None, "a schedule", mine):
            notes.append(f"schedule: {saved_schedule or 'none'} in the checkpoint, {mine or 'none'} in this run")
        if manifest.get("steps") is not None and self.steps is not None and manifest["steps"] != self.steps:
            notes.append(f"steps: {manifest['steps']} in the checkpoint's run, {self.steps} in this one")
        if notes:
            what = "optimizer settings and schedule" if self.schedule is not None else "optimizer settings"
            notes.append(f"from step {manifest['step']} on, this run's {what} apply")
        return notes

    def _read(self, folder: Path, manifest: dict, part: int, parts: int) -> dict:
        """This rank's parts (the part-th of `parts`), optimizer state and RNG state from the checkpoint,
        checked against the parameters."""
        saved_parts = manifest.get("parts_world", manifest["world"])  # before hybrid sharding: a file a rank
        if saved_parts == parts:
            state = torch.load(folder / _rank_file(part, parts), map_location="cpu", weights_only=False)
        else:
            state = self._resplit(folder, saved_parts, part, parts)
        shapes = [tuple(p.shape) for p in self.params]
        saved = [tuple(t.shape) for t in state["parts"]]
        if saved != shapes:  # what a manifest without the model's shapes could not tell
            first = next((i for i, (a, b) in enumerate(zip(saved, shapes)) if a != b), min(len(saved), len(shapes)))
            raise ValueError(resume_check.does_not_fit(folder, self.model.card.name, [
                f"{len(saved)} tensors in the checkpoint, {len(shapes)} in this run",
                f"tensor {first}: {_shape_at(saved, first)} in the checkpoint, "
                f"{_shape_at(shapes, first)} in this run"]))
        return state

    def _load(self, state: dict, manifest: dict, follow: bool) -> None:
        with torch.no_grad():
            for param, saved in zip(self.params, state["parts"]):
                param.copy_(saved.to(param.device))
        self.optimizer.load_state_dict(state["optimizer"])
        if follow:
            self._follow_this_run(manifest["step"])
        elif self.schedule is not None and manifest["schedule"] is not None:
            self.schedule.load_state_dict(manifest["schedule"])
        _set_rng_state(state["rng"])

    def _follow_this_run(self, step: int) -> None:
        """This run's optimizer settings in place of the checkpoint's, and its own schedule stepped to `step`,
        as if this run had taken every step: a new learning rate is this run's peak, and its schedule's."""
        for group, asked in zip(self.optimizer.param_groups, self.asked):
            group.update(copy.deepcopy(asked))
        if self.schedule is None:
            return
        self.schedule.load_state_dict(copy.deepcopy(self.fresh_schedule))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": none is taken here
            for _ in range(step):
                self.schedule.step()

    def rows_to_skip(self, step: int, rank: int, world: int) -> int:
        """Rows of this rank's iterator (the rank-strided rows[rank::world]) that the run already used."""
        if not step:
            return 0
        consumed = self.manifest["rows_consumed"]
        return max(0, -(-(consumed - rank) // world))

    def _resplit(self, folder: Path, saved_world: int, rank: int, world: int) -> dict:
        """This rank's parts and optimizer state, cut from the parts that saved_world ranks wrote."""
        saved = [torch.load(folder / _rank_file(r, saved_world), map_location="cpu", weights_only=False, mmap=True)
                 for r in range(saved_world)]
        layouts = [self.layouts[self.part_index[id(p)]] for p in self.params]

        def cut(pieces: list[torch.Tensor], layout: dict) -> torch.Tensor:
            full = torch.cat(pieces)[: layout["extent"]]
            part = self.model.sharding.layouts[layout["group"]].part_size
            out = torch.zeros(part, dtype=full.dtype)
            piece = full[rank * part:(rank + 1) * part]
            out[: piece.numel()] = piece
            return out

        parts = [cut([s["parts"][i] for s in saved], layout) for i, layout in enumerate(layouts)]
        optimizer = saved[0]["optimizer"]
        state = {}
        for index, layout in enumerate(layouts):
            entry = {}
            for key, value in optimizer["state"].get(index, {}).items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == saved[0]["parts"][index].numel():
                    entry[key] = cut([s["optimizer"]["state"][index][key] for s in saved], layout)
                else:
                    entry[key] = value
            if entry:
                state[index] = entry
        rng = saved[rank % saved_world]["rng"]
        return {"parts": parts, "optimizer": {"state": state, "param_groups": optimizer["param_groups"]}, "rng": rng}


def _parts_of(model) -> tuple[int, int, bool]:
    """(this rank's part, how many parts there are, whether this rank writes its part): the shard group's
    where replicas hold the same parts, the first replica writing them; every rank's own otherwise."""
    sharding = getattr(model, "sharding", None)
    if sharding is None:
        return (*_world(), True)
    return sharding.rank, sharding.world, sharding.replica == 0


def _shape_at(shapes: list[tuple], index: int) -> str:
    return resume_check.show(list(shapes[index])) if index < len(shapes) else "none"


def _layouts(model) -> list[dict]:
    """Each parameter's group and extent (in model.parameters() order), for re-splitting; [] if unsharded.

    The extent, where the group's last weight ends in its flat buffer, does not
    depend on the world size; the padding after it does."""
    sharding = getattr(model, "sharding", None)
    if sharding is None:
        return []
    out = []
    for decl in model.checked.program.groups.values():
        layout = sharding.layouts[decl.name]
        entry = {"group": decl.name, "extent": layout.extent}
        out += [entry] * (model.checked.repeat(decl.name) if decl.repeat is not None else 1)
    return out


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# Settings a resumed run compares with the checkpoint's.

IMPLEMENTATION = {"foreach", "fused", "capturable", "differentiable"}  # how a step runs, not what it computes
CHANGES_STATE = {"amsgrad"}  # settings that keep other state tensors: the saved state does not fit
SETTING_NAMES = {"lr": "learning rate", "weight_decay": "weight decay"}
_UNRECORDED = object()


def _settings(groups: list[dict]) -> list[dict]:
    """Each parameter group's settings as a manifest records them: its base learning rate (a schedule's
    peak, not this step's), and every other setting that JSON can hold."""
    out = []
    for group in groups:
        entry = {}
        for key, value in group.items():
            if key in ("params", "initial_lr"):
                continue
            plain = _plain(group.get("initial_lr", value) if key == "lr" else value)
            if plain is not _UNRECORDED:
                entry[key] = plain
        out.append(entry)
    return out


def _plain(value):
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _UNRECORDED if any(v is _UNRECORDED for v in items) else items
    return _UNRECORDED


def _optimizer_differences(saved: list[dict], asked: list[dict]) -> tuple[list[str], list[str]]:
    """(refusals, notes): the settings that differ, those the saved state cannot follow apart."""
    if len(saved) != len(asked):
        return [f"{len(saved)} parameter groups in the checkpoint's optimizer, {len(asked)} in this run's"], []
    refusals, notes = [], []
    for index, (old, new) in enumerate(zip(saved, asked)):
        where = f" (parameter group {index})" if len(asked) > 1 else ""
        for key in sorted((old.keys() & new.keys()) - IMPLEMENTATION):
            if old[key] != new[key]:
                text = (f"{SETTING_NAMES.get(key, key)}{where}: {resume_check.show(old[key])} in the checkpoint, "
                        f"{resume_check.show(new[key])} in this run")
                (refusals if key in CHANGES_STATE else notes).append(text)
    return refusals, notes


def _quiet_differences(manifest: dict, model) -> list[str]:
    """Differences that change nothing this run does, noted all the same."""
    saved, mine = manifest.get("row_length"), model.generics.get("MaxSeq")
    if saved is not None and mine is not None and saved != mine:
        note = (f"row length: {saved} in the checkpoint, {mine} in this run (the data position counts rows, "
                f"whatever their length)")
        return [note]
    return []


def _layout_differences(saved: list[dict], mine: list[dict], checked) -> list[str]:
    """How two parts layouts differ (for manifests written before they recorded the model's shapes)."""
    if bool(saved) != bool(mine):
        sharded = "the checkpoint's" if saved else "this run's"
        return [f"sharding: only {sharded} model is sharded (fully_shard)"]
    differences = []
    keys = {decl.name: decl.key for decl in checked.program.groups.values()}
    for group in sorted({e["group"] for e in saved} | {e["group"] for e in mine}):
        old = [e["extent"] for e in saved if e["group"] == group]
        new = [e["extent"] for e in mine if e["group"] == group]
        if len(old) != len(new):
            differences.append(f"number of {keys.get(group, group)}: {len(old)} in the checkpoint, {len(new)} in "
                               f"this run")
        elif old != new:
            differences.append(f"{keys.get(group, group)}: {old[0]} elements in the checkpoint, {new[0]} in this run")
    return differences or ["the layout of the parts"]


# Sizes and writes.

OPTIMIZER_MOMENTS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2,
                     "SGD": 1, "RMSprop": 1, "Adagrad": 1}


def _check_finite(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, step: int) -> None:
    """Raises NotFinite where a part or a tensor of its optimizer state holds inf or nan, naming how many and the
    first; one synchronisation with the device."""
    named = [(f"part {index}", part) for index, part in enumerate(params)]
    named += [(f"part {index}'s {key}", value) for index, part in enumerate(params)
              for key, value in optimizer.state.get(part, {}).items()
              if isinstance(value, torch.Tensor) and value.is_floating_point()]
    if not named:
        return
    finite = torch.stack([torch.isfinite(tensor).all() for _, tensor in named]).cpu().tolist()
    bad = [name for (name, _), ok in zip(named, finite) if not ok]
    if bad:
        raise NotFinite(f"after step {step}'s update {len(bad)} of this rank's {len(named)} tensors of weights and "
                        f"optimizer state hold inf or nan (the first: {bad[0]})")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """The optimizer state's bytes: as it is once it exists; before the first step (PyTorch makes it then),
    what it will be, counted in tensors the size of the parameters (Adam keeps two; unknown optimizers as many)."""
    if optimizer.state:
        return sum(_tensor_bytes(v for v in state.values() if torch.is_tensor(v)) for state in optimizer.state.values())
    moments = OPTIMIZER_MOMENTS.get(type(optimizer).__name__, 2)
    moments += any(group.get("amsgrad") for group in optimizer.param_groups)
    return moments * _tensor_bytes(params)


def _write_state(state: dict, path: Path, size: int) -> None:
    """torch.save through a Python file: a full or read-only disk then fails with its errno, said plainly
    (saving to a path, torch's own writer says only "unexpected pos 108224 vs 108112")."""
    with storage_errors(path, "write", size), open(path, "wb") as f:
        torch.save(state, f)


def _jsonable(value):
    if torch.is_tensor(value):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} into a manifest")
