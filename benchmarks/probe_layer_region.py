"""Probe for compiling a layer once (docs/design/compile_time.md): does wrapping the generated layer function
in torch.compiler.nested_compile_region keep the gradients, and how long does the first call take?

    python3 benchmarks/probe_layer_region.py [--layers 8] [--wrap] [--options '{"reorder_for_peak_memory": false}']

Loads tiny-llama with `--layers` layers (random weights, exact numerics, bf16), runs one loss_packed
forward and backward eagerly and compiled, and prints the compiled call's seconds and the largest
relative difference of any weight's gradient from the eager one (bf16 rounding: ~1e-2)."""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import torch

from linnet import nest
from linnet.model import LoadedModel
from linnet.torch.model import TorchModel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--wrap", action="store_true", help="wrap decoder_layer in nested_compile_region")
    p.add_argument("--options", default="{}", help="inductor options, JSON")
    a = p.parse_args()
    execute = LoadedModel.execute

    def wrapped(self, source, namespace):
        functions = execute(self, source, namespace)
        layer = functions["loss_packed"].__globals__
        if a.wrap:  # the module's global: what decoder calls, compiled once for every layer
            layer["decoder_layer"] = torch.compiler.nested_compile_region(layer["decoder_layer"])
        return functions

    LoadedModel.execute = wrapped
    options = json.loads(a.options)
    TorchModel._compile = lambda self, f: (torch.compile(f, fullgraph=True, backend="inductor", options=options)
                                           if self.compile_mode else f)
    card = Path(tempfile.mkdtemp()) / "tiny-llama.toml"  # tiny-llama with --layers layers
    text = (Path(__file__).parents[1] / "linnet/cards/tiny-llama.toml").read_text()
    card.write_text(re.sub(r"num_hidden_layers = \d+", f"num_hidden_layers = {a.layers}", text))
    results = []
    for compile_mode in (None, "inductor"):
        torch.manual_seed(0)
        model = nest.load(str(card), numerics="exact", generics={"Batch": 1, "MaxSeq": 64, "T": "bf16"},
                          cast_dtype=True, trainable=True, weights="random", compile=compile_mode,
                          entry="loss_packed")
        tokens = torch.randint(0, 512, (1, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
        positions, segments = torch.arange(64, dtype=torch.int32)[None], torch.zeros(1, 64, dtype=torch.int32)
        start = time.perf_counter()
        model.loss_packed(tokens, tokens, positions, segments, torch.ones(1, 64)).backward()
        results.append((time.perf_counter() - start, [w.grad for w in model.parameters()]))
    (_, eager), (seconds, compiled) = results
    worst = max(((c - e).abs().max() / e.abs().max()).item() for c, e in zip(compiled, eager))
    print(json.dumps(dict(layers=a.layers, wrap=a.wrap, options=options, first_call_s=round(seconds, 1),
                          max_relative_gradient_difference=f"{worst:.1e}")))


if __name__ == "__main__":
    main()
