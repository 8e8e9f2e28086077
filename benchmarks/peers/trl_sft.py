"""Peer of the benchmark table: TRL's SFTTrainer under accelerate's FSDP2 plugin, set up the way TRL's
own FSDP2 example does (benchmarks/peers/trl_fsdp2.yaml, a copy of trl/accelerate_configs/fsdp2.yaml
with its deviations commented), on the table's shared start: the same initial checkpoint, the same
pre-packed 4096-token rows (rank r of W trains on rows r, r + W, ...; one row a GPU a step) and the
same held-out rows. benchmarks/peers/TRL.md says how it is set up and what differs from TRL's example.

    bash benchmarks/trl.sh run 4 --init START/init --rows START/rows.npz --held-out START/held_out.npz --steps 30
    # = accelerate launch --config_file benchmarks/peers/trl_fsdp2.yaml --num_processes 4 \\
    #       benchmarks/peers/trl_sft.py ...

    python benchmarks/peers/trl_sft.py --init ... --rows ... --steps 5      # one process, no FSDP (CPU too)

With --linnet, the same script as a TRL user who moves to Linnet runs it (README, "From transformers, FSDP2
or TRL"): the model from_pretrained(init) in f32, `linnet.torch.fully_shard(model, mp_policy=bf16)` (f32
parts, bf16 compute, as FSDP2's mixed precision above), and `linnet.torch.trainers.SFTTrainer`; everything
else as above, launched the same way (accelerate, configured for FSDP2, passes the sharded model through).

Prints `RESULT {json}` on rank 0: system, shape, world, steps, step_s (median step after the first 3),
tok_s (world x S / step_s), peak_gib (torch.cuda.max_memory_allocated, max over ranks), loss_start
and loss_end (held-out, before the first step and after the last), losses (the training loss of
each step: the weights-weighted mean over every rank's row) and deviations (from TRL's example).

The rows reach the model as TRL's padding-free collator (the one `packing=True` uses) makes them
from packed rows: input_ids, position_ids restarting at each document, no attention mask, so
transformers builds the block-diagonal causal mask from position_ids (also under SDPA); the
collator's position_ids are replaced by the rows' own, and the loss takes the rows' pre-shifted
targets (`shift_labels`, -100 where the weight is 0), so it covers exactly the positions of weight 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

FIELDS = ("tokens", "targets", "positions", "segments", "weights")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", required=True, help="Hugging Face checkpoint folder (config.json, model*.safetensors)")
    p.add_argument("--rows", required=True, help=".npz of (N, S) arrays tokens, targets, positions, segments, weights")
    p.add_argument("--held-out", help=".npz of rows for the held-out loss before the first step and after the last")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--ac", action="store_true",
                   help="gradient checkpointing (SFTConfig.gradient_checkpointing, TRL's default)")
    p.add_argument("--compile", action="store_true",
                   help="SFTConfig.torch_compile: accelerate compiles the prepared model")
    p.add_argument("--shape", help="label for the RESULT line (default: hidden size x layers from config.json)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention", "eager", "flash_attention_2"],
                   help="attn_implementation (default sdpa, transformers' own; flash-attn is not installed)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="bf16: SFTConfig(bf16=True) and the launcher's mixed_precision bf16 (the table); "
                        "fp32: no mixed precision (only for checking the loss by hand on a CPU; under accelerate "
                        "launch also pass --mixed_precision no)")
    p.add_argument("--linnet", action="store_true",
                   help="the model sharded by linnet.torch.fully_shard, trained by linnet.torch.trainers.SFTTrainer")
    p.add_argument("--output-dir", default=os.environ.get("TRL_SFT_OUTPUT_DIR", "/tmp/trl_sft_out"),
                   help="SFTConfig.output_dir (nothing is saved there)")
    return p.parse_args(argv)


def load_rows(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as arrays:
        rows = {f: arrays[f] for f in FIELDS}
    n, s = rows["tokens"].shape
    for f in FIELDS:
        if rows[f].shape != (n, s):
            raise ValueError(f"{path}: {f} has shape {rows[f].shape}, tokens {rows['tokens'].shape}")
    w = rows["weights"]
    if not np.isin(w, (0.0, 1.0)).all():
        raise ValueError(f"{path}: weights other than 0 and 1; TRL's loss masks positions, it does not weight them")
    return rows


def documents_from_positions(positions: np.ndarray) -> np.ndarray:
    """The document index transformers derives from position_ids (masking_utils.find_packed_sequence_indices):
    a new document wherever a position is not the previous one plus 1."""
    first = positions[:, :1] - 1
    return (np.diff(positions, prepend=first, axis=-1) != 1).cumsum(-1)


def attention_matches_segments(rows: dict[str, np.ndarray]) -> bool:
    """Whether the mask built from position_ids lets every trained position see exactly the earlier
    positions of its own segment, as the segment ids say. Both labelings must then put the start of
    the document around each trained position at the same index (segments being contiguous runs).
    Padding (positions all 0 in the rows) becomes one document a position: it comes after the
    documents, so no trained position sees it."""
    def run_starts(labels):
        change = np.ones(labels.shape, bool)
        change[:, 1:] = labels[:, 1:] != labels[:, :-1]
        return np.maximum.accumulate(np.where(change, np.arange(labels.shape[1]), 0), axis=1), change.sum(1)

    seg = rows["segments"]
    seg_starts, seg_runs = run_starts(seg)
    if any(runs != len(np.unique(s)) for runs, s in zip(seg_runs, seg)):
        return False  # a segment id that comes back later in its row: not a run
    doc_starts, _ = run_starts(documents_from_positions(rows["positions"]))
    trained = rows["weights"] > 0
    return bool((seg_starts[trained] == doc_starts[trained]).all())


def row_columns(rows: dict[str, np.ndarray]) -> dict[str, list]:
    """Per row: the columns a pre-tokenized TRL dataset carries (input_ids, labels, seq_lengths) and the
    two this script adds (position_ids, shift_labels).

    labels are TRL's unshifted form (labels[t] = tokens[t] where the prediction of tokens[t], made at
    t - 1, is trained; -100 elsewhere): transformers' loss and TRL's fused LM head shift them by one.
    shift_labels are the rows' own targets (-100 where the weight is 0), which the fused LM head takes
    unshifted: they also cover the last position of a row whose document goes on in the next row, a
    target that shifted labels cannot express."""
    tok, tgt, w = rows["tokens"].astype(np.int64), rows["targets"].astype(np.int64), rows["weights"]
    labels = np.full_like(tok, -100)
    labels[:, 1:] = np.where(w[:, :-1] > 0, tok[:, 1:], -100)
    shift_labels = np.where(w > 0, tgt, -100)
    seq_lengths = []
    for seg in rows["segments"]:
        starts = np.flatnonzero(np.diff(seg, prepend=seg[0] - 1) != 0)
        seq_lengths.append(np.diff(np.append(starts, len(seg))).tolist())
    return dict(input_ids=tok.tolist(), labels=labels.tolist(), seq_lengths=seq_lengths,
                position_ids=rows["positions"].astype(np.int64).tolist(), shift_labels=shift_labels.tolist(),
                row=list(range(len(tok))))


class PackedRowsCollator:
    """TRL's padding-free collator (what SFTTrainer uses with packing=True), then the rows' own
    position_ids and pre-shifted labels in place of the ones it derives from seq_lengths."""

    def __init__(self, pad_token_id: int):
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        self.trl = DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=True)
        self.rows_seen = []  # the index in the .npz of each row collated, to check which rows a rank trains on

    def __call__(self, examples):
        if len(examples) != 1:
            raise ValueError(f"one packed row a step a GPU, got a batch of {len(examples)}")
        self.rows_seen += [e["row"] for e in examples]
        out = self.trl([{k: e[k] for k in ("input_ids", "labels", "seq_lengths")} for e in examples])
        out["position_ids"] = torch.tensor([e["position_ids"] for e in examples], dtype=torch.long)
        out["shift_labels"] = torch.tensor([e["shift_labels"] for e in examples], dtype=torch.long)
        return out


def placeholder_tokenizer(config):
    """SFTTrainer needs a processing class; the rows are already token ids and the shared start has no
    tokenizer, so a three-word one stands in, its special ids those of the model's config (it is used for
    nothing else: the collator is ours)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    def first(ids, default):
        ids = ids[0] if isinstance(ids, (list, tuple)) and ids else ids
        return default if ids is None else int(ids)

    eos = first(config.eos_token_id, 2)
    bos = first(config.bos_token_id, 1 if eos != 1 else 0)
    unk = next(i for i in range(3) if i not in (eos, bos))
    vocab = {"<bos>": bos, "<eos>": eos, "<unk>": unk}
    pad = config.pad_token_id
    if pad is not None and pad not in vocab.values():
        vocab["<pad>"] = int(pad)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    pad_token = ("<pad>" if "<pad>" in vocab else "<eos>" if pad is None or pad == eos
                 else "<bos>" if pad == bos else "<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token=pad_token)


def linnet_model(args, cuda: bool):
    """The model as a TRL user moving to Linnet loads and shards it: f32 weights, bf16 compute and reduction
    (the FSDP2 plugin's mixed precision), gradient checkpointing as recompute "full"."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM

    from linnet.torch import fully_shard

    dist = torch.distributed
    if not dist.is_initialized():  # one process, not launched: a group of one
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    if args.ac:
        model.gradient_checkpointing_enable()
    compute = torch.bfloat16 if args.precision == "bf16" else torch.float32
    return fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=compute))


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoConfig, TrainerCallback
    from datasets import Dataset
    import trl
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    cfg = AutoConfig.from_pretrained(args.init)
    shape = args.shape or f"d{cfg.hidden_size}-L{cfg.num_hidden_layers}"
    train_rows = load_rows(args.rows)
    held_rows = load_rows(args.held_out) if args.held_out else None
    seq = train_rows["tokens"].shape[1]
    separate = all(attention_matches_segments(r) for r in (train_rows, held_rows) if r is not None)

    deviations = [
        "batch: per_device_train_batch_size 1, gradient_accumulation_steps 1 (one pre-packed row a GPU a step; "
        "TRL's example leaves these to the user)",
        "data: rows packed by the benchmark (Linnet's best-fit packer, the same rows for every system) instead of "
        "SFTTrainer's packing=True (bfd); fed pre-tokenized (dataset_kwargs skip_prepare_dataset) through TRL's "
        "padding-free collator, with the rows' own position_ids and pre-shifted labels (shift_labels); "
        "train_sampling_strategy sequential (rank r of W gets rows r, r+W, ...), remove_unused_columns False",
        f"attention: {args.attn} (flash-attn not installed; TRL recommends flash_attention_2 for packing); "
        + ("documents in a row attend only to themselves: transformers builds the block-diagonal causal mask from "
           "position_ids (a dense S x S mask under SDPA)" if separate else
           "WARNING: the mask built from position_ids does not match the rows' segments"),
        "optimizer: adamw_torch_fused (transformers' default), weight_decay 0, constant LR, no warmup, "
        "max_grad_norm 0 (no clipping; transformers' default is 1.0), to match the other systems",
        "gradient_checkpointing " + ("on (--ac)" if args.ac else "off (SFTConfig's default is on; --ac turns it on)"),
        "model: from_pretrained(init, dtype=float32) as TRL's sft script (ModelConfig.dtype default float32), "
        "device_map None (TRL passes 'auto' on GPUs under FSDP); "
        "FSDP2 mixed precision bf16 from the config (param and reduce dtype bf16)",
        "no checkpoints saved (save_strategy no), no eval during training; held-out loss measured by this script "
        "through the prepared model's fused LM head before the first step and after the last",
    ]
    if args.compile:
        deviations.append("torch_compile True: accelerate torch.compiles the whole prepared model")
    if args.precision == "fp32":
        deviations.append("precision fp32 (bf16 off): a check run, not the table's setting")
    if args.linnet:
        deviations.append("linnet: the model from_pretrained(init, dtype=float32), sharded by linnet.torch.fully_shard "
                          f"(mp_policy param_dtype and reduce_dtype {args.precision}, as the FSDP2 plugin's; recompute "
                          "'full' under --ac), trained by linnet.torch.trainers.SFTTrainer; attention: Linnet's own "
                          "(--attn does not apply)")

    def columns(rows):
        return Dataset.from_dict(row_columns(rows))

    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        optim="adamw_torch_fused",
        bf16=args.precision == "bf16",
        gradient_checkpointing=args.ac,
        torch_compile=args.compile,
        packing=False,
        max_length=None,
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        logging_steps=10,
        disable_tqdm=True,
        use_cpu=not cuda,
        # TRL sets device_map None itself for DDP and DeepSpeed, not for FSDP, where its "auto" would spread each
        # process's float32 copy over every visible GPU; None loads it on the CPU (rank 0 only, with
        # fsdp_cpu_ram_efficient_loading) and fully_shard places the shards.
        model_init_kwargs=None if args.linnet else {"dtype": "float32", "attn_implementation": args.attn,
                                                    "device_map": None},
    )
    model = linnet_model(args, cuda) if args.linnet else args.init  # a name: SFTTrainer loads it as TRL's script
    if args.linnet:
        from linnet.torch.trainers import SFTTrainer  # noqa: F811  (TRL's, with Linnet's mixin)

    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = config.device  # this rank's GPU (accelerate set it), or the CPU
    if train_rows["tokens"].shape[0] < args.steps * world:
        raise ValueError(f"{args.rows}: {train_rows['tokens'].shape[0]} rows, {args.steps} steps on {world} ranks need "
                         f"{args.steps * world}")

    def all_reduce(values, op=None):
        t = torch.tensor(values, dtype=torch.float64, device=device)
        if distributed:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.tolist()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Measure(TrainerCallback):
        """Held-out loss around training, per-step wall time, peak memory."""

        def __init__(self):
            self.trainer = None
            self.begin, self.ends, self.loss_start, self.loss_end = [], [], None, None
            self.setup = {}

        def held_out_loss(self):
            if held_rows is None:
                return None
            model = self.trainer.model_wrapped
            mine = {k: v[rank::world] for k, v in held_rows.items()}
            count = len(mine["tokens"])
            cols = row_columns(mine if count else {k: v[:1] for k, v in held_rows.items()})  # a weightless filler
            most = int(all_reduce([count], dist.ReduceOp.MAX if distributed else None)[0])
            was_training = model.training
            model.eval()
            loss_sum = weight_sum = 0.0
            with torch.no_grad():
                for i in range(most):  # a sharded forward is collective: every rank runs as many
                    j = min(i, len(cols["input_ids"]) - 1)  # ranks with fewer rows run copies, not counted
                    batch = {k: torch.tensor([cols[k][j]], dtype=torch.long, device=device)
                             for k in ("input_ids", "position_ids", "shift_labels")}
                    out = model(**batch, fused_lm_head=True, use_cache=False)
                    if i < count:
                        loss_sum += float(-out.log_probs.double().sum())
                        weight_sum += float(out.label_mask.sum())
            model.train(was_training)
            loss_sum, weight_sum = all_reduce([loss_sum, weight_sum])
            return loss_sum / weight_sum

        def on_train_begin(self, targs, state, control, **kw):
            acc = self.trainer.accelerator
            plugin = getattr(acc.state, "fsdp_plugin", None)
            self.setup = dict(distributed=str(acc.distributed_type), model_class=type(self.trainer.model).__name__,
                              fsdp_version=getattr(plugin, "fsdp_version", None),
                              mixed_precision=str(acc.mixed_precision))
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            self.loss_start = self.held_out_loss()
            if rank == 0:
                print(f"held-out loss at start {self.loss_start}", flush=True)

        def on_step_begin(self, targs, state, control, **kw):
            sync()
            self.begin.append(time.perf_counter())

        def on_step_end(self, targs, state, control, **kw):
            sync()
            self.ends.append(time.perf_counter())
            if rank == 0:
                print(f"step {state.global_step} {self.ends[-1] - self.begin[-1]:.3f}s", flush=True)

        def on_train_end(self, targs, state, control, **kw):
            self.loss_end = self.held_out_loss()

    class Trainer(SFTTrainer):
        """SFTTrainer, keeping each step's loss (on the device: no extra synchronisation a step)."""

        step_losses: list

        def training_step(self, *a, **k):
            loss = super().training_step(*a, **k)
            self.step_losses.append(loss.detach().float().reshape(()))
            return loss

    measure = Measure()
    tokenizer = placeholder_tokenizer(cfg)
    collator = PackedRowsCollator(tokenizer.pad_token_id)
    trainer = Trainer(
        model=model,
        args=config,
        train_dataset=columns(train_rows),
        processing_class=tokenizer,
        data_collator=collator,
        callbacks=[measure],
    )
    trainer.step_losses = []
    measure.trainer = trainer
    trainer.train()

    # Each rank's step loss is its row's loss sum over the global count of trained positions, times
    # the world size (SFTTrainer with average_tokens_across_devices): their mean is the global mean.
    losses = torch.stack(trainer.step_losses).to(device=device, dtype=torch.float64)
    if distributed:
        dist.all_reduce(losses)
    losses = (losses / world).tolist()
    # the data loader may collate a row ahead of the last step: compare the first `steps` rows
    steps = len(trainer.step_losses)
    (rows_ok,) = all_reduce([float(collator.rows_seen[:steps] == list(range(rank, steps * world, world)))],
                            dist.ReduceOp.MIN if distributed else None)
    if rows_ok != 1.0 and rank == 0:
        print(f"WARNING: rank 0 trained on rows {collator.rows_seen[:steps]}, not {rank}, {rank} + {world}, ...",
              flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    (peak,) = all_reduce([peak], dist.ReduceOp.MAX if distributed else None)
    begin_end = [e - b for b, e in zip(measure.begin, measure.ends)]
    # a step's wall time: from one step's end to the next's (data loading, TRL's metrics and logging in)
    intervals = [begin_end[0]] + [measure.ends[i] - measure.ends[i - 1] for i in range(1, len(measure.ends))]
    timed = intervals[3:] if len(intervals) > 3 else intervals
    step_s = statistics.median(timed)
    import accelerate
    import transformers
    result = dict(
        system="trl-linnet" if args.linnet else "trl-fsdp2", shape=shape, world=world, steps=len(intervals), seq=seq,
        step_s=round(step_s, 4), tok_s=round(world * seq / step_s),
        step_compute_s=round(statistics.median(begin_end[3:] if len(begin_end) > 3 else begin_end), 4),
        first_steps_s=[round(x, 3) for x in intervals[:3]],
        peak_gib=round(peak, 2), loss_start=measure.loss_start, loss_end=measure.loss_end,
        losses=[round(x, 4) for x in losses], rows_as_specified=rows_ok == 1.0,
        **measure.setup,
        ac=args.ac, compile=args.compile, attn=args.attn, precision=args.precision, lr=args.lr,
        versions=dict(trl=trl.__version__, transformers=transformers.__version__, accelerate=accelerate.__version__,
                      torch=torch.__version__),
        deviations=deviations,
    )
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
