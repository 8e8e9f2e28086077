"""What a compiled training step keeps from its forward for its backward, on the CPU: every tensor the
compiled entry saves (autograd's saved-tensor hooks see them), by shape and dtype, less the parts and
the optimizer's state, which are held anyway. Where a GPU's peak falls at the backward's start (the 1B's,
docs/design/recompute.md), this is what the recompute policy changes, read here without a GPU, at the card's
widths with fewer layers and tokens (a layer's activations grow with its tokens).

    python benchmarks/saved_ledger.py --card llama-3.2-1b --tokens 256 --recompute matmuls

A layer's share is the difference between the card made of --layers layers and of one more. Prints a line
a kind of tensor, then a RESULT line: the bytes kept a layer, and the rest (the embedding's, the head's
and the loss's), each at --tokens.
"""

import argparse
import collections
import contextlib
import dataclasses
import json
import os

import torch
import torch.distributed as dist

from linnet import nest
from linnet.cards import resolve
from linnet.torch import fully_shard
from linnet.torch.step_in_backward import stepping_in_backward

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--card", default="llama-3.2-1b")
parser.add_argument("--layers", type=int, default=1, help="the card with this many layers, and one more: the "
                    "difference is a layer's")
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--recompute", default="gather", choices=["gather", "matmuls", "full"])
parser.add_argument("--no-reshard", action="store_true", help="fully_shard(reshard_after_forward=False): the "
                    "layers' casts kept")
parser.add_argument("--step-after", action="store_true", help="no step in the backward")
args = parser.parse_args()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29551")
dist.init_process_group("gloo", rank=0, world_size=1)


def ledger(layers: int) -> collections.Counter:
    """Bytes kept for the backward by (shape, dtype), with the card made of `layers` layers."""
    card = resolve(args.card)
    card = dataclasses.replace(card, name=f"{card.name}-{layers}-layers",
                               config={**card.config, "num_hidden_layers": layers})
    model = nest.load(card, backend="torch", device="cpu", numerics="fast", compile="inductor",
                      generics={"Batch": 1, "MaxSeq": args.tokens, "T": "bf16"}, cast_dtype=True, trainable=True,
                      weights="random", entry="loss")
    fully_shard(model, recompute=args.recompute, reshard_after_forward=not args.no_reshard)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-5, fused=True)
    tokens = torch.randint(0, model.checked.dims["Vocab"], (1, args.tokens), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(0))
    weights = torch.ones(1, args.tokens)

    def stepping():
        return contextlib.nullcontext() if args.step_after else stepping_in_backward(model, optimizer)

    with stepping():
        model.loss(tokens, tokens, weights).backward()  # compiles, and makes the optimizer's state
    held = {t.untyped_storage().data_ptr() for p in model.parameters()
            for t in (p, *optimizer.state[p].values()) if t.dim() > 0}
    kept = {}  # storage -> (shape, dtype, bytes): a view and its base are kept once

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            kept.setdefault(storage.data_ptr(), ((tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")),
                                                 storage.nbytes()))
        return tensor

    with stepping():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model.loss(tokens, tokens, weights)
        loss.backward()
    kinds = collections.Counter()
    for kind, size in kept.values():
        kinds[kind] += size
    return kinds


fewer, more = ledger(args.layers), ledger(args.layers + 1)
a_layer = more - fewer  # what one more layer keeps
rest = fewer - collections.Counter({kind: size * args.layers for kind, size in a_layer.items()})
for label, kinds in (("a layer", a_layer), ("the rest", rest)):
    for (shape, dtype), size in kinds.most_common():
        print(f"{label}: {dtype}{list(shape)}: {size / 2**20:.2f} MiB")
print("RESULT " + json.dumps(dict(card=args.card, tokens=args.tokens, recompute=args.recompute,
                                  reshard_after_forward=not args.no_reshard, step_in_backward=not args.step_after,
                                  kept_a_layer_mib=round(sum(a_layer.values()) / 2**20, 2),
                                  kept_else_mib=round(sum(rest.values()) / 2**20, 2))))
dist.destroy_process_group()
