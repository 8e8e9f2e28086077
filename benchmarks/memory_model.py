"""A step's peak memory predicted from the card's shapes, beside every peak the benchmark logs recorded.

    python benchmarks/memory_model.py [benchmarks/results]

The model is that of a peak at the forward's end, where the 1B's and 3B's memory snapshots put it
(docs/design/recompute.md), with the optimizer stepping in the backward:
    this rank's f32 parts and Adam's two moments   12 bytes x parameters / ranks
  + what each layer keeps for its backward         layers x tokens x (bytes a token, by recompute policy)
  + the head's bf16 weights (gathered, or cast)    2 x vocabulary x width
  + the embedding's bf16 cast on one rank, untied  2 x vocabulary x width
  + the bf16 logits                                2 x tokens x vocabulary
  + the layers' gathered bf16 weights in flight    (ranks > 1: prefetch + 2 layers; all of them where the
                                                    gathers are kept, reshard_after_forward=False)
The bytes a layer keeps a token are those benchmarks/saved_ledger.py counted for the 1B, written in the
card's widths (D, Ffn, q = Heads x HeadDim, kv = KVHeads x HeadDim):
    "gather"   2 (3 Ffn + 4 D + 3 q + 3 kv + 4 HeadDim) + 4 Heads
    "matmuls"  2 (2 Ffn + 2 D + 2 q + 2 kv) + 4 (2 HeadDim + Heads)
    "full"     2 (2 D) + 4 (2 HeadDim)
Llama's layer; families with more per layer (Qwen3's q and k norms) keep more than this says. A peak
that falls in the backward (recompute "full", whose backward makes a layer's activations again, or
the optimizer stepping after the backward, whose gradients grow through it) is beyond this model: the
script prints those rows for what they show, marked.

Prints a row a recorded run (card, ranks or mesh, policy, gathers kept, step in the backward as the run
recorded it, measured and predicted GiB, the error) from each RESULT line of step.py's logs (4,096-token
rows). Runs that recorded no `step_in_backward` (None) predate the field, and some predate the step in the
backward itself: those at one rank held every gradient.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from linnet.cards import resolve

GIB = 2**30


def kept_a_token(dims: dict, recompute: str) -> int:
    d, ffn, head_dim, heads = dims["D"], dims["Ffn"], dims["HeadDim"], dims["Heads"]
    q, kv = heads * head_dim, dims["KVHeads"] * head_dim
    return {"gather": 2 * (3 * ffn + 4 * d + 3 * q + 3 * kv + 4 * head_dim) + 4 * heads,
            "matmuls": 2 * (2 * ffn + 2 * d + 2 * q + 2 * kv) + 4 * (2 * head_dim + heads),
            "full": 2 * (2 * d) + 4 * (2 * head_dim)}[recompute]


def predicted_peak(card: str, ranks: int, recompute: str, tokens: int = 4096, prefetch: int = 1,
                   gathers_kept: bool = False) -> float:
    """The forward's-end peak in bytes, by the model above."""
    resolved = resolve(card)
    dims = resolved.checked().dims
    d, ffn, vocab, layers = dims["D"], dims["Ffn"], dims["Vocab"], dims["Layers"]
    q, kv = dims["Heads"] * dims["HeadDim"], dims["KVHeads"] * dims["HeadDim"]
    tied = resolved.config.get("tie_word_embeddings", False)
    layer_weights = d * (q + 2 * kv) + q * d + 3 * d * ffn + 2 * d  # the projections and two norms
    parameters = layers * layer_weights + vocab * d * (1 if tied else 2) + d
    peak = 12 * parameters / ranks + layers * tokens * kept_a_token(dims, recompute)
    peak += 2 * vocab * d + 2 * tokens * vocab  # the head's bf16 weights, the bf16 logits
    if not tied and ranks == 1:
        peak += 2 * vocab * d  # the embedding's cast (over several ranks its rows are looked up, not gathered)
    if gathers_kept:
        peak += 2 * layers * layer_weights
    elif ranks > 1:
        peak += 2 * (prefetch + 2) * layer_weights
    return peak


def recorded(root: Path):
    for log in sorted(root.rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("RESULT "):
                continue
            try:
                result = json.loads(line[len("RESULT "):])
            except json.JSONDecodeError:
                continue
            if result.get("card", "").startswith("llama-") and result.get("recompute") and result.get("peak_gib"):
                yield log, result


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results")
    rows = []
    print(f"{'card':15} {'ranks':>5} {'recompute':9} {'kept':5} {'in bwd':6} {'measured':>9} {'predicted':>9} "
          f"{'error':>7}  log")
    for log, r in recorded(root):
        if r.get("accumulate", 1) not in (1, None) or r.get("max_grad_norm") is not None:
            continue
        kept = r.get("reshard_after_forward") is False
        shards = int(r["mesh"].split("x")[1]) if r.get("mesh") else r["world"]  # a part is 1 / (a mesh row)
        predicted = predicted_peak(r["card"], shards, r["recompute"], prefetch=r.get("prefetch") or 1,
                                   gathers_kept=kept) / GIB
        in_backward = r.get("step_in_backward")
        beyond = r["recompute"] == "full" or in_backward is False
        error = predicted / r["peak_gib"] - 1
        ranks = r["world"] if not r.get("mesh") else f"{r['mesh']}"
        rows.append(f"{r['card']:15} {ranks:>5} {r['recompute']:9} {str(kept):5} {str(in_backward):6} "
                    f"{r['peak_gib']:>9.2f} {predicted:>9.2f} {error:>+7.1%}  {log.relative_to(root)}"
                    f"{'  (a peak in the backward: beyond the model)' if beyond else ''}")
    print("\n".join(sorted(rows)))


if __name__ == "__main__":
    main()
