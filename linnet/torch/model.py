"""A card loaded for PyTorch: `model.loss_packed(tokens, ...)` calls the
generated function with the model's weights, `model.parameters()` yields what
an optimizer trains, and `model.save_weights(folder)` writes a Hugging Face
checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from linnet.emit.torch_backend import TORCH
from linnet.hf.write import DTYPES
from linnet.model import LoadedModel
from linnet.torch import ops  # noqa: F401  registers torch.ops.linnet (prims_torch.cross_entropy_in_one_op calls it)
from linnet.torch.compile_once import schemas_once


class TorchModel(LoadedModel):
    backend = TORCH

    def __init__(self, card, checked, *, generics, numerics, cast_dtype, trainable: bool, compile: str | None,
                 device: torch.device, entries):
        if device.type == "cuda" and device.index is None:  # "cuda" means the current device, by its index
            device = torch.device("cuda", torch.cuda.current_device())
        self.trainable, self.compile_mode, self.device = trainable, compile, device
        self.sharding = None  # set by linnet.torch.fully_shard
        self.late_parts = None  # set by fully_shard with replicas: the parts reduced last (linnet/torch/hybrid.py)
        self.stepping = None  # an optimizer stepping in the backward, while it does (linnet/torch/step_in_backward.py)
        self.held_gradients = None  # the gradients held unreduced, once held (linnet/torch/held_gradients.py)
        self.unusable: str | None = None  # why, where a fully_shard failed after it began to change the model
        self.compute_dtype = DTYPES[generics[checked.program.compute_dtype]]
        self.weight_dtype = torch.float32 if cast_dtype else self.compute_dtype
        super().__init__(card, checked, generics=generics, numerics=numerics, cast_dtype=cast_dtype, entries=entries)

    @property
    def layer_region(self) -> bool:
        """Whether a layer loop's function is compiled once for every layer (`layer_region_over`)."""
        sharding = self.sharding
        if sharding is None:
            return self.layer_region_over(1, "gather")
        return self.layer_region_over(sharding.world * sharding.replicas, sharding.recompute)

    def layer_region_over(self, ranks: int, recompute: str) -> bool:
        """A layer's function compiled once for every layer rather than the layers unrolled, for a first
        step that compiles sooner, over `ranks` ranks. On by default on one rank, where the step is as
        quick (docs/design/compile_time.md); LINNET_COMPILE_LAYERS_ONCE=0 turns it off, =1 on over several
        ranks with recompute "full" (there slower, so not the default).
        Sharded over one rank, the region goes around the layer's checkpoint, so that a selective policy
        ("matmuls") sees the layer's own ops; over several, the checkpoint around the region. Refused
        where the backward gathers a layer's weights again (recompute "gather" or "matmuls" over several
        ranks): a region keeps every input its backward reads from the forward, so the gathered weights
        would be kept and the gather the backward launches again never waited for (a leak a layer a
        step). fully_shard asks before it changes the model."""
        setting = os.environ.get("LINNET_COMPILE_LAYERS_ONCE")
        if self.compile_mode != "inductor" or setting == "0":
            return False
        if ranks == 1 or setting != "1":
            return ranks == 1
        if recompute != "full":
            raise ValueError(f"LINNET_COMPILE_LAYERS_ONCE=1 with recompute={recompute!r} over {ranks} ranks: a layer "
                             "compiled once would keep its gathered weights for the backward and leak the gather the "
                             "backward launches again; use recompute='full', or unset LINNET_COMPILE_LAYERS_ONCE")
        return True

    def _compile(self, function, dynamic: bool | None = None):
        if self.compile_mode == "inductor":
            # Communicating, the generated code's order is the schedule (linnet/sharding/schedule.py): inductor's
            # reordering for peak memory would move collectives' waits next to their launches.
            # With a layer compiled once, the pass also reorders the region's calls and reads saved
            # activations after their buffers are reused (wrong gradients; docs/design/compile_time.md,
            # "Note: a region and inductor's reordering").
            communicates = self.sharding is not None and self.sharding.world > 1
            options = {"reorder_for_peak_memory": False} if communicates or self.layer_region else {}
            compiled = torch.compile(function, fullgraph=True, backend="inductor", options=options, dynamic=dynamic)
            if not self.layer_region:  # no nested compile region in the source: no schema to find again
                return compiled

            def call(*args):
                if torch.compiler.is_compiling():  # inside a user's own compile: that compile's business
                    return compiled(*args)
                with schemas_once():  # a compile this call starts traces a layer compiled once only once
                    return compiled(*args)

            return call
        return function

    def install(self, source: str, namespace: dict) -> None:
        super().install(source, namespace)
        # entry -> its function with the steps (or the held gradients' buffers) first, compiled again from the new
        # functions when first called
        self._stepping_entries: dict = {}
        self._holding_entries: dict = {}

    def recompute_as(self, recompute: str) -> None:
        """Sharded already, what the backward recomputes from now on ("gather", "matmuls" or "full", as
        fully_shard's recompute): the entries are emitted and compiled again; the parts stay as they are."""
        import dataclasses

        from linnet.torch.collectives import bindings
        from linnet.torch.recompute import POLICIES

        if recompute not in POLICIES:
            raise ValueError(f'recompute must be "gather", "matmuls" or "full", got {recompute!r}')
        if self.sharding is None:
            raise RuntimeError("recompute_as changes a sharded model's policy: fully_shard(model, recompute=...) first")
        if recompute != self.sharding.recompute:
            self.layer_region_over(self.sharding.world * self.sharding.replicas, recompute)  # refused before a change
            self.sharding = dataclasses.replace(self.sharding, recompute=recompute)
            self.install(self.emit(schedule=self.sharding.schedule).source, bindings(self.sharding))

    def hold_gradients(self, hold: bool) -> None:
        """hold=True: from the next backward on, each group's whole gradient accumulates on this rank, and
        none is reduce-scattered; hold=False: the held gradients are reduce-scattered (launched now) and the
        next backward adds them to the parts' gradients (linnet/torch/held_gradients.py). Over one rank,
        where nothing is reduce-scattered, nothing is held."""
        from linnet.torch.held_gradients import HeldGradients

        if self.sharding is None:
            raise RuntimeError("hold_gradients holds a sharded model's gradients: fully_shard(model) first")
        if self.sharding.world * self.sharding.replicas == 1:
            return
        if self.held_gradients is None:
            self.held_gradients = HeldGradients(self)
        if hold:
            self.held_gradients.hold()
        else:
            self.held_gradients.release()

    def _call(self, entry: str, inputs):
        if self.unusable is not None:
            raise RuntimeError(self.unusable)
        held = self.held_gradients
        if held is not None and held.holding and torch.is_grad_enabled():
            if entry not in self._holding_entries:
                self._holding_entries[entry] = self._compile(_entry_with(self.functions[entry], "holding_gradients"))
            return self._holding_entries[entry](self.params, held.wholes(), *inputs)
        stepping = self.stepping
        if stepping is None or not torch.is_grad_enabled():
            return super()._call(entry, inputs)
        if entry not in self._stepping_entries:
            # Static: the optimizer's settings (betas, eps, weight decay) arrive as floats, which are the graph's
            # constants; a change compiles again (dynamic floats fail inside the backward's step).
            self._stepping_entries[entry] = self._compile(_entry_with(self.functions[entry], "stepping_in_backward"),
                                                          dynamic=False)
        params = self.params
        return self._stepping_entries[entry](stepping.parts(params), stepping.states(params), *inputs)

    def _read_device(self) -> str:
        return str(self.device)

    def _convert(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._as_weight(tensor.to(self.weight_dtype))

    def _random_drawer(self, seed: int):
        generator = torch.Generator(device=self.device).manual_seed(seed)

        def draw(spec, std):
            tensor = torch.empty(spec.shape, dtype=self.weight_dtype, device=self.device)
            drawn = tensor.fill_(1.0) if spec.init == "ones" else tensor.normal_(0.0, std, generator=generator)
            return self._as_weight(drawn)

        return draw

    def _weight_itemsize(self) -> int:
        return self.weight_dtype.itemsize

    def _free_memory(self) -> tuple[str, int]:
        if self.device.type == "cuda":
            return str(self.device), torch.cuda.mem_get_info(self.device)[0]
        return super()._free_memory()

    _shard_hint = "call linnet.torch.fully_shard(model) first (under torchrun, a process a GPU), which"

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

    def save_weights(self, path, dtype: torch.dtype = torch.bfloat16, max_shard_size: int | str = "5GB") -> Path:
        """A Hugging Face checkpoint: SafeTensors files of at most max_shard_size ("5GB" is 5e9 bytes;
        several come with model.safetensors.index.json) and the config.json transformers loads them with.

        Sharded, every rank must call it: each group is gathered in turn and the first rank writes it (of
        the first replica, with hybrid sharding), so no rank holds more than one group whole; if the write
        fails, every rank raises."""
        from linnet.hf.write import check_dtype, write_hf_checkpoint

        check_dtype(dtype)
        shapes = {spec.checkpoint_name: spec.shape for spec in self.specs()}
        if self.sharding is None:
            return write_hf_checkpoint(self.card, shapes, self.named_weights(), Path(path), dtype,
                                       max_shard_size=max_shard_size)
        from linnet.torch.agree import together
        from linnet.torch.collectives import gathered_weights

        gathered = gathered_weights(self, dtype)

        def write_or_follow():
            try:
                if self.sharding.rank == 0 and self.sharding.replica == 0:
                    write_hf_checkpoint(self.card, shapes, gathered, Path(path), dtype, max_shard_size=max_shard_size)
            finally:
                for _ in gathered:  # the other ranks are in the gathers of the groups left: join them to the end
                    pass

        # Agreed by every rank that holds these weights: the shard group's, and with replicas every rank (a
        # 2-D mesh holds them all), so that the other machines learn of a write that failed.
        everyone = None if self.sharding.replicas > 1 else self.sharding.group_name
        together(write_or_follow, f"write the weights to {path}", everyone)
        return Path(path)

    def _agree(self, check, what: str) -> None:
        if self.sharding is None:
            return check()
        from linnet.torch.agree import agree_on_check

        agree_on_check(check, what, self.sharding.group_name)

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


def _entry_with(function, what: str):
    """The entry `function`, its weights first passed through the step in the backward (what =
    "stepping_in_backward": `states`, a tree of each part's optimizer state) or made Held beside their
    buffers ("holding_gradients": `states`, a tree of each part's buffer)."""
    from linnet.torch.held_gradients import with_held
    from linnet.torch.step_in_backward import with_steps

    wrap = {"stepping_in_backward": with_steps, "holding_gradients": with_held}[what]

    def entry(params, states, *inputs):
        return function(wrap(params, states), *inputs)

    # A code object of its own: torch.compile keeps its compiled graphs (and its limit on them) by code object.
    entry.__name__ = entry.__qualname__ = f"{function.__name__}_{what}"
    entry.__code__ = entry.__code__.replace(co_name=entry.__name__)
    return entry
