"""transformers' Trainer and TRL's SFTTrainer for a model that `linnet.torch.fully_shard` sharded in place:

    from linnet.torch import fully_shard
    from linnet.torch.trainers import SFTTrainer        # in place of `from trl import SFTTrainer`

    model = AutoModelForCausalLM.from_pretrained(folder)
    fully_shard(model)
    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=...)
    trainer.train()

The model already shares its gradients out (each backward reduce-scatters them into the ranks' parts), so
the trainer must not wrap it again: accelerate would wrap it in DistributedDataParallel wherever it is not
configured for FSDP2 (on CPUs always: accelerate runs FSDP only on accelerators). Where accelerate is
configured for FSDP2 it passes the model through as it is (the model presents itself as an FSDPModule), and
the plain Trainer's FSDP save gathers a full state dict on every rank and has the first write it; the
trainers here save from every rank instead, one group gathered at a time.

`ShardedTrainerMixin` adapts any Trainer subclass:
- the model is prepared as it is, never wrapped;
- `save_model` writes the folder from every rank (each group is gathered in turn; the first rank
  writes), with the tokenizer or processor beside it;
- a checkpoint holds the weights in f32 (the parts as they are) and each rank's optimizer state (its parts'
  moments) in a file of its own; resuming from one (`train(resume_from_checkpoint=...)`) reads this rank's
  parts of the saved weights and its own optimizer state, over the mesh that saved it;
- `load_best_model_at_end` reads the best checkpoint's weights into the parts."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from linnet.errors import UserError
from linnet.torch.causal_lm import ShardedCausalLM

__all__ = ["ShardedTrainerMixin"]  # and Trainer, SFTTrainer: made when first imported (__getattr__)


class ShardedTrainerMixin:
    """Mixed in before a transformers Trainer (or a subclass of one, such as TRL's)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        prepare_model = accelerator.prepare_model

        def prepare_sharded_model(model, device_placement=None, evaluation_mode=False):
            if isinstance(model, ShardedCausalLM):  # shared out already: no DDP, no FSDP, no move
                if model not in accelerator._models:
                    accelerator._models.append(model)
                return model
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        accelerator.prepare_model = prepare_sharded_model

    def _move_model_to_device(self, model, device):
        if not isinstance(model, ShardedCausalLM):  # its parts stay where fully_shard put them
            super()._move_model_to_device(model, device)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not isinstance(self.model, ShardedCausalLM):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self.model.load_weights(resume_from_checkpoint)  # every rank: this rank's parts of the saved weights

    def _load_best_model(self) -> None:
        if not isinstance(self.model, ShardedCausalLM):
            return super()._load_best_model()
        self.model.load_weights(self.state.best_model_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not isinstance(self.model, ShardedCausalLM):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        # every rank: the groups are gathered in turn; a checkpoint (an internal call) in f32, the parts as they
        # are, so that a run resumed from it takes up exactly where this one is
        self.model.save_pretrained(output_dir, dtype=torch.float32 if _internal_call else None)
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        if self.args.should_save:
            self.args.to_json_string()  # (checks the arguments serialise, as Trainer._save does before writing)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not isinstance(self.model, ShardedCausalLM):
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        torch.save(local_state(self.optimizer.state_dict()), os.path.join(output_dir, optimizer_file()))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not isinstance(self.model, ShardedCausalLM):
            return super()._load_optimizer_and_scheduler(checkpoint)
        from linnet.torch.agree import together

        saved = sorted(name for name in os.listdir(checkpoint) if name.startswith("optimizer-rank"))
        if not saved:  # (save_only_model=True): the weights alone, as transformers resumes from them
            return

        def read() -> tuple[dict, dict]:
            path = os.path.join(checkpoint, optimizer_file())
            if not os.path.isfile(path):
                raise UserError(f"{checkpoint} holds no optimizer state for rank {dist.get_rank()} of "
                                f"{dist.get_world_size()} (it holds {', '.join(saved)}): resume on as many "
                                "processes, over the same mesh, as saved it, or start a new run from its weights")
            optimizer = sharded_state(self.optimizer, torch.load(path, map_location="cpu", weights_only=True), path)
            return optimizer, torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True)

        optimizer_state, scheduler_state = together(read, f"read the optimizer state of {checkpoint}")
        self.optimizer.load_state_dict(optimizer_state)
        self.lr_scheduler.load_state_dict(scheduler_state)


SCHEDULER_FILE = "scheduler.pt"  # transformers' name


def optimizer_file() -> str:
    """This rank's optimizer state in a Trainer checkpoint: its parts' moments alone."""
    return f"optimizer-rank{dist.get_rank()}-of-{dist.get_world_size()}.pt"


def _each_state(state_dict: dict, change) -> dict:
    """An optimizer's state dict with each value of a parameter's state changed: change(parameter index, value)."""
    return {**state_dict, "state": {index: {name: change(int(index), value) for name, value in state.items()}
                                    for index, state in state_dict["state"].items()}}


def local_state(state_dict: dict) -> dict:
    """An optimizer's state dict with each DTensor as this rank's local tensor (what torch.load reads back
    with weights_only=True, without the mesh)."""
    return _each_state(state_dict, lambda _, value: value.to_local() if isinstance(value, DTensor) else value)


def sharded_state(optimizer: torch.optim.Optimizer, state_dict: dict, path: str) -> dict:
    """`local_state`'s inverse for `optimizer`: each state tensor of a parameter's local part becomes a DTensor
    laid out as the parameter (a step count, of no dimension, stays as it is). A tensor of another shape (a
    state saved over another mesh) is refused, naming `path`."""
    params = [param for group in optimizer.param_groups for param in group["params"]]

    def placed(index: int, value):
        param = params[index]
        if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        local = param.to_local()
        if value.shape != local.shape:
            raise UserError(f"{path}: a state of parameter {index} has shape {tuple(value.shape)}, this "
                            f"rank's part {tuple(local.shape)}: it was saved over another mesh; resume over the "
                            "mesh that saved it")
        return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())

    return _each_state(state_dict, placed)


def __getattr__(name: str):
    """Trainer and SFTTrainer with the mixin, made when first asked for (TRL is imported only then)."""
    if name == "Trainer":
        from transformers import Trainer as base
    elif name == "SFTTrainer":
        from trl import SFTTrainer as base
    else:
        raise AttributeError(f"module {__name__} has no attribute {name}")
    made = type(name, (ShardedTrainerMixin, base), {"__module__": __name__, "__doc__": base.__doc__})
    globals()[name] = made
    return made
