"""What a resumed run compares with the checkpoint it resumes from, and how
it says so, for either framework (linnet/torch/checkpoint.py, linnet/jax/checkpoint.py).

A checkpoint of the other framework, or of another model (`model_description`:
each group's count and weights' shapes, whatever the sharding), is refused
with a message naming each difference (`model_differences`, `does_not_fit`);
other settings are followed, and `print_resumed` says where the run resumed
from and each setting that differs (`show`)."""

from __future__ import annotations

from pathlib import Path


def check_framework(manifest: dict, framework: str, checkpoint: Path) -> None:
    """Raises unless the checkpoint was written by a run of `framework` ("torch" or "jax")."""
    found = manifest.get("framework", "torch")  # the first PyTorch checkpoints did not say
    if found != framework:
        names = {"torch": "PyTorch", "jax": "JAX"}
        raise ValueError(f"checkpoint {checkpoint} was written by a {names.get(found, found)} run; a "
                         f"{names[framework]} run resumes only from its own: point checkpoint= at another folder")


def model_description(checked) -> dict:
    """Each group of the card (by its key in the parameters: "layers") with its count and its weights'
    shapes: what a checkpoint must match to be resumed, whatever the sharding."""
    description = {}
    for decl in checked.program.groups.values():
        weights = {w.name: list(checked.weight_shape(w)) for w in decl.weights if not checked.is_tied(w)}
        description[decl.key] = {"count": checked.repeat(decl.name), "weights": weights}
    return description


def model_differences(saved: dict, mine: dict) -> list[str]:
    """Each way two model descriptions differ, as a phrase ("number of layers: 3 in the checkpoint, 2 in this run")."""
    differences = []
    for group in sorted(saved.keys() | mine.keys()):
        if group not in mine or group not in saved:
            where = "the checkpoint" if group in saved else "this run"
            differences.append(f"group {group}: only in {where}")
            continue
        if saved[group]["count"] != mine[group]["count"]:
            differences.append(f"number of {group}: {saved[group]['count']} in the checkpoint, "
                               f"{mine[group]['count']} in this run")
        old, new = saved[group]["weights"], mine[group]["weights"]
        for weight in sorted(old.keys() | new.keys()):
            if old.get(weight) != new.get(weight):
                differences.append(f"{group}.{weight}: shape {_shape(old.get(weight))} in the checkpoint, "
                                   f"{_shape(new.get(weight))} in this run")
    return differences


def _shape(shape: list[int] | None) -> str:
    return "none" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def does_not_fit(checkpoint: Path, card: str, differences: list[str]) -> str:
    """The message that refuses a checkpoint of another model."""
    return (f"checkpoint {checkpoint} does not fit this run of {card}: {'; '.join(differences)}. It was written "
            f"for another model: load the card it was written with, or point checkpoint= at another folder")


def show(value) -> str:
    """A setting as a note shows it: floats short, lists bracketed."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def print_resumed(headline: str, notes: list[str]) -> None:
    """What a resume says: where it resumed from, then each setting that differs from the checkpoint's."""
    print(f"linnet: {headline}", flush=True)
    if notes:
        print("linnet: this run's settings differ from the checkpoint's; it follows its own:", flush=True)
        for note in notes:
            print(f"linnet:   {note}", flush=True)
