"""A transformers causal LM sharded in place by `linnet.torch.fully_shard`, with FSDP2's call pattern:

    model = AutoModelForCausalLM.from_pretrained(folder)      # or from_config, on the CPU, a GPU or meta
    for layer in model.model.layers:
        fully_shard(layer)                                     # accepted: the root call shards every layer
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))  # 1-D or 2-D mesh
    loss = model(input_ids=..., labels=..., position_ids=...).loss

The root call makes a card of the model's config (its family from `model_type`, as for a model folder),
hands the model's weights, group by group, to a `TorchModel` of that card (the engine), and shards the
engine as `fully_shard` shards any loaded model: the same generated function, the same collectives. The
transformers model then keeps its class's API, its forward computed by the engine:

- `forward` takes transformers' arguments and returns its output: `.loss` as transformers computes it
  (labels shifted, -100 ignored, divided by `num_items_in_batch` where given), `.logits` without labels.
  A padding `attention_mask` is honoured; without one, `position_ids` that restart mark packed
  documents, which never attend to each other (transformers' own rule, `find_packed_sequence_indices`).
- `parameters()` are this rank's parts as DTensors (linnet/torch/dtensor_parts.py), so that any optimizer
  steps them and `clip_grad_norm_` takes the global norm, as under FSDP2.
- `state_dict()` and `save_pretrained()` give the full weights under transformers' names; every rank calls
  them (they gather one group at a time). `load_weights(folder)` reads this rank's parts back in place.
- `generate()` runs on every rank together, without a key-value cache.

What the engine does not compute is refused by name before anything changes: a family Linnet lacks, a
config value its family refuses (a sliding window), PEFT adapters, a model FSDP already shards."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from linnet.cardlang.generics import bind_generics
from linnet.cards import config_card, huggingface
from linnet.errors import UserError
from linnet.hf.read import grouped, tied_names
from linnet.hf.write import DTYPES
from linnet.torch.model import TorchModel

__all__ = ["ShardedCausalLM", "engine_of", "is_decoder_layer", "is_transformers_module", "sharded_in_place"]

ENTRIES = ["loss_packed", "logits_packed", "token_statistics_packed"]
IGNORE_INDEX = -100  # transformers' label of a position that takes no loss
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_LAYER_MARK = "_linnet_fully_shard_unit"  # set on a decoder layer given to fully_shard before its model


def is_transformers_module(module) -> bool:
    """Whether `module` is a transformers model or layer (FSDP's and Linnet's classes for one included)."""
    return isinstance(module, torch.nn.Module) and any(
        cls.__module__.startswith("transformers.") for cls in type(module).__mro__)


def is_decoder_layer(module) -> bool:
    return is_transformers_module(module) and type(module).__name__.endswith("DecoderLayer")


def mark_layer(layer: torch.nn.Module) -> torch.nn.Module:
    """FSDP2's per-layer call: a layer is a unit of Linnet's schedule anyway, so the call only marks it; the
    call on the model that holds it shards everything."""
    setattr(layer, _LAYER_MARK, True)
    return layer


def engine_of(model: torch.nn.Module, *, param_dtype: torch.dtype | None, device: torch.device,
              weights: str | Path | None, compile: str | None, numerics: str | None) -> TorchModel:
    """A TorchModel of `model`'s config holding `model`'s weights (taken out of `model`, which holds none
    after), or, for a model on the meta device, reading this rank's parts from its folder when sharded.
    param_dtype: what the engine computes in (None: the model's parameters' dtype, as FSDP2)."""
    _refuse_unsupported(model)
    on_meta = any(p.is_meta for p in model.parameters())
    folder = _weights_folder(model, weights) if on_meta or weights is not None else None
    config = json.loads(model.config.to_json_string(use_diff=True))
    card = config_card(config, name=str(folder or getattr(model.config, "_name_or_path", "") or type(model).__name__),
                       weights=str(folder) if folder else None)
    checked = card.checked()  # refuses what the family does not compute, naming the config key
    dtype = param_dtype or _parameters_dtype(model)
    if dtype not in _DTYPE_NAMES:
        raise UserError(f"fully_shard computes in {', '.join(map(str, _DTYPE_NAMES))}; the model's parameters are "
                        f"{dtype}: give mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)")
    if numerics is None:
        numerics = "fast" if device.type == "cuda" else "exact"
    if compile is None and device.type == "cuda":
        compile = "inductor"
    generics = bind_generics(checked, {"Batch": 1, "MaxSeq": int(config.get("max_position_embeddings") or 4096),
                                       "T": _DTYPE_NAMES[dtype]})
    trainable = any(p.requires_grad for p in model.parameters())
    engine = TorchModel(card, checked, generics=generics, numerics=numerics, cast_dtype=True, trainable=trainable,
                        compile=None if compile == "none" else compile, device=device, entries=ENTRIES)
    if folder is not None:
        engine.load_checkpoint(folder)  # checks names and shapes now; fully_shard reads only this rank's parts
    else:
        engine.params = _take_weights(model, engine)
    return engine


def sharded_in_place(model: torch.nn.Module, engine: TorchModel, mesh, placements) -> torch.nn.Module:
    """`model`, its class now a subclass of its own and ShardedCausalLM, its parameters the engine's parts
    as DTensors over `mesh`."""
    from linnet.torch.dtensor_parts import DTensorParts

    dtype = _parameters_dtype(model)
    for module in model.modules():  # the model holds no weight of its own from now on
        for name in list(module._parameters):
            module._parameters[name] = None
    model.linnet_parts = DTensorParts(engine.params, mesh, placements, engine.sharding.world)
    model._linnet_engine, model._linnet_saved_dtype = engine, dtype
    model._linnet_recompute = engine.sharding.recompute
    cls = type(model)
    # FSDPModule among the bases: accelerate, configured for FSDP2, takes the model as sharded already
    model.__class__ = type(f"Linnet{cls.__name__}", (ShardedCausalLM, FSDPModule, cls), {"__module__": __name__})
    return model


class _Guarded:
    """A method of ShardedCausalLM that a model's own assignment replaces, as on any module (a wrapper such
    as accelerate's autocast around the forward), but for the wrappers `skipped` recognises, each of which
    would reach into weights the engine holds in parts. On the class it is `implementation` (what
    transformers' Trainer inspects for the forward's arguments)."""

    def __init__(self, implementation: str, skipped):
        self.implementation, self.skipped = implementation, skipped

    def __set_name__(self, owner, name: str) -> None:
        self.installed = f"_linnet_installed_{name}"

    def __get__(self, model, owner=None):
        if model is None:
            return getattr(owner, self.implementation)
        return model.__dict__.get(self.installed) or getattr(model, self.implementation)

    def __set__(self, model, function) -> None:
        if not self.skipped(function):
            model.__dict__[self.installed] = function

    def __delete__(self, model) -> None:
        model.__dict__.pop(self.installed, None)


def _code(function):
    return getattr(getattr(function, "__func__", function), "__code__", None)


def _trls_fused_lm_head(function) -> bool:
    """TRL's fused LM head (trl.trainer.utils.add_fused_lm_head): it reads the head's weight; the engine
    computes the same outputs with fused_lm_head=True."""
    code = _code(function)
    return code is not None and code.co_name == "_fused_forward"


def _fsdp2_forward_hooks(function) -> bool:
    """FSDP2's register_fsdp_forward_method wrapper (transformers' Trainer puts it around generate under
    accelerate's FSDP2): it unshards through FSDP2's state, which the engine does not keep; the engine
    gathers each layer's weights where it uses them."""
    code = _code(function)
    return code is not None and code.co_name == "wrapped_method" and "fsdp" in code.co_filename


class ShardedCausalLM:
    """What a transformers causal LM becomes once sharded (mixed in before its own class)."""

    forward = _Guarded("_forward", _trls_fused_lm_head)
    generate = _Guarded("_generate", _fsdp2_forward_hooks)
    # transformers' mark of a module FSDP2 shards: its generate() then keeps every rank calling the forward
    # until every rank's sequences are done (synced_gpus), as the collectives inside need.
    _is_fsdp_managed_module = True

    def _generate(self, *args, use_cache: bool | None = None, synced_gpus: bool | None = None, **kwargs):
        """transformers' generate(), every rank together, without a key-value cache: each new token's forward
        computes the whole sequence so far (the engine computes loss and logits, and keeps no cache; a
        generation config's use_cache is overridden)."""
        if use_cache:
            raise UserError("a model sharded by Linnet generates without a key-value cache: leave use_cache out "
                            "of generate()")
        if synced_gpus is False and dist.get_world_size(self._linnet_engine.sharding.group_name) > 1:
            raise UserError("a model sharded by Linnet generates with every rank calling its forward until every "
                            "rank's sequences are done: leave synced_gpus out of generate()")
        return super().generate(*args, use_cache=False, synced_gpus=synced_gpus, **kwargs)

    def _forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                 return_dict=None, cache_position=None, logits_to_keep=0, num_items_in_batch=None,
                 fused_lm_head: bool = False, shift_labels=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                 max_length_q=None, max_length_k=None, seq_idx=None, **kwargs):
        """transformers' forward of a causal LM: `.loss` of `labels` (shifted; or `shift_labels`, already
        shifted), or `.logits` without them (the last `logits_to_keep` positions' where not 0); the documents
        of a packed row from position_ids (cu_seq_lens_* and the like, as TRL's padding-free collator gives
        them beside position_ids, are taken and not read); with
        fused_lm_head=True, TRL's FusedCausalLMOutput (each next
        token's log-probability, the distribution's entropy, whether the label is the likeliest token)."""

        # TRL's padding-free collator gives the documents' bounds for flash attention's kernels beside
        # position_ids, which say the same: the engine reads position_ids.
        bounds = (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx)
        refused = {"flash attention's bounds (cu_seq_lens_*, max_length_*, seq_idx) without position_ids":
                   position_ids is None and any(b is not None for b in bounds),
                   "inputs_embeds": inputs_embeds is not None, "past_key_values": past_key_values is not None,
                   "output_attentions": bool(output_attentions), "output_hidden_states": bool(output_hidden_states),
                   "logits_to_keep": not isinstance(logits_to_keep, int), **{key: True for key in kwargs}}
        if any(refused.values()):
            names = ", ".join(key for key, given in refused.items() if given)
            raise UserError(f"a model sharded by Linnet computes the loss or the logits of input_ids (with "
                            f"attention_mask, position_ids, labels, num_items_in_batch); it does not take {names}")
        engine = self._linnet_engine
        # The compute dtype is fully_shard's (mp_policy's param_dtype, else the parameters' dtype): an autocast
        # around the forward (accelerate's mixed_precision, TrainingArguments' bf16) is left outside.
        with torch.autocast(engine.device.type, enabled=False):
            return self._engine_forward(engine, input_ids, attention_mask, position_ids, labels, shift_labels,
                                        num_items_in_batch, fused_lm_head, logits_to_keep)

    @staticmethod
    def _engine_forward(engine: TorchModel, input_ids, attention_mask, position_ids, labels, shift_labels,
                        num_items_in_batch, fused_lm_head: bool, logits_to_keep: int):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        tokens, positions, segments = _packed_inputs(input_ids, attention_mask, position_ids, engine.device)
        rows, length = tokens.shape
        shape = _agreed_shape(engine, rows, length)
        if labels is None and shift_labels is None:
            inputs = _padded(shape, tokens=tokens, positions=positions, segments=segments)
            logits = engine._call("logits_packed", inputs)[:rows, :length]
            return CausalLMOutputWithPast(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)
        if shift_labels is not None:
            shifted = shift_labels.to(engine.device)
        else:
            shifted = F.pad(labels.to(engine.device), (0, 1), value=IGNORE_INDEX)[:, 1:]
        counted = shifted != IGNORE_INDEX
        targets = torch.where(counted, shifted, 0).to(torch.int32)
        if fused_lm_head:
            inputs = _padded(shape, tokens=tokens, targets=targets, positions=positions, segments=segments)
            statistics = engine._call("token_statistics_packed", inputs)
            return _fused_outputs(statistics[:rows, :length], counted, shift_labels is None, num_items_in_batch)
        weights = counted.to(torch.float32)
        inputs = _padded(shape, tokens=tokens, targets=targets, positions=positions, segments=segments, weights=weights)
        loss = engine._call("loss_packed", inputs)
        if num_items_in_batch is not None:  # transformers' sum over the batch's counted tokens, not this row's mean
            loss = loss * weights.sum() / torch.as_tensor(num_items_in_batch, device=loss.device)
        return CausalLMOutputWithPast(loss=loss)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The full weights under transformers' names (tied ones under both), in the dtype the model's
        parameters had, on the CPU. Every rank must call it: each group is gathered in turn."""
        if args:
            raise TypeError("state_dict takes keyword arguments only")
        from linnet.torch.collectives import gathered_weights

        engine = self._linnet_engine
        out = destination if destination is not None else {}
        for name, tensor in gathered_weights(engine, self._linnet_saved_dtype):
            out[prefix + name] = tensor
        for tied, weight in tied_names(engine.checked).items():
            out[prefix + tied] = out[prefix + weight]
        return out

    def load_state_dict(self, *args, **kwargs):
        raise UserError("a model sharded by Linnet does not load a state dict: build the model on the meta "
                        "device from its folder, and fully_shard reads this rank's parts from there; or "
                        "model.load_weights(FOLDER) into the model as it is")

    def load_weights(self, folder) -> None:
        """Overwrites this rank's parts, in place (an optimizer over `parameters()` keeps them), with the
        weights of a folder that save_pretrained or from_pretrained's checkpoint holds, read a group at a
        time: only the rows of this rank's parts. Every rank calls it; the names and shapes are checked first."""
        from linnet.torch.agree import together
        from linnet.torch.read_parts import read_parts_into

        together(lambda: read_parts_into(self._linnet_engine, folder), f"read the weights of {folder}")

    def save_pretrained(self, save_directory, *, is_main_process: bool = True, state_dict=None,
                        max_shard_size: int | str = "5GB", safe_serialization: bool = True,
                        dtype: torch.dtype | None = None, **kwargs):
        """A folder that `from_pretrained` loads: SafeTensors in `dtype` (default: the dtype the model's
        parameters had; float32 keeps the parts exactly, as a checkpoint to resume from must), written once
        from the parts (one group gathered at a time), with the model's own config.json and generation
        config. Every rank must call it, whatever `is_main_process` says.

        state_dict: full weights under transformers' names, gathered already (as `get_model_state_dict(...,
        full_state_dict=True)` gives them, which every rank calls): written by the rank given it, alone. The
        plain Trainer's save under accelerate's FSDP2 passes one on the first rank."""
        if not safe_serialization:
            raise UserError("a model sharded by Linnet saves SafeTensors: call save_pretrained without "
                            "safe_serialization=False")
        dtype = dtype or self._linnet_saved_dtype
        if state_dict is not None:
            if is_main_process:  # (the other ranks were given nothing to write)
                self._write_configs(self._write_state_dict(save_directory, state_dict, max_shard_size, dtype), dtype)
            return
        from linnet.torch.agree import together

        engine = self._linnet_engine
        folder = engine.save_weights(save_directory, dtype=dtype, max_shard_size=max_shard_size)
        first = engine.sharding.rank == 0 and engine.sharding.replica == 0
        together(lambda: self._write_configs(folder, dtype) if first else None, f"write the config to {folder}")

    def _write_state_dict(self, folder, state_dict: dict, max_shard_size: int | str, dtype: torch.dtype) -> Path:
        from linnet.hf.write import write_hf_checkpoint

        engine = self._linnet_engine
        shapes = {spec.checkpoint_name: spec.shape for spec in engine.specs()}
        sharded = next((name for name, value in state_dict.items() if isinstance(value, DTensor)), None)
        if sharded is not None:
            raise UserError(f"save_pretrained was given {sharded} as a DTensor (one rank's part): give the full "
                            "state dict (get_model_state_dict with full_state_dict=True), or none")
        missing = [name for name in shapes if name not in state_dict]
        if missing:
            raise UserError(f"save_pretrained was given a state dict without {missing[0]} ({len(missing)} of the "
                            f"model's {len(shapes)} weights missing): give the full state dict, or none")
        wrong = [name for name, shape in shapes.items() if tuple(state_dict[name].shape) != tuple(shape)]
        if wrong:
            raise UserError(f"save_pretrained was given {wrong[0]} of shape {tuple(state_dict[wrong[0]].shape)}, not "
                            f"the full weight's {tuple(shapes[wrong[0]])}: give the full state dict "
                            "(get_model_state_dict with full_state_dict=True)")
        tensors = ((name, state_dict[name]) for name in shapes)
        return write_hf_checkpoint(engine.card, shapes, tensors, Path(folder), dtype, max_shard_size=max_shard_size)

    def _write_configs(self, folder, dtype: torch.dtype) -> None:
        """The model's own config.json (saying the dtype the weights were written in) and generation config,
        over the card's."""
        self.config.save_pretrained(folder)
        path = Path(folder) / "config.json"
        config = json.loads(path.read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")  # transformers' name for it
        if "torch_dtype" in config:  # (its older key)
            config["torch_dtype"] = config["dtype"]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if getattr(self, "generation_config", None) is not None and self.can_generate():
            self.generation_config.save_pretrained(folder)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch for gradient accumulation: False on all but the last micro-batch, and their backwards
        hold each group's whole gradient on this rank (f32, 4 bytes a weight) instead of reduce-scattering it;
        True again, and the held gradients are reduce-scattered once, beside the last micro-batch, and added to
        the parameters' gradients by its backward (linnet/torch/held_gradients.py)."""
        self._linnet_engine.hold_gradients(not requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's name for the same: backwards inside hold their gradients, released on leaving. accelerate's
        `no_sync` (transformers' Trainer accumulating micro-batches) calls it where it is not configured for
        FSDP2; configured for FSDP2, it calls set_requires_gradient_sync."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers: int = 1,
                                        offload: bool = False, **kwargs) -> None:
        """transformers' activation checkpointing: the engine recomputes each layer in its backward
        (recompute "full"), compiled again. Every layer, on the GPU: every_n_layers and offload are refused."""
        if every_n_layers != 1 or offload:
            raise UserError("a model sharded by Linnet recomputes every layer, its activations on the GPU: "
                            "leave every_n_layers and offload out of activation_checkpointing_kwargs")
        self._linnet_engine.recompute_as("full")

    def activation_checkpointing_disable(self) -> None:
        """Back to the recompute policy fully_shard was given (or chose)."""
        self._linnet_engine.recompute_as(self._linnet_recompute)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs) -> None:
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        return self._linnet_engine.sharding.recompute == "full"

    is_gradient_checkpointing = is_activation_checkpointing

    def reshard(self) -> None:
        """FSDP2's: frees the weights an unshard gathered. The engine holds no layer's weights gathered outside
        its forward and backward (transformers' Trainer calls this on every FSDPModule before training)."""

    def _get_fsdp_state(self):
        raise UserError(f"{type(self).__name__} is sharded by Linnet, not by FSDP2: FSDP2's controls of a module "
                        "(unshard, reshard, prefetch and hook settings) do not apply to it")

    def _apply(self, fn, recurse: bool = True):
        """A move or cast (`model.to(...)`, `.cuda()`, `.bfloat16()`) that would change the parts is refused:
        they stay f32 where they were sharded. One that changes nothing passes."""
        engine = self._linnet_engine
        probe = fn(torch.empty(0, dtype=torch.float32, device=engine.device))
        if probe.dtype != torch.float32 or probe.device != engine.device:
            raise UserError(f"this model is sharded by Linnet: its parts stay f32 on {engine.device} (moved to "
                            f"{probe.device} in {probe.dtype} they would leave the function that trains them); "
                            "pass mp_policy to fully_shard for the compute dtype")
        return self


def _fused_outputs(statistics: torch.Tensor, counted: torch.Tensor, shifted_here: bool, num_items_in_batch):
    """TRL's FusedCausalLMOutput from token_statistics_packed's (log-probability, entropy, top-1) a position:
    shaped as TRL's (the last position dropped where the labels were shifted here), zero where the label is
    ignored, and the loss as TRL's fused head computes it."""
    from trl.trainer.utils import FusedCausalLMOutput

    if shifted_here:
        statistics, counted = statistics[:, :-1], counted[:, :-1]
    log_probs, entropy = statistics[..., 0] * counted, statistics[..., 1] * counted
    divisor = counted.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-log_probs.sum() / divisor, log_probs=log_probs, entropy=entropy,
                               is_top1=(statistics[..., 2] > 0.5) & counted, label_mask=counted)


def _agreed_shape(engine: TorchModel, rows: int, length: int) -> tuple[int, int]:
    """The (rows, length) every rank computes this call at: the largest of any rank's. An untied embedding's
    lookup exchanges the ranks' tokens, which must be as many on each; a rank whose batch is shorter (padded
    to its own longest row, or the last batch of an epoch) pads it further."""
    if engine.sharding.world == 1:
        return rows, length
    from linnet.torch.agree import cpu_group

    shape = torch.tensor([rows, length])
    dist.all_reduce(shape, dist.ReduceOp.MAX, group=cpu_group(engine.sharding.group_name))
    return int(shape[0]), int(shape[1])


def _padded(shape: tuple[int, int], **inputs: torch.Tensor) -> tuple:
    """The entry's inputs, in the order given, padded to `shape`: the padding is a segment of its own (-2,
    apart from a padding mask's -1 and the documents' 0 and up), so no real token attends to it, and it takes
    no weight."""
    rows, length = inputs["tokens"].shape
    grow = (0, shape[1] - length, 0, shape[0] - rows)
    if not any(grow):
        return tuple(inputs.values())
    return tuple(F.pad(tensor, grow, value=-2 if name == "segments" else 0) for name, tensor in inputs.items())


def _packed_inputs(input_ids, attention_mask, position_ids, device: torch.device):
    """(tokens, positions, segments) as loss_packed takes them, from transformers' arguments: positions
    position_ids or 0..S-1; segments by transformers' rule, a padding mask's zeros a segment of their own,
    else packed documents by where position_ids do not go up by one."""
    if input_ids is None or input_ids.dim() != 2:
        raise UserError(f"input_ids must be a (batch, sequence) tensor of token ids, got "
                        f"{None if input_ids is None else tuple(input_ids.shape)}")
    tokens = input_ids.to(device=device, dtype=torch.int32)
    batch, length = tokens.shape
    if position_ids is None:
        positions = torch.arange(length, device=device, dtype=torch.int32).expand(batch, length)
    else:
        positions = position_ids.to(device=device, dtype=torch.int32).expand(batch, length)
    if attention_mask is not None:
        if attention_mask.shape != tokens.shape:
            raise UserError(f"attention_mask must be a padding mask shaped as input_ids {tuple(tokens.shape)}, got "
                            f"{tuple(attention_mask.shape)}")
        segments = torch.where(attention_mask.to(device).bool(), 0, -1).to(torch.int32)
    elif position_ids is not None:
        steps = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
        segments = (steps != 1).cumsum(-1).to(torch.int32)
    else:
        segments = torch.zeros_like(tokens)
    return tokens.contiguous(), positions.contiguous(), segments.contiguous()


def _refuse_unsupported(model) -> None:
    name = type(model).__name__
    if hasattr(model, "peft_config") or type(model).__module__.startswith("peft."):
        raise UserError(f"{name} carries PEFT adapters: Linnet does full fine-tuning; merge them "
                        "(model.merge_and_unload()) or give fully_shard the base model")
    if isinstance(model, ShardedCausalLM):
        raise UserError(f"{name} is already sharded by Linnet: fully_shard it once")
    if name.startswith("FSDP") or any(type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor")
                                      for p in model.parameters()):
        raise UserError(f"{name} is already sharded by PyTorch's FSDP (its parameters are DTensors): give "
                        "Linnet's fully_shard the model as from_pretrained made it, not FSDP's")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in huggingface.FAMILIES:
        raise UserError(f"{name}: model_type {model_type!r} has no family in Linnet; supported: "
                        f"{', '.join(sorted(huggingface.FAMILIES))}")
    if not name.endswith("ForCausalLM"):
        raise UserError(f"fully_shard takes a transformers causal LM (…ForCausalLM) or one of its decoder layers, "
                        f"got {name}")


def _parameters_dtype(model) -> torch.dtype:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise UserError(f"fully_shard takes a model whose parameters share one dtype, got {sorted(map(str, dtypes))}")
    return dtypes.pop()


def _weights_folder(model, weights) -> Path:
    """The folder this rank reads its parts from: `weights`, else the folder (or cached hub id) the model
    was made from."""
    source = weights or getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    folder = Path(source) if source and Path(source).is_dir() else (source and huggingface.snapshot(str(source)))
    if not folder:
        raise UserError(f"{type(model).__name__} is on the meta device and was not made from a folder "
                        f"({source!r}): give fully_shard(model, weights=FOLDER), a folder of its SafeTensors")
    return Path(folder)


def _take_weights(model, engine: TorchModel) -> dict:
    """The model's weights under the engine's groups (the tensors themselves: fully_shard casts each group
    to its f32 part and drops it before the next)."""
    state = dict(model.named_parameters(remove_duplicate=False))
    missing = [spec.checkpoint_name for spec in engine.specs() if spec.checkpoint_name not in state]
    if missing:
        raise UserError(f"{type(model).__name__} has no parameter {missing[0]}, which its family computes with: "
                        "fully_shard takes the model as transformers builds it")
    return grouped((spec, state[spec.checkpoint_name].detach()) for spec in engine.specs())


def group_device(group: dist.ProcessGroup, model: torch.nn.Module) -> torch.device:
    """Where the engine's parts live: the model's device where the group's backend takes it, else the
    current GPU where the group takes CUDA tensors (FSDP2 moves a CPU model to the mesh's device too)."""
    takes = {device.type for device in group._device_types}
    current = next((p.device for p in model.parameters() if not p.is_meta), None)
    if current is not None and current.type in takes:
        return current
    if "cuda" in takes and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gradient_checkpointing(model) -> bool:
    """Whether transformers' gradient (activation) checkpointing is enabled on `model`."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))
