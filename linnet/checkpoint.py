"""Checkpoints of a training run that survive a crash at any moment.

A checkpoint is a folder `step-00000010/` holding one file a rank (its parts,
its optimizer state, its RNG state) and `MANIFEST.json`, written last, with
the step, the world size, the data position, the schedule, the layouts of the
parts, and each file's size and SHA-256; linnet/checkpoint_folder.py makes it
visible only when complete and picks the newest one that checks out.
A checkpoint resumes at another world size: the parts and the optimizer state
are re-split from the saved parts."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from linnet import checkpoint_folder
from linnet.agree import first_rank_does, together


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


class Checkpointer:
    def __init__(self, folder, model, optimizer: torch.optim.Optimizer, schedule=None, keep: int = 2):
        self.folder, self.model, self.optimizer, self.schedule, self.keep = Path(folder), model, optimizer, schedule, keep
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        parts = list(model.parameters())
        self.part_index = {id(p): i for i, p in enumerate(parts)}
        missing = [i for i, p in enumerate(self.params) if id(p) not in self.part_index]
        if missing:
            raise ValueError("the optimizer trains tensors that are not the model's parameters; "
                             "build it from model.parameters()")
        self.layouts = _layouts(model)
        self.manifest: dict | None = None

    # Saving.

    def save(self, step: int, rows_consumed: int) -> Path:
        rank, world = _world()
        partial = checkpoint_folder.partial_path(self.folder, step)
        first_rank_does(lambda: checkpoint_folder.begin(partial), f"begin checkpoint {partial}")
        path = partial / _rank_file(rank, world)
        state = {
            "parts": [p.detach().cpu() for p in self.params],
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng_state(),
        }
        together(lambda: torch.save(state, path), f"write {path}")
        files = _gather_objects(checkpoint_folder.describe(path))
        manifest = {
            "framework": "torch",
            "card": self.model.card.name,
            "step": step,
            "world": world,
            "rows_consumed": rows_consumed,
            "schedule": self.schedule.state_dict() if self.schedule is not None else None,
            "layouts": self.layouts,
            "parts": [self.part_index[id(p)] for p in self.params],
        }
        first_rank_does(lambda: checkpoint_folder.commit(self.folder, partial, manifest, files, keep=self.keep,
                                                         default=_jsonable), f"commit checkpoint {partial}")
        return self.folder / checkpoint_folder.step_name(step)

    # Resuming.

    def resume(self) -> int:
        """Loads the newest complete checkpoint; returns its step (0 if there is none)."""
        rank, world = _world()
        choice = checkpoint_folder.latest(self.folder) if rank == 0 else None
        choice = _broadcast(None if choice is None else choice.name)
        if choice is None:
            return 0
        folder = self.folder / choice
        manifest = checkpoint_folder.read_manifest(folder)
        checkpoint_folder.check_framework(manifest, "torch", folder)
        if manifest["card"] != self.model.card.name or manifest["layouts"] != self.layouts:
            raise ValueError(f"checkpoint {folder} holds a run of {manifest['card']} with other layouts; "
                             f"this model is {self.model.card.name}: point checkpoint= at another folder")
        self._load(folder, manifest, rank, world)
        self.manifest = manifest
        if rank == 0:
            print(f"linnet: resuming from {folder} (step {manifest['step']}, saved by {manifest['world']} "
                  f"ranks, now {world})", flush=True)
        return manifest["step"]

    def rows_to_skip(self, step: int, rank: int, world: int) -> int:
        """Rows of this rank's iterator (the rank-strided rows[rank::world]) that the run already used."""
        if not step:
            return 0
        consumed = self.manifest["rows_consumed"]
        return max(0, -(-(consumed - rank) // world))

    def _load(self, folder: Path, manifest: dict, rank: int, world: int) -> None:
        saved_world = manifest["world"]
        if saved_world == world:
            state = torch.load(folder / _rank_file(rank, world), map_location="cpu", weights_only=False)
        else:
            if not self.layouts:
                raise ValueError(f"checkpoint {folder} was saved by {saved_world} ranks; an unsharded model "
                                 f"resumes only at the same world size")
            state = self._resplit(folder, saved_world, rank, world)
        with torch.no_grad():
            for param, saved in zip(self.params, state["parts"]):
                param.copy_(saved.to(param.device))
        self.optimizer.load_state_dict(state["optimizer"])
        if self.schedule is not None and manifest["schedule"] is not None:
            self.schedule.load_state_dict(manifest["schedule"])
        _set_rng_state(state["rng"])

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


def _jsonable(value):
    if torch.is_tensor(value):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} into a manifest")
