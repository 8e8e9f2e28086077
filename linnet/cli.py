"""The `linnet` command: list the shipped cards, print generated source.

    linnet cards
    linnet torch llama-3.2-1b --entry loss_packed --generic Batch=1 --generic MaxSeq=4096 --generic T=bf16
    linnet jax tiny-llama --numerics fast

A mistake in the command (an unknown card, a bad option, a bad card file) is one line,
`linnet: error: ...`, and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from linnet import cards
from linnet.errors import ArgumentParser, UserError, at_least
from linnet.cardlang.generics import bind_generics, example


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(_parser().parse_args(argv))
    except UserError as error:
        print(f"linnet: error: {error}", file=sys.stderr)
        return 2


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="linnet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        command.add_argument("--fully-shard", action="store_true",
                             help="the sharded form: each group gathered where first used")
        if backend == "torch":
            command.add_argument("--prefetch", type=at_least(0), default=1, metavar="LAYERS",
                                 help="with --fully-shard: how many layers' gathers run ahead (default 1)")
            command.add_argument("--one-rank", action="store_true",
                                 help="with --fully-shard: the form for one rank, where each gather is a cast and "
                                      "a layer is compiled once (the region around its checkpoint)")
            command.add_argument("--replicas", type=at_least(1), default=1, metavar="N",
                                 help="with --fully-shard: the form for hybrid sharding, each part on N replicas")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "cards":
        for name in cards.shipped():
            card = cards.resolve(name)
            print(f"{name:24} {card.family:8} {card.weights.repo}")
        return 0
    from linnet.emit.source import emit

    card = cards.resolve(args.card)
    checked = card.checked()
    unknown = [entry for entry in args.entry or [] if entry not in checked.program.entries]
    if unknown:
        raise UserError(f"--entry {unknown[0]}: {card.name} has no such entry; "
                        f"its entries are {', '.join(checked.program.entries)}")
    generics = _defaults(checked)
    for item in args.generic:
        name, equals, value = item.partition("=")
        if not equals:
            raise UserError(f"--generic {item}: expected NAME=VALUE, such as MaxSeq=4096")
        generics[name] = int(value) if value.isdigit() else value
    generics = bind_generics(checked, generics)
    schedule, layer_region = None, False
    if args.command == "torch":
        from linnet.emit.torch_backend import TORCH as backend

        if args.fully_shard:
            from linnet.sharding.schedule import Schedule

            schedule = Schedule(args.prefetch, communicates=not args.one_rank, replicas=args.replicas)
            layer_region = schedule.one_rank  # as fully_shard compiles it on one rank
    else:
        from linnet.emit.jax_backend import JAX as backend
    sys.stdout.write(emit(checked, backend, card_name=card.name, generics=generics, numerics=args.numerics,
                          cast_dtype=args.cast_dtype, entries=args.entry, sharded=args.fully_shard, schedule=schedule,
                          layer_region=layer_region).source)
    return 0


def _defaults(checked) -> dict:
    defaults = {"Batch": 1, "MaxSeq": 4096}
    return {name: defaults.get(name, value) for name, value in example(checked).items()}


if __name__ == "__main__":
    sys.exit(main())
