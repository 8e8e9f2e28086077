"""TRL's SFTTrainer on a tiny Llama and chat rows, started by torchrun (or accelerate launch):

    torchrun --nproc_per_node=2 tests/trl_driver.py ddp|linnet OUT [CHECKPOINT]

ddp: TRL as a TRL user runs it (on CPUs accelerate wraps the model in DistributedDataParallel: it runs
FSDP only on accelerators). linnet: the same script with the lines a Linnet user changes, fully_shard and
linnet.torch.trainers' SFTTrainer, saving a checkpoint every 2 steps; with CHECKPOINT, resumed from it.
Rank 0 writes the logged history to OUT/history.json; the trained model is saved to OUT/final."""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from datasets import Dataset
from transformers import AutoTokenizer
from trl import SFTConfig

from hf_models import make_hf_model

mode, out = sys.argv[1], Path(sys.argv[2])
resume_from = sys.argv[3] if len(sys.argv) > 3 else None
tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[1] / "linnet/cards/tokenizers/tiny")
rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                      {"role": "assistant", "content": f"{2 * i}, since {i} and {i} make {2 * i}"}]} for i in range(32)]
# a resumed run starts from other weights: all it trains on must come from the checkpoint
model = make_hf_model("llama", seed=1 if resume_from else 0, vocab_size=512)
if mode == "linnet":
    dist.init_process_group("gloo")
    from linnet.torch import fully_shard
    from linnet.torch.trainers import SFTTrainer

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
else:
    from trl import SFTTrainer

# TRL's defaults but for the run's length, packed rows (packing=True: padding-free, the documents told apart by
# position_ids), a CPU, f32 (TRL's bf16 default is an autocast around the forward, which Linnet leaves outside: its
# compute dtype is fully_shard's mp_policy), and AdamW's eps raised from 1e-8 (there an element whose gradient is
# rounding moves a full step either way: tests/test_drop_in.py)
# Two micro-batches a step: Linnet's model holds the first one's gradients (accelerate's no_sync)
args = SFTConfig(output_dir=str(out / "run"), max_steps=4, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                 learning_rate=1e-3,
                 adam_epsilon=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0, max_length=48, bf16=False,
                 packing=True, save_strategy="steps" if mode == "linnet" else "no", save_steps=2)
trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
trainer.train(resume_from_checkpoint=resume_from)
trainer.save_model(str(out / "final"))
if dist.get_rank() == 0:
    logged = ("loss", "grad_norm", "entropy", "mean_token_accuracy")
    history = [{key: entry[key] for key in logged} for entry in trainer.state.log_history if "loss" in entry]
    (out / "history.json").write_text(json.dumps(history))
    if mode == "linnet":  # whether the first micro-batch of a step held its gradients
        (out / "held.json").write_text(json.dumps(model._linnet_engine.held_gradients is not None))
