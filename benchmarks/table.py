"""The benchmark table in one command: every system on the same shapes, rows and steps, from the
same start (benchmarks/shared_start.py), one after another on this machine's GPUs.

    python3 benchmarks/table.py --out benchmarks/results/DATE-GPU/table [--shapes 1b,3b,8b] [--steps 30] [--gpus 4]
    python3 benchmarks/table.py --out ... --sim 4        # one GPU's share of 4 ranks (sim_world.py, 360 GB/s)
    python3 benchmarks/table.py --render OUT             # the table and plot again from OUT's JSON files

DATE-GPU: the day and the GPU, e.g. 2026-01-31-h200. Writes OUT/SHAPE/SYSTEM.json (the run's RESULT
line, its command and exit status), OUT/table.md in the seed's form (step, tokens/s, peak a GPU,
held-out loss at start and end) and OUT/plot.png (tokens/s and peak memory by system and shape). A
system that runs out of memory is run again with its memory-saving option (activation checkpointing,
full recompute, remat), which the table names. Systems that a simulated world cannot run (JAX, TRL:
their own runtimes) are left out under --sim.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
CARDS = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b", "8b": "llama-3.1-8b", "70b": "llama-3.1-70b"}


@dataclass(frozen=True)
class System:
    name: str  # as the table shows it
    key: str  # its files' name
    command: tuple[str, ...]  # after the launcher; {card}, {shape}, {steps}, {start} filled in
    launcher: str  # "torchrun", "python" or "accelerate"
    saving: tuple[str, ...] = ()  # arguments that save memory, added when a run does not fit
    shared: bool = True  # takes --init/--rows/--held-out
    simulated: bool = True  # runs under sim_world.py
    env: tuple[tuple[str, str], ...] = ()


SHARED = ("--init", "{start}/init", "--rows", "{start}/rows.npz", "--held-out", "{start}/held_out.npz")
SYSTEMS = (
    System("Linnet, PyTorch", "linnet-torch", ("benchmarks/step.py", "--card", "{card}", "--steps", "{steps}"),
           "torchrun", saving=("--recompute", "full")),
    System("Linnet, PyTorch, optimizer after the backward", "linnet-torch-step-after",
           ("benchmarks/step.py", "--card", "{card}", "--steps", "{steps}", "--step-after"), "torchrun",
           saving=("--recompute", "full")),
    System("Linnet, JAX, --no-remat", "linnet-jax-no-remat",
           ("benchmarks/step_jax.py", "--card", "{card}", "--steps", "{steps}", "--no-remat"), "python",
           simulated=False, env=(("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"),)),
    System("Linnet, JAX", "linnet-jax", ("benchmarks/step_jax.py", "--card", "{card}", "--steps", "{steps}"), "python",
           simulated=False),
    System("FSDP2, eager", "fsdp2", ("benchmarks/peers/fsdp2_baseline.py", "--shape", "{shape}", "--steps", "{steps}"),
           "torchrun", saving=("--ac",)),
    System("FSDP2, compiled a layer", "fsdp2-compiled",
           ("benchmarks/peers/fsdp2_baseline.py", "--shape", "{shape}", "--steps", "{steps}", "--compile"), "torchrun",
           saving=("--ac",)),
    System("FSDP2's script, Linnet's fully_shard", "fsdp2-script-linnet",
           ("benchmarks/peers/fsdp2_baseline.py", "--shape", "{shape}", "--steps", "{steps}", "--linnet"), "torchrun",
           saving=("--ac",)),
    System("TRL, FSDP2", "trl-fsdp2", ("benchmarks/peers/trl_sft.py", "--shape", "{shape}", "--steps", "{steps}"),
           "accelerate", saving=("--ac",), simulated=False),
    System("TRL, Linnet", "trl-linnet",
           ("benchmarks/peers/trl_sft.py", "--shape", "{shape}", "--steps", "{steps}", "--linnet"), "accelerate",
           saving=("--ac",), simulated=False),
    System("plain compiled ceiling", "ceiling",
           ("benchmarks/peers/plain_ceiling.py", "--shape", "{shape}", "--steps", "{steps}"), "python",
           saving=("--ac",), shared=False),
)


def command(system: System, shape: str, steps: int, start: Path, gpus: int, sim: int | None, saving: bool) -> list[str]:
    fill = dict(card=CARDS[shape], shape=shape, steps=str(steps), start=str(start))
    shared = system.shared and sim is None  # a simulated world moves no data: its losses mean nothing
    script = [part.format(**fill) for part in system.command + (SHARED if shared else ())]
    script += list(system.saving) if saving else []
    if sim is not None:  # one rank of `sim` on this GPU
        return [sys.executable, str(HERE / "sim_world.py"), *script]
    match system.launcher:
        case "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", *script]
        case "accelerate":
            return ["accelerate", "launch", "--config_file", str(HERE / "peers" / "trl_fsdp2.yaml"),
                    f"--num_processes={gpus}", *script]
        case _:  # JAX's one process drives every local device; the ceiling is one GPU
            return [sys.executable, *script]


def run(system: System, shape: str, args, start: Path) -> dict:
    """Runs `system` on `shape` (again with its memory-saving option if the first run does not fit)."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1", **dict(system.env)}
    if args.sim:
        env.update(SIM_WORLD=str(args.sim), SIM_BUS_GBPS=str(args.bus_gbps), LOCAL_RANK="0")
    log = args.out / shape / f"{system.key}.log"
    for saving in (False, True) if system.saving else (False,):
        argv = command(system, shape, args.steps, start, args.gpus, args.sim, saving)
        with open(log, "w") as out:
            try:
                done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent,
                                      timeout=args.timeout, check=False)
                status = done.returncode
            except subprocess.TimeoutExpired:
                status = "timeout"
        text = log.read_text(errors="replace")
        result = next((json.loads(line[7:]) for line in reversed(text.splitlines()) if line.startswith("RESULT ")),
                      None)
        if result is not None or "OutOfMemoryError" not in text and "out of memory" not in text.lower():
            break
    return dict(system=system.name, key=system.key, shape=shape, date=datetime.date.today().isoformat(), command=argv,
                status=status, saving=saving, result=result, log=str(log.relative_to(args.out)),
                error=None if result else text[-2000:])


def machine() -> dict:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        gpu = []
    from importlib import metadata

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return dict(date=datetime.date.today().isoformat(), gpus=gpu, python=platform.python_version(),
                **{package: version(package) for package in VERSIONED})


VERSIONED = ("torch", "transformers", "jax", "trl", "accelerate")
NOTES = """\
- Every system but the ceiling trains on the same packed rows (about 130 instruction documents a
  4096-token row, none attending to another) from the same initial weights, and is measured on the
  same held-out rows. Linnet's flex attention (PyTorch) skips the blocks across documents. transformers' SDPA
  (FSDP2, TRL) builds a dense block-diagonal mask from the rows' positions and runs a masked kernel
  over the whole row: flash-attn, whose varlen kernel TRL recommends, is not installed.
- The ceiling (benchmarks/peers/plain_ceiling.py) is transformers' Llama compiled whole, with no
  sharding, on random tokens, each row one causal document: it has no held-out loss, and its
  attention does the whole causal triangle, more than a packed row's documents need.
- TRL reduces gradients in bf16 (accelerate's FSDP2 mixed precision); the others in f32.
  benchmarks/peers/TRL.md lists every deviation from TRL's own FSDP2 example.
"""


def render(out: Path) -> tuple[str, Path | None]:
    """OUT/table.md and OUT/plot.png from the JSON files of a run; returns the markdown and the plot's path."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*/*.json"))]
    about = json.loads((out / "machine.json").read_text()) if (out / "machine.json").exists() else {}
    for r in runs:  # a run that does not say when it ran ran with the machine's file
        r.setdefault("date", about.get("date", "?"))
    dates = sorted({r["date"] for r in runs}) or [about.get("date", "?")]
    lines = [f"Measured {' to '.join(dict.fromkeys((dates[0], dates[-1])))} "
             f"on {', '.join(about.get('gpus', [])) or '?'} "
             f"({', '.join(f'{p} {v}' for p in VERSIONED if (v := about.get(p)))}){about.get('setting', '')}.", ""]
    order = {s.key: i for i, s in enumerate(SYSTEMS)}
    for shape in sorted({r["shape"] for r in runs}, key=list(CARDS).index):
        when = sorted({r["date"] for r in runs if r["shape"] == shape})
        heading = f"### {CARDS[shape]}" + (f" (measured {', '.join(when)})" if len(dates) > 1 else "")
        lines += [heading, "", "| | Step | Tokens/s | Peak a GPU | Held-out loss |", "|---|---|---|---|---|"]
        for r in sorted((r for r in runs if r["shape"] == shape), key=lambda r: order.get(r["key"], 99)):
            name = r["system"] + (" (memory-saving option)" if r["saving"] else "")
            res = r["result"]
            if res is None:
                why = ("out of memory" if "out of memory" in (r.get("error") or "").lower()
                       else f"failed ({r['status']})")
                lines.append(f"| {name} | {why}: see {r['log']} | | | |")
                continue
            held = (f"{res['loss_start']:.3f} to {res['loss_end']:.3f}" if res.get("loss_start") is not None
                    and res.get("loss_end") is not None else "")
            lines.append(f"| {name} | {res['step_s']:.3f} s | {res['tok_s'] / 1000:.1f}K | {res['peak_gib']:.1f} GiB "
                         f"| {held} |")
        lines.append("")
    markdown = "\n".join(lines) + "\n" + NOTES
    (out / "table.md").write_text(markdown)
    return markdown, _plot(out, [r for r in runs if r["result"] is not None])


def _plot(out: Path, runs: list[dict]) -> Path | None:
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in runs}, key=list(CARDS).index)
    systems = [s for s in SYSTEMS if any(r["key"] == s.key for r in runs)]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        found = {r["shape"]: r["result"] for r in runs if r["key"] == system.key}
        xs = [j + i * width for j, shape in enumerate(shapes) if shape in found]
        for axis, field, scale in ((axes[0], "tok_s", 1e-3), (axes[1], "peak_gib", 1.0)):
            axis.bar(xs, [found[s][field] * scale for s in shapes if s in found], width, label=system.name)
    for axis, title in ((axes[0], "tokens/s (thousands)"), (axes[1], "peak memory a GPU (GiB)")):
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [CARDS[s] for s in shapes])
        axis.set_title(title)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    path = out / "plot.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the folder of this run's results")
    parser.add_argument("--render", type=Path, metavar="OUT", help="only render OUT's table and plot again")
    parser.add_argument("--shapes", default="1b,3b,8b")
    parser.add_argument("--systems", default=",".join(s.key for s in SYSTEMS),
                        help="of: " + ", ".join(s.key for s in SYSTEMS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--gpus", type=int, default=None, help="processes a run (default: every visible GPU)")
    parser.add_argument("--sim", type=int, default=None, help="one GPU's share of this many ranks (sim_world.py)")
    parser.add_argument("--bus-gbps", default="360", help="the simulated bus bandwidth (inf: no communication time)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    args = parser.parse_args()
    if args.render:
        print(render(args.render)[0])
        return
    if args.out is None:
        parser.error("--out is needed (or --render OUT)")
    import torch

    args.gpus = args.gpus or max(torch.cuda.device_count(), 1)
    world = args.sim or args.gpus
    chosen = [s for s in SYSTEMS if s.key in args.systems.split(",") and (s.simulated or not args.sim)]
    about = machine()
    about["setting"] = ((f", one GPU's share of {args.sim} ranks at {args.bus_gbps} GB/s" if args.sim
                         else f", {args.gpus} GPU{'s' if args.gpus > 1 else ''}")
                        + f", {args.steps} steps of one 4096-token row a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "machine.json").write_text(json.dumps(about, indent=1))
    for shape in args.shapes.split(","):
        start = args.out / "start" / shape
        (args.out / shape).mkdir(exist_ok=True)
        if not (start / "init" / "config.json").exists():
            rows = max(args.steps * world, 64)
            subprocess.run([sys.executable, str(HERE / "shared_start.py"), "--card", CARDS[shape], "--out", str(start),
                            "--rows", str(rows)], check=True, cwd=HERE.parent)
        for system in chosen:
            record = run(system, shape, args, start)
            (args.out / shape / f"{system.key}.json").write_text(json.dumps(record, indent=1))
            shown = ('step_s', 'tok_s', 'peak_gib', 'loss_start', 'loss_end')
            print(f"{shape} {system.name}: " + (json.dumps({k: record['result'].get(k) for k in shown})
                                                 if record["result"] else f"failed ({record['status']})"), flush=True)
    print(render(args.out)[0])


if __name__ == "__main__":
    main()
