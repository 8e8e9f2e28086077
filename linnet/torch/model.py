"""A card loaded for PyTorch: `model.loss_packed(tokens, ...)` calls the
generated function with the model's weights, `model.parameters()` yields what
an optimizer trains, and `model.save_weights(folder)` writes a Hugging Face
checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from linnet.emit.torch_backend import TORCH
from linnet.model import LoadedModel

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class TorchModel(LoadedModel):
    backend = TORCH

    def __init__(self, card, checked, *, generics, numerics, cast_dtype, trainable: bool, compile: str | None,
                 device: torch.device, entries):
        if device.type == "cuda" and device.index is None:  # "cuda" means the current device, by its index
            device = torch.device("cuda", torch.cuda.current_device())
        self.trainable, self.compile_mode, self.device = trainable, compile, device
        self.sharding = None  # set by linnet.torch.fully_shard
        self.compute_dtype = TORCH_DTYPES[generics[checked.program.compute_dtype]]
        self.weight_dtype = torch.float32 if cast_dtype else self.compute_dtype
        super().__init__(card, checked, generics=generics, numerics=numerics, cast_dtype=cast_dtype, entries=entries)

    def _compile(self, function):
        if self.compile_mode == "inductor":
            return torch.compile(function, fullgraph=True, backend="inductor")
        return function

    def _read_device(self) -> str:
        return str(self.device)

    def _convert(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._as_weight(tensor.to(self.weight_dtype))

    def _random_drawer(self, seed: int):
        generator = torch.Generator(device=self.device).manual_seed(seed)

        def draw(spec, std):
            tensor = torch.empty(spec.shape, dtype=self.weight_dtype, device=self.device)
            return self._as_weight(tensor.fill_(1.0) if spec.init == "ones" else tensor.normal_(0.0, std, generator=generator))

        return draw

    def _as_weight(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.Parameter(tensor) if self.trainable else tensor

    def parameters(self):
        """The weights; once sharded, this rank's f32 part of each group, in the card's group order."""
        if self.sharding is None:
            for _, tensor in self.named_weights():
                yield tensor
            return
        for decl in self.checked.program.groups.values():
            parts = self.params[decl.key]
            yield from (parts if decl.repeat is not None else [parts])

    def save_weights(self, path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """One SafeTensors file under Hugging Face names, and the config.json transformers loads it with.

        Sharded, every rank must call it: the parts are gathered and the first rank writes; if the
        write fails, every rank raises."""
        from linnet.export import write_hf_checkpoint

        if self.sharding is None:
            tensors = {name: tensor.detach().to(dtype) for name, tensor in self.named_weights()}
            return write_hf_checkpoint(self.card, tensors, Path(path), dtype)
        from linnet.agree import first_rank_does
        from linnet.torch.shard import gathered_weights

        tensors = dict(gathered_weights(self, dtype))
        first_rank_does(lambda: write_hf_checkpoint(self.card, tensors, Path(path), dtype), f"write the weights to {path}")
        return Path(path)

    def _check_placement(self, entry: str, inputs) -> None:
        for index, tensor in enumerate(inputs):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{entry}() input {index + 1} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.device != self.device:
                raise ValueError(f"{entry}() input {index + 1} is on {tensor.device}; the model is on {self.device}")

    def _kind(self, tensor: torch.Tensor) -> str:
        return "float" if tensor.is_floating_point() else "int"

    def __repr__(self) -> str:
        return f"TorchModel({self.card.name}, entries={self.entries}, numerics={self.numerics!r}, device={self.device})"
