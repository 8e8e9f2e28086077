"""A Hugging Face model folder as a card: its family from config.json, its numbers translated.

A folder that `save_pretrained` wrote (config.json and SafeTensors), or a hub id's snapshot in
the local Hugging Face cache, becomes a `Card` whose weights are that folder. The family is the
config's `model_type`; the numbers are the config's own, with the rope settings in the spelling
that cards use: `rope_theta` and `rope_scaling` (transformers 5.x writes them as one
`rope_parameters` table, older versions as two keys, older still with `type` for `rope_type`)."""

from __future__ import annotations

import json
from pathlib import Path

from linnet.errors import UserError

# model_type -> the family program (linnet/cards/FAMILY.arch) that computes it. Mistral's
# architecture is Llama's: a card of the Llama family, whose checks refuse what differs (a sliding window).
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class NotAModel(UserError):
    """A folder or hub id that does not hold a causal language model Linnet has a family for."""


def supported_model_types(cards_dir: Path) -> list[str]:
    return sorted(t for t, family in FAMILIES.items() if (cards_dir / f"{family}.arch").exists())


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise NotAModel(f"{folder} holds no config.json: a folder given as a card must be a Hugging Face model "
                        "folder (config.json and SafeTensors, as save_pretrained writes it)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise NotAModel(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise NotAModel(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def family_of(config: dict, where: Path, cards_dir: Path) -> str:
    model_type = config.get("model_type")
    supported = supported_model_types(cards_dir)
    if model_type not in supported:
        raise NotAModel(f"{where}: model_type {model_type!r} has no family in Linnet; "
                        f"supported: {', '.join(supported)}")
    causal = [a for a in config.get("architectures") or [] if str(a).endswith("ForCausalLM")]
    if config.get("architectures") and not causal:
        raise NotAModel(f"{where}: architectures {config['architectures']} hold no causal language model "
                        "(…ForCausalLM): Linnet fine-tunes the language model itself")
    return FAMILIES[model_type]


def card_config(config: dict) -> dict:
    """config.json's numbers as a card's [config]: the rope settings as rope_theta and rope_scaling."""
    out = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if "rope_theta" in rope:
            out["rope_theta"] = rope["rope_theta"]
    else:
        scaling = config.get("rope_scaling")
    scaling = dict(scaling) if isinstance(scaling, dict) else {}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    out["rope_scaling"] = scaling
    return out


def snapshot(repo_id: str) -> Path | None:
    """The folder of `repo_id`'s newest snapshot in the local Hugging Face cache, or None."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
