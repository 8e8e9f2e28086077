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
configured for FSDP2 it passes the model through as it is (the model presents itself as an FSDPModule), but
the plain Trainer's FSDP save then hands save_pretrained a state dict on the first rank alone, which the
sharded model refuses: the trainers here save from every rank instead (not yet run on GPUs).

`ShardedTrainerMixin` adapts any Trainer subclass:
- the model is prepared as it is, never wrapped;
- `save_model` writes the folder from every rank (each group is gathered in turn; the first rank
  writes), with the tokenizer or processor beside it;
- a checkpoint keeps each rank's optimizer state in a file of its own, so nothing is lost; resuming a
  Trainer run from one is refused (not supported yet), naming the way to start again from its weights."""

from __future__ import annotations

import os

import torch.distributed as dist

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

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint:
            raise UserError(f"resuming a Trainer run of a model sharded by Linnet is not supported yet "
                            f"({resume_from_checkpoint}): start a new run from the checkpoint's weights, "
                            "AutoModelForCausalLM.from_pretrained(CHECKPOINT) and fully_shard")
        return super().train(None, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not isinstance(self.model, ShardedCausalLM):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        self.model.save_pretrained(output_dir)  # every rank: the groups are gathered in turn
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        if self.args.should_save:
            self.args.to_json_string()  # (checks the arguments serialise, as Trainer._save does before writing)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not isinstance(self.model, ShardedCausalLM):
            return super()._save_optimizer_and_scheduler(output_dir)
        import torch

        rank, world = dist.get_rank(), dist.get_world_size()
        os.makedirs(output_dir, exist_ok=True)
        torch.save(self.optimizer.state_dict(), os.path.join(output_dir, f"optimizer-rank{rank}-of-{world}.pt"))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))


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
