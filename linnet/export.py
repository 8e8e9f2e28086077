"""Writing weights as a Hugging Face checkpoint: one SafeTensors file and the
config.json that `transformers.AutoModelForCausalLM.from_pretrained` needs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from linnet.cards import Card

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_hf_checkpoint(card: Card, tensors: dict[str, torch.Tensor], folder: Path, dtype: torch.dtype) -> Path:
    from safetensors.torch import save_file

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"save_weights(dtype=...) takes one of {list(_DTYPE_NAMES)}, got {dtype}")
    folder.mkdir(parents=True, exist_ok=True)
    contiguous = {name: tensor.contiguous().cpu() for name, tensor in tensors.items()}
    save_file(contiguous, folder / "model.safetensors", metadata={"format": "pt"})
    config = {**card.config, "torch_dtype": _DTYPE_NAMES[dtype]}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
