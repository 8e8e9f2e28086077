"""What the benchmark scripts share: the random rows step.py (PyTorch) and
step_jax.py (JAX) train on, the model FLOPs a token they report, and the CUDA
clock of the kernel benchmarks (adam_bench.py, fused_linears.py)."""

import numpy as np

from linnet.data.packing import Row
from linnet.metrics import flops_per_token, parameters  # noqa: F401  (the benchmarks' own names)


def random_rows(seed: int, tokens: int, vocab: int, packed: bool = False):
    """Endless rows of random tokens: one document each (what the peers' probes train on), or with
    `packed` documents of the lengths chat fine-tuning packs (log-normal, mostly a few hundred
    tokens, some long), as linnet.data.packing lays them out; every position but a document's last weighted."""
    rng = np.random.default_rng(seed)
    while True:
        ids = rng.integers(0, min(vocab, 32000), tokens, dtype=np.int32)
        lengths = [tokens]
        if packed:
            drawn = np.clip(rng.lognormal(6.0, 0.8, tokens // 16), 16, 3000).astype(int)
            lengths = np.diff(np.unique(np.r_[0, np.cumsum(drawn), tokens].clip(0, tokens)))
        ends = np.cumsum(lengths)
        starts = ends - lengths
        segments = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
        weights = np.ones(tokens, np.float32)
        weights[ends - 1] = 0.0
        yield Row(tokens=ids, targets=np.roll(ids, -1),
                  positions=(np.arange(tokens) - np.repeat(starts, lengths)).astype(np.int32),
                  segments=segments, weights=weights, filled=tokens)


FIELDS = ("tokens", "targets", "positions", "segments", "weights")


def save_rows(path, rows: list) -> None:
    """Rows as one .npz of (N, S) arrays, a field each (what every system of the table reads)."""
    np.savez(path, **{f: np.stack([getattr(row, f) for row in rows]) for f in FIELDS})


def load_rows(path, rank: int = 0, world: int = 1) -> list:
    """Rank `rank`'s rows of a .npz that save_rows wrote: rows rank, rank + world, ..."""
    with np.load(path) as arrays:
        fields = {f: arrays[f][rank::world] for f in FIELDS}
    return [Row(**{f: fields[f][i] for f in FIELDS}, filled=len(fields["tokens"][i]))
            for i in range(len(fields["tokens"]))]


def cuda_seconds(function, repeats: int, warmup: int = 1) -> float:
    """Seconds a call of `function` takes on the GPU: the mean of `repeats` calls between two CUDA events,
    after `warmup` calls (a first compile among them)."""
    import torch  # here: step_jax.py imports this module too

    for _ in range(warmup):
        function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats
