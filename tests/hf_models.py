"""Tiny random models saved by transformers (Llama, and every family Linnet has), and cards that point at them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(
    vocab_size=211, hidden_size=80, intermediate_size=144, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=1, head_dim=20, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    max_position_embeddings=512,
)
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)


def save_hf_llama(folder: Path, seed: int = 0, rope_scaling: dict | None = None, max_shard_size: str = "5GB",
                  dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A LlamaForCausalLM with random weights, written by save_pretrained (in files of at most
    max_shard_size, with an index when there are several); returns its card."""
    return save_hf_model(folder, "llama", seed, rope_scaling, max_shard_size, dtype, **overrides)


def write_card(folder: Path, config: dict, rope_scaling: dict | None, repo: str, name: str = "test-llama") -> Path:
    return write_model_card(folder, "llama", config, rope_scaling or {"rope_type": "default"}, repo, name)


def write_tied_card(folder: Path, layers: int = BASE["num_hidden_layers"]) -> Path:
    """The tests' tiny Llama, tied and with 2 KV heads, random weights: its groups (a 211 x 80 embedding,
    80-wide norms) split unevenly over 3 and 4 ranks."""
    config = {**BASE, "num_hidden_layers": layers, "num_key_value_heads": 2, "tie_word_embeddings": True}
    return write_card(folder, config, LLAMA3_SCALING, repo="no-weights: random ones are drawn")


def write_untied_card(folder: Path) -> Path:
    """The same Llama with a head of its own (as the 8B's): sharded, its embedding is looked up, not gathered."""
    config = {**BASE, "num_key_value_heads": 2, "tie_word_embeddings": False}
    return write_card(folder, config, LLAMA3_SCALING, repo="no-weights: random ones are drawn")


def load_hf(card_path: Path, dtype=torch.float32, attn="eager"):
    from transformers import LlamaForCausalLM

    from linnet.cards import resolve

    model = LlamaForCausalLM.from_pretrained(resolve(card_path).weights.repo, dtype=dtype, attn_implementation=attn)
    return model.eval()


def save_hf_model(folder: Path, model_type: str, seed: int = 0, rope_scaling: dict | None = None,
                  max_shard_size: str = "5GB", dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """save_hf_llama for any model_type Linnet has a family for (transformers' model of that type, with
    BASE's numbers and `overrides`); returns its card. An override of None leaves the key out of the card
    (TOML has no null), and out of transformers' config too unless that declares it (Mistral's sliding_window)."""
    model = make_hf_model(model_type, seed, rope_scaling, **overrides)
    model.to(dtype).save_pretrained(folder / "hf", max_shard_size=max_shard_size)
    return write_model_card(folder, model_type, {**BASE, **overrides}, rope_scaling, repo=str(folder / "hf"))


def make_hf_model(model_type: str, seed: int = 0, rope_scaling: dict | None = None, attn: str = "eager",
                  **overrides):
    """transformers' model of `model_type` with BASE's numbers and `overrides` (None leaves a key out, as in
    save_hf_model), its random weights drawn from `seed`, its norms and biases perturbed."""
    import dataclasses

    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config_class = CONFIG_MAPPING[model_type]
    declared = {f.name for f in dataclasses.fields(config_class)}
    config = {**BASE, **overrides}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(
        **{k: v for k, v in config.items() if v is not None or k in declared}, rope_scaling=rope_scaling),
        attn_implementation=attn)
    # norms are ones and biases zeros at init; perturb them so that a swapped or lost one would show
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def write_model_card(folder: Path, model_type: str, config: dict, rope_scaling: dict | None, repo: str,
                     name: str | None = None) -> Path:
    """write_card for any model_type: the card of its family (linnet.cards.huggingface.FAMILIES); keys whose
    value is None, and a rope_scaling of None, are left out, as a card leaves out config.json's nulls."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from linnet.cards.huggingface import FAMILIES

    name = name or f"test-{model_type}"
    lines = [f'name = "{name}"', f'family = "{FAMILIES[model_type]}"', "",
             "[weights]", f"repo = {json.dumps(repo)}", "",
             "[config]", f'model_type = "{model_type}"',
             f'architectures = ["{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}"]']
    lines += [f"{key} = {json.dumps(value)}" for key, value in config.items() if value is not None]
    if rope_scaling is not None:
        lines.append("rope_scaling = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in rope_scaling.items()) + " }")
    path = folder / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def load_hf_model(card_path: Path, dtype=torch.float32, attn="eager"):
    """load_hf for any family: transformers' model of the card's model_type, from the card's folder."""
    from transformers import AutoModelForCausalLM

    from linnet.cards import resolve

    model = AutoModelForCausalLM.from_pretrained(resolve(card_path).weights.repo, dtype=dtype, attn_implementation=attn)
    return model.eval()
