"""Full fine-tuning of Llama 3.1 8B across GPUs with fully sharded data
parallelism (FSDP): each process holds a quarter of every weight, gradient
and AdamW state (on four GPUs), and gathers a layer's weights only while the
layer runs. Run under torchrun:

    torchrun --nproc_per_node=4 examples/sft/sft_torch.py

Offline, on a CPU, with the tiny card and the repo's own instruction data:

    torchrun --nproc_per_node=2 examples/sft/sft_torch.py --card tiny-llama \\
        --data examples/sft/data/tasks.jsonl --tokens 512 --steps 40 --lr 3e-3

On two machines of 8 GPUs (the same command on each; --sharding auto shards inside each machine):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        examples/sft/sft_torch.py
"""

import argparse
import os

import torch

from linnet import nest
from linnet.recipes import sft
from linnet.errors import ArgumentParser, at_least, exit_on_user_error, non_negative_number, positive_number
from linnet.torch import fully_shard
from linnet.torch.mesh import SHARDINGS, torchrun_mesh
from linnet.metrics import Metrics, flops_per_token, peak_flops
from linnet.schedules import SCHEDULES
from linnet.torch.train import evaluate, lr_schedule, pack, train

# A mistake in the options, the card or the data ends the run before it trains: one line, from the
# first process, and exit status 2 (tracebacks are for bugs).
exit_on_user_error()
parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--card", default="llama-3.1-8b-instruct")
parser.add_argument("--data", default=None, help="a JSON-lines file, or a folder of datasets' save_to_disk, of "
                    "chat rows (messages), prompt/completion rows or alpaca rows (instruction, input, output) "
                    "(default: the hub's tatsu-lab/alpaca); shuffled, 8400 at most used")
parser.add_argument("--held-out", type=at_least(1), default=200, help="rows kept out of training for the held-out "
                    "loss before and after (default 200)")
parser.add_argument("--steps", type=at_least(1), default=30)
parser.add_argument("--warmup", type=at_least(0), default=None, help="steps of linear warm-up of the learning rate "
                    "(default 3, or --steps - 1 if fewer)")
parser.add_argument("--lr", type=positive_number, default=1e-5)
parser.add_argument("--schedule", choices=SCHEDULES, default="cosine", help="the learning rate after the warm-up: "
                    "constant, or falling in a line or along a cosine to --lr-floor at the last step (default cosine)")
parser.add_argument("--lr-floor", type=non_negative_number, default=0.0, help="the learning rate at the last step, as "
                    "a fraction of --lr (default 0)")
parser.add_argument("--tokens", type=at_least(2), default=4096, help="positions in a packed row")
parser.add_argument("--accumulate", type=at_least(1), default=1, help="packed rows a process takes for one optimizer "
                    "step, their gradients summed (gradient accumulation; default 1)")
parser.add_argument("--max-grad-norm", type=non_negative_number, default=1.0, help="clip the gradients at this "
                    "global norm (default 1.0, as TRL and torchtitan; 0: no clipping)")
parser.add_argument("--checkpoint", default=None, help="save here every --checkpoint-every steps, and resume from it")
parser.add_argument("--eval-every", type=at_least(1), default=None, help="the held-out loss every this many steps, "
                    "and after the last (default: before and after the run only)")
parser.add_argument("--checkpoint-every", type=at_least(1), default=100)
parser.add_argument("--metrics", default=None, help="append each step's metrics to this JSON-lines file (default: "
                    "metrics.jsonl in the --checkpoint folder, if given); TensorBoard's files go beside it when "
                    "tensorboard is installed")
parser.add_argument("--wandb", metavar="PROJECT", default=None, help="log the metrics to this W&B project too")
parser.add_argument("--out", default=None, help="write the trained weights here (bf16)")
parser.add_argument("--sharding", choices=SHARDINGS, default="auto", help="flat: every process shares out every "
                    "layer; hybrid: shared out inside each machine, one copy a machine; auto (default): hybrid when "
                    "torchrun runs on more than one machine")
args = parser.parse_args()
TOKENS = args.tokens
warmup = sft.warmup_steps(args.warmup, args.steps)
floor = sft.lr_floor(args.lr_floor)
metrics_path = sft.metrics_path(args.metrics, args.checkpoint, args.wandb)

cuda = torch.cuda.is_available()
torch.distributed.init_process_group("nccl" if cuda else "gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
sft.check_out_folder(args.out, args.card)  # writable, with room: now, rather than after training
sft.check_resume(args.checkpoint, nest.resolve(args.card).name, args.steps)
tokenizer = nest.tokenizer(args.card)
sft.check_chat_template(tokenizer, args.card)

example = sft.example_maker(tokenizer)  # a row as an Example, the loss on the assistant's turns


training_rows, held_out_rows = sft.split_held_out(sft.data_rows(args.data), args.held_out, args.data)
# --accumulate packed rows a process a step: the processes take turns over the batches.
batches = sft.rows_for_run(pack(map(example, training_rows), TOKENS), args.steps, world, args.checkpoint,
                           accumulate=args.accumulate)
held_out = sft.enough_held_out(pack(map(example, held_out_rows), TOKENS), world, args.held_out)

model = nest.load(
    args.card,
    backend="torch",
    device=device,
    numerics="fast",
    compile="inductor" if cuda else None,  # a CPU runs the tiny card eager: inductor's CPU compile takes minutes
    generics={"Batch": 1, "MaxSeq": TOKENS, "T": "bf16"},
    cast_dtype=True,
    trainable=True,
)
# Splits every layer's weights across the processes (of each machine, when hybrid), kept in f32, and
# generates the entries to gather each layer's in bf16 where it runs (compiled by inductor on GPUs).
fully_shard(model, mesh=torchrun_mesh("cuda" if cuda else "cpu", args.sharding))
if rank == 0:
    replicas, parts = model.sharding.replicas, model.sharding.world
    copies = f", one copy on each of {replicas} machines" if replicas > 1 else ""
    print(f"each weight in {parts} parts{copies}", flush=True)
trained = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
schedule = lr_schedule(optimizer, args.schedule, warmup, args.steps, floor=floor)


metrics = None if metrics_path is None else Metrics(
    metrics_path, flops_per_token=flops_per_token(model, TOKENS), devices=world,
    peak_flops=peak_flops(torch.cuda.get_device_name()) if cuda else None,
    peak_memory=(lambda: torch.cuda.max_memory_allocated() / 2**30) if cuda else None,
    writer=rank == 0, wandb_project=args.wandb, config=vars(args))


def report(step):
    if metrics is not None:
        metrics(step)
    if rank == 0:
        norm = "" if step.grad_norm is None else f", grad norm {step.grad_norm:.3f}"
        norm += "" if step.held_out_loss is None else f", held-out loss {step.held_out_loss:.3f}"
        print(f"step {step.step}: loss {step.loss:.3f}{norm}, {step.seconds:.2f} s", flush=True)


before = evaluate(model, held_out[rank::world])
history = train(
    model,
    iter(batches[rank::world]),
    optimizer=optimizer,
    steps=args.steps,
    schedule=schedule,
    on_step=report,
    checkpoint=args.checkpoint,
    checkpoint_every=args.checkpoint_every,
    accumulate=args.accumulate,
    max_grad_norm=args.max_grad_norm or None,
    **(dict(eval_rows=held_out[rank::world], eval_every=args.eval_every) if args.eval_every else {}),
)
after = evaluate(model, held_out[rank::world])
peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=device)
torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
if rank == 0:
    step = history.median_seconds()
    memory = f"peak {float(peak):.1f} GiB a GPU" if cuda else "on the CPU"
    speed = "no steps left to run" if step is None else (
        f"{step:.2f} s a step ({world * args.accumulate * TOKENS / step:.0f} positions/s on {world} "
        f"{'GPUs' if cuda else 'processes'})")
    print(f"{speed}, {memory}, held-out loss {before:.3f} to {after:.3f}")
if metrics is not None:
    metrics.close()
if args.out is not None:
    # Every process calls it: the parts are gathered, and the first writes.
    model.save_weights(args.out, dtype=torch.bfloat16)
torch.distributed.destroy_process_group()
