"""The same full fine-tuning in JAX, from the same card: one process over
every local GPU as a mesh. Each device takes its own packed row and holds
part of every weight; each layer gathers its weights where it runs, and the
backward pass gathers and computes each layer again instead of keeping it
(`--no-remat` keeps it: faster, in 62 GiB a GPU rather than 39, beyond XLA's
default memory fraction, so set XLA_PYTHON_CLIENT_MEM_FRACTION=0.95).

Offline, on a CPU, with the tiny card, the repo's own instruction data and
four host devices as the mesh:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/sft/sft_jax.py \\
        --card tiny-llama --data examples/sft/data/tasks.jsonl --tokens 512 --steps 40 --lr 3e-3

On several machines, one process a machine, each started with the first machine's address and its own
number (linnet/jax/hosts.py); each machine holds a copy of the parts, split over its own GPUs, and the
gradients are summed across machines:

    JAX_COORDINATOR_ADDRESS=HOST:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python examples/sft/sft_jax.py   # on HOST
    JAX_COORDINATOR_ADDRESS=HOST:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 python examples/sft/sft_jax.py   # the other

--checkpoint and --out then name a folder every machine sees (a shared file system): the first machine
writes, and every machine resumes from it.
"""

import argparse

import jax
import optax

from linnet import nest
from linnet.recipes import sft
from linnet.errors import ArgumentParser, at_least, exit_on_user_error, non_negative_number, positive_number
from linnet.jax import hosts
from linnet.jax.train import default_mesh, evaluate, lr_schedule, own_rows, train
from linnet.metrics import Metrics, flops_per_token, peak_flops
from linnet.schedules import SCHEDULES
from linnet.data.packing import pack

# A mistake in the options, the card or the data ends the run before it trains: one line, and exit
# status 2 (tracebacks are for bugs).
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
parser.add_argument(
    "--no-remat", dest="remat", action="store_false", help="keep each layer for backward"
)
parser.add_argument("--tokens", type=at_least(2), default=4096, help="positions in a packed row")
parser.add_argument("--accumulate", type=at_least(1), default=1, help="packed rows a device takes for one optimizer "
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
args = parser.parse_args()
TOKENS = args.tokens  # positions in a packed row
warmup = sft.warmup_steps(args.warmup, args.steps)
floor = sft.lr_floor(args.lr_floor)
metrics_path = sft.metrics_path(args.metrics, args.checkpoint, args.wandb)
sft.check_out_folder(args.out, args.card)  # writable, with room: now, rather than after training

sft.check_resume(args.checkpoint, nest.resolve(args.card).name, args.steps)
tokenizer = nest.tokenizer(args.card)
sft.check_chat_template(tokenizer, args.card)

example = sft.example_maker(tokenizer)  # a row as an Example, the loss on the assistant's turns


hosts.join()  # when started as one of several processes (machines): before any device is used
mesh = default_mesh()  # every device; over several machines, a copy of the parts a machine
training_rows, held_out_rows = sft.split_held_out(sft.data_rows(args.data), args.held_out, args.data)
# --accumulate packed rows a device a step; each machine feeds its own devices.
batches = sft.rows_for_run(pack(map(example, training_rows), TOKENS), args.steps, mesh.size, args.checkpoint,
                          "devices", args.accumulate)
batches = own_rows(batches, mesh, batch=1)
held_out = list(pack(map(example, held_out_rows), TOKENS))

# The card's `loss_packed` entry as generated `jax.numpy`, f32 master weights
# computed in bf16.
model = nest.load(
    args.card,
    backend="jax_source",
    entry="loss_packed",
    numerics="fast",
    generics={"Batch": 1, "MaxSeq": TOKENS, "T": "bf16"},
    cast_dtype=True,
)
schedule = lr_schedule(args.lr, args.schedule, warmup, args.steps, floor=floor)


def peak_memory_gib() -> float:
    return max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices()) / 2**30


gpus = jax.devices()[0].platform == "gpu"
metrics = None if metrics_path is None else Metrics(
    metrics_path, flops_per_token=flops_per_token(model, TOKENS), devices=mesh.size,
    peak_flops=peak_flops(jax.devices()[0].device_kind) if gpus else None,
    peak_memory=peak_memory_gib if gpus else None, writer=jax.process_index() == 0, wandb_project=args.wandb,
    config=vars(args))


def report(step):
    if metrics is not None:
        metrics(step)
    if jax.process_index() != 0:  # one machine reports the run (the loss is the whole step's)
        return
    norm = "" if step.grad_norm is None else f", grad norm {step.grad_norm:.3f}"
    norm += "" if step.held_out_loss is None else f", held-out loss {step.held_out_loss:.3f}"
    print(f"step {step.step}: loss {step.loss:.3f}{norm}, {step.seconds:.2f} s", flush=True)


before = evaluate(model, held_out)
params, history = train(
    model,
    batches,
    optimizer=optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.0),  # its lr reported
    steps=args.steps,
    mesh=mesh,
    remat=args.remat,
    on_step=report,
    checkpoint=args.checkpoint,
    checkpoint_every=args.checkpoint_every,
    accumulate=args.accumulate,
    max_grad_norm=args.max_grad_norm or None,
    **(dict(eval_rows=held_out, eval_every=args.eval_every) if args.eval_every else {}),
)
after = evaluate(model, held_out)
if metrics is not None:
    metrics.close()
step = history.median_seconds()
peak = peak_memory_gib()
memory = f"peak {peak:.1f} GiB a GPU" if gpus else "on the CPU"
speed = "no steps left to run" if step is None else (
    f"{step:.2f} s a step ({mesh.size * args.accumulate * TOKENS / step:.0f} positions/s on {mesh.size} "
    f"{'GPUs' if gpus else 'devices'})")
if jax.process_index() == 0:
    print(f"{speed}, {memory}, held-out loss {before:.3f} to {after:.3f}")
if args.out is not None:
    model.save_weights(args.out)
