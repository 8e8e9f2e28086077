"""Full fine-tuning of Llama 3.1 8B across GPUs with fully sharded data
parallelism (FSDP): each process holds a quarter of every weight, gradient
and AdamW state (on four GPUs), and gathers a layer's weights only while the
layer runs. Run under torchrun:

    torchrun --nproc_per_node=4 examples/07-fsdp/sft_torch.py

Offline, on a CPU, with the tiny card and the repo's own instruction data:

    torchrun --nproc_per_node=2 examples/07-fsdp/sft_torch.py --card tiny-llama \\
        --data examples/07-fsdp/data/tasks.jsonl --tokens 512 --steps 40 --lr 3e-3
"""

import argparse
import os

import torch
from datasets import load_dataset
from transformers import AutoTokenizer

from linnet import nest
from linnet.torch import fully_shard
from linnet.train import Example, cosine_schedule, evaluate, pack, train

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--card", default="llama-3.1-8b-instruct")
parser.add_argument("--data", default=None, help="a JSON-lines file of alpaca rows (default: the hub's tatsu-lab/alpaca)")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--lr", type=float, default=1e-5)
parser.add_argument("--tokens", type=int, default=4096, help="positions in a packed row")
parser.add_argument("--checkpoint", default=None, help="save here every --checkpoint-every steps, and resume from it")
parser.add_argument("--checkpoint-every", type=int, default=100)
parser.add_argument("--out", default=None, help="write the trained weights here (bf16)")
args = parser.parse_args()
TOKENS = args.tokens

cuda = torch.cuda.is_available()
torch.distributed.init_process_group("nccl" if cuda else "gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
tokenizer = AutoTokenizer.from_pretrained(nest.resolve(args.card).weights.repo)


def example(row: dict) -> Example:
    user = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"][-1024:]
    answer = tokenizer(row["output"] + "<|eot_id|>", add_special_tokens=False)["input_ids"]
    return Example.prompted(prompt, answer[: 2048 - len(prompt)])


if args.data is None:
    rows = load_dataset("tatsu-lab/alpaca", split="train")
else:
    rows = load_dataset("json", data_files=args.data, split="train")
rows = rows.shuffle(seed=0).select(range(min(8400, len(rows))))
batches = list(pack([example(row) for row in rows.select(range(200, len(rows)))], TOKENS))
held_out = list(pack([example(row) for row in rows.select(range(200))], TOKENS))

model = nest.load(
    args.card,
    backend="torch",
    device=device,
    numerics="fast",
    compile="inductor",
    generics={"Batch": 1, "MaxSeq": TOKENS, "T": "bf16"},
    cast_dtype=True,
    trainable=True,
)
# Splits every layer's weights across the processes, kept in f32, and
# compiles the entries to gather each layer's in bf16 where it runs.
fully_shard(model)
trained = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
schedule = cosine_schedule(optimizer, 3, args.steps, floor=0.0)


def report(step):
    if rank == 0:
        print(f"step {step.step}: loss {step.loss:.3f}, {step.seconds:.2f} s", flush=True)


before = evaluate(model, held_out[rank::world])
# One packed row a process a step: the processes take turns over the batches.
history = train(
    model,
    iter(batches[rank::world]),
    optimizer=optimizer,
    steps=args.steps,
    schedule=schedule,
    on_step=report,
    checkpoint=args.checkpoint,
    checkpoint_every=args.checkpoint_every,
)
after = evaluate(model, held_out[rank::world])
peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=device)
torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
if rank == 0:
    step = history.median_seconds()
    memory = f"peak {float(peak):.1f} GiB a GPU" if cuda else "on the CPU"
    speed = "no steps left to run" if step is None else (
        f"{step:.2f} s a step ({world * TOKENS / step:.0f} positions/s on {world} {'GPUs' if cuda else 'processes'})")
    print(f"{speed}, {memory}, held-out loss {before:.3f} to {after:.3f}")
if args.out is not None:
    # Every process calls it: the parts are gathered, and the first writes.
    model.save_weights(args.out, dtype=torch.bfloat16)
torch.distributed.destroy_process_group()
