"""The host memory in use at its peak over a few training steps on the CPU (one
process, Gloo, eager), with the optimizer's step in the backward or after it:
what the gradients that are never all held at once are worth, measured where
no GPU is. A thread samples glibc's count of the bytes malloc has handed out
(mallinfo2: in use in its arenas, and mapped for large blocks) every
millisecond while `train` runs; the steady peak is that of the steps after the
second (the first steps' holds compiling, and the optimizer's state made).

    python benchmarks/cpu_memory.py --card qwen2.5-0.5b              # steps in the backward
    python benchmarks/cpu_memory.py --card qwen2.5-0.5b --step-after
    python benchmarks/cpu_memory.py --card llama-3.1-8b --shrink 1024,3584,8,8000 --tokens 1024 \
        --compile --recompute gather    # 8B's shape at a CPU's size: width, ffn, layers, vocab

--shrink keeps the card's family and its other numbers: 8B's ratio of a layer's activations to its
state (at 4096 tokens and width 4096) is kept by tokens / width = 1.

Prints a RESULT line: that peak, the parts' bytes (for the difference between
two runs to be read against), and the process's peak resident memory
(ru_maxrss), which also counts memory freed but kept by malloc.
"""

import argparse
import ctypes
import dataclasses
import json
import os
import resource
import threading

import numpy as np
import torch
import torch.distributed as dist

from linnet import nest
from linnet.cards import resolve
from linnet.data.packing import Row
from linnet.torch import fully_shard
from linnet.torch.train import train

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--card", default="qwen2.5-0.5b")
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--steps", type=int, default=4, help="at least 3: the peak is the steps' after the second")
parser.add_argument("--step-after", action="store_true", help="train(step_in_backward=False)")
parser.add_argument("--compile", action="store_true", help="compiled by inductor (default: eager)")
parser.add_argument("--recompute", default="gather", choices=["gather", "matmuls", "full"])
parser.add_argument("--shrink", metavar="WIDTH,FFN,LAYERS,VOCAB", help="the card with these numbers in its config "
                    "(heads keep their width: the head count follows the width)")
args = parser.parse_args()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29541")
dist.init_process_group("gloo", rank=0, world_size=1)
card = resolve(args.card)
if args.shrink:
    width, ffn, layers, vocab = map(int, args.shrink.split(","))
    config = dict(card.config)
    head_dim = card.config.get("head_dim") or card.config["hidden_size"] // card.config["num_attention_heads"]
    groups = config["num_attention_heads"] // config["num_key_value_heads"]
    heads = width // head_dim
    config.update(hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers, vocab_size=vocab,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // groups), head_dim=head_dim)
    card = dataclasses.replace(card, name=f"{card.name}-shrunk", config=config)
model = nest.load(card, backend="torch", device="cpu", numerics="fast", compile="inductor" if args.compile else None,
                  generics={"Batch": 1, "MaxSeq": args.tokens, "T": "bf16"}, cast_dtype=True, trainable=True,
                  weights="random", entry="loss_packed")
fully_shard(model, recompute=args.recompute)
loaded_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the peak so far: loading and sharding
optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-5, fused=True)
rng = np.random.default_rng(0)


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


class PeakInUse(threading.Thread):
    """The most bytes malloc had handed out at once, sampled every millisecond until stopped."""

    def __init__(self):
        super().__init__(daemon=True)
        self.mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        self.mallinfo2.restype = MallInfo2
        self.peak, self.done = 0, threading.Event()

    def run(self):
        while not self.done.wait(0.001):
            info = self.mallinfo2()
            self.peak = max(self.peak, info.uordblks + info.hblkhd)


vocab = model.checked.dims["Vocab"]


def row() -> Row:
    tokens = rng.integers(0, vocab, args.tokens, dtype=np.int32)
    return Row(tokens, np.roll(tokens, -1), np.arange(args.tokens, dtype=np.int32),
               np.zeros(args.tokens, dtype=np.int32), np.ones(args.tokens, dtype=np.float32), 1)


peak, first_peak = PeakInUse(), None
peak.start()


def on_step(step) -> None:
    """Step 1 is reported once step 2 has run (train reads a step once the next is launched): the peak so far
    is that of compiling and the first steps (the optimizer's state made); from here, the steady steps'."""
    global first_peak
    if step.step == 1:
        first_peak, peak.peak = peak.peak, 0


train(model, (row() for _ in range(args.steps)), optimizer=optimizer, steps=args.steps, on_step=on_step,
      step_in_backward=not args.step_after)
peak.done.set()
peak.join()
parts = sum(p.numel() * p.element_size() for p in model.parameters())
print("RESULT " + json.dumps(dict(card=card.name, shrink=args.shrink, compiled=args.compile, recompute=args.recompute,
                                  step_in_backward=not args.step_after, tokens=args.tokens,
                                  parts_gib=round(parts / 2**30, 3), steady_peak_in_use_gib=round(peak.peak / 2**30, 3),
                                  first_steps_peak_in_use_gib=round(first_peak / 2**30, 3),
                                  loaded_peak_rss_gib=round(loaded_gib, 3),
                                  peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3))))
dist.destroy_process_group()
