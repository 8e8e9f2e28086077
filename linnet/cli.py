"""The `linnet` command: list the shipped cards, print generated source.

    linnet cards
    linnet torch llama-3.2-1b --entry loss_packed --generic Batch=1 --generic MaxSeq=4096 --generic T=bf16
    linnet jax tiny-llama --numerics fast
"""

from __future__ import annotations

import argparse
import sys

from linnet import cards
from linnet.generics import bind_generics, example


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linnet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("cards", help="list the shipped cards")
    for backend in ("torch", "jax"):
        command = commands.add_parser(backend, help=f"print the generated {backend} source of a card")
        command.add_argument("card", help="a shipped card's name or a path to a .toml card")
        command.add_argument("--entry", action="append", help="an entry to emit (repeatable; default: all)")
        command.add_argument("--numerics", choices=["exact", "fast"], default="exact")
        command.add_argument("--generic", action="append", default=[], metavar="NAME=VALUE",
                             help="bind a generic (default: Batch=1, MaxSeq=4096, T=bf16 for what is not given)")
        command.add_argument("--cast-dtype", action="store_true", help="f32 master weights cast to T where used")
        command.add_argument("--fully-shard", action="store_true", help="the sharded form: each group gathered where first used")
        if backend == "torch":
            command.add_argument("--prefetch", type=int, default=1, metavar="LAYERS",
                                 help="with --fully-shard: how many layers' gathers run ahead (default 1)")
            command.add_argument("--one-rank", action="store_true",
                                 help="with --fully-shard: the form for one rank, where each gather is a cast")
    args = parser.parse_args(argv)
    if args.command == "cards":
        for name in cards.shipped():
            card = cards.resolve(name)
            print(f"{name:24} {card.family:8} {card.weights.repo}")
        return 0
    from linnet.emit.source import emit

    card = cards.resolve(args.card)
    checked = card.checked()
    generics = _defaults(checked)
    for item in args.generic:
        name, _, value = item.partition("=")
        generics[name] = int(value) if value.isdigit() else value
    generics = bind_generics(checked, generics)
    schedule = None
    if args.command == "torch":
        from linnet.emit.torch_backend import TORCH as backend

        if args.fully_shard:
            from linnet.emit.schedule import Schedule

            schedule = Schedule(args.prefetch, communicates=not args.one_rank)
    else:
        from linnet.emit.jax_backend import JAX as backend
    sys.stdout.write(emit(checked, backend, card_name=card.name, generics=generics, numerics=args.numerics,
                          cast_dtype=args.cast_dtype, entries=args.entry, sharded=args.fully_shard, schedule=schedule))
    return 0


def _defaults(checked) -> dict:
    defaults = {"Batch": 1, "MaxSeq": 4096}
    return {name: defaults.get(name, value) for name, value in example(checked).items()}


if __name__ == "__main__":
    sys.exit(main())
