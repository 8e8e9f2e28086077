"""Tiny random Llama models saved by transformers, and cards that point at them."""

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
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {**BASE, **overrides}
    torch.manual_seed(seed)
    hf_config = LlamaConfig(**config, rope_scaling=rope_scaling)
    model = LlamaForCausalLM(hf_config)
    with torch.no_grad():  # norms are ones at init; perturb them so that a swapped norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.to(dtype).save_pretrained(folder / "hf", max_shard_size=max_shard_size)
    return write_card(folder, config, rope_scaling, repo=str(folder / "hf"))


def write_card(folder: Path, config: dict, rope_scaling: dict | None, repo: str, name: str = "test-llama") -> Path:
    scaling = rope_scaling or {"rope_type": "default"}
    lines = [f'name = "{name}"', 'family = "llama"', "", "[weights]", f"repo = {json.dumps(repo)}", "", "[config]",
             'model_type = "llama"', 'architectures = ["LlamaForCausalLM"]']
    lines += [f"{key} = {json.dumps(value)}" for key, value in config.items()]
    lines.append("rope_scaling = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in scaling.items()) + " }")
    path = folder / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def load_hf(card_path: Path, dtype=torch.float32, attn="eager"):
    from transformers import LlamaForCausalLM

    from linnet.cards import resolve

    model = LlamaForCausalLM.from_pretrained(resolve(card_path).weights.repo, dtype=dtype, attn_implementation=attn)
    return model.eval()
