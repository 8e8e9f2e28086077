"""Generated source for every shipped card, both backends, emitted without weights."""

from __future__ import annotations

import ast
from math import prod

import pytest

from linnet import cards
from linnet.cli import main
from linnet.cardlang import check_program, parse_program
from linnet.cards import CARDS_DIR
from linnet.emit.jax_backend import JAX
from linnet.sharding.schedule import Schedule
from linnet.emit.source import emit
from linnet.emit.torch_backend import TORCH

pytestmark = pytest.mark.quick

GENERICS = {"Batch": 1, "MaxSeq": 4096, "T": "bf16"}
LLAMA = (CARDS_DIR / "llama.arch").read_text()


@pytest.mark.parametrize("name", cards.shipped())
@pytest.mark.parametrize("backend", [TORCH, JAX], ids=["torch", "jax"])
@pytest.mark.parametrize("numerics", ["exact", "fast"])
@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "sharded"])
def test_source_of_every_card_compiles(name, backend, numerics, sharded):
    card = cards.resolve(name)
    source = emit(card.checked(), backend, card_name=name, generics=GENERICS, numerics=numerics,
                  cast_dtype=True, sharded=sharded).source
    compile(source, f"<{name}>", "exec")
    tree = ast.parse(source)
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"logits", "loss", "loss_packed", "decoder_layer"} <= defined
    assert ("gather(" in source) == sharded and ("checkpointed(" in source) == sharded
    assert f"Layers = {card.config['num_hidden_layers']}" in source


def test_tied_head_reads_the_embedding():
    tied = emit(cards.resolve("llama-3.2-1b").checked(), TORCH, card_name="1b", generics=GENERICS,
                numerics="exact", cast_dtype=False, entries=["logits"]).source
    untied = emit(cards.resolve("llama-3.1-8b").checked(), TORCH, card_name="8b", generics=GENERICS,
                  numerics="exact", cast_dtype=False, entries=["logits"]).source
    assert "embedding_weights['embed_tokens']))" in tied and "lm_head" not in tied
    assert "head_weights['lm_head']))" in untied


REGION = "@torch.compiler.nested_compile_region\n"
WRAPPER = (REGION
           + "def decoder_layer_region(x, w, cos, sin, mask):  # traced and compiled once, called for every layer\n"
           "    return checkpointed(decoder_layer, x, w, cos, sin, mask)")


@pytest.mark.parametrize("schedule, form", [
    (None, "decorated"),  # unsharded
    (Schedule(communicates=False), "wrapper"),  # one rank
    (Schedule(communicates=True), "decorated"),  # several ranks: the checkpoint around the region
    (Schedule(communicates=False, replicas=2), "decorated"),  # one rank of each of two replicas
], ids=["unsharded", "one-rank", "several-ranks", "replicas"])
def test_a_layer_compiled_once_is_the_region_its_ranks_need(schedule, form):
    source = emit(cards.resolve("tiny-llama").checked(), TORCH, card_name="tiny", generics=GENERICS, numerics="fast",
                  cast_dtype=True, entries=["loss_packed"], schedule=schedule, layer_region=True).source
    compile(source, "<tiny>", "exec")
    if form == "wrapper":
        assert WRAPPER in source and REGION + "def decoder_layer(" not in source
        assert "x = decoder_layer_region(x, w, cos, sin, mask)" in source
    else:
        assert REGION + "def decoder_layer(" in source and "decoder_layer_region" not in source


def test_a_layer_loop_calling_a_primitive_has_no_region():
    """`x = rms_norm(...)` as a layer loop: the primitive is the backend's, copied in, never wrapped."""
    card = cards.resolve("tiny-llama")
    loop = "        x = decoder_layer(x, w, cos, sin, mask)\n"
    program = parse_program(LLAMA.replace(loop, "        x = rms_norm(x, w.input_layernorm, eps=norm_eps)\n"),
                            "llama.arch")
    source = emit(check_program(program, card.config, "tiny-llama.toml"), TORCH, card_name="tiny", generics=GENERICS,
                  numerics="fast", cast_dtype=True, entries=["loss_packed"], schedule=Schedule(communicates=False),
                  layer_region=True).source
    assert "x = rms_norm(x, " in source and "_region" not in source


def test_one_entry_emits_only_what_it_needs():
    source = emit(cards.resolve("tiny-llama").checked(), TORCH, card_name="tiny", generics=GENERICS,
                  numerics="fast", cast_dtype=True, entries=["logits"]).source
    assert "def logits(" in source and "def loss(" not in source and "def cross_entropy(" not in source


def test_cli_prints_cards_and_source(capsys):
    assert main(["cards"]) == 0
    listed = capsys.readouterr().out
    assert "llama-3.1-8b-instruct" in listed and "meta-llama/Llama-3.1-8B-Instruct" in listed
    assert main(["torch", "llama-3.2-1b", "--entry", "loss_packed", "--generic", "MaxSeq=128",
                 "--numerics", "fast"]) == 0
    source = capsys.readouterr().out
    assert "MaxSeq = 128" in source
    assert "def loss_packed(params, tokens, targets, positions, segments, weights):" in source
    assert main(["torch", "tiny-llama", "--fully-shard", "--one-rank", "--entry", "loss_packed"]) == 0
    assert "x = decoder_layer_region(x, w, cos, sin, mask)" in capsys.readouterr().out  # as fully_shard on one rank
    assert main(["jax", "tiny-llama", "--fully-shard"]) == 0
    source = capsys.readouterr().out
    assert "gather(params['embedding'], 'Embedding')" in source
    assert "    x = over_layers(one_layer, x, params['layers'])" in source  # a loop, or lax.scan over stacked layers
    # The PyTorch sharded form shows its schedule: launches two layers ahead, waits in the layer.
    assert main(["torch", "llama-3.2-1b", "--fully-shard", "--prefetch", "2", "--entry", "loss_packed"]) == 0
    source = capsys.readouterr().out
    assert "# Prefetch depth 2" in source
    assert "gathers.append(launch_gather(part, 'Layer', keep=i + 2 >= len(parts) - 3))" in source
    assert "x = after(x, launch_of(gathers, i + 2), launch_of(gathers, i - 3))" in source
    assert "    w = wait_gather(w, 'Layer')" in source
    # The head is launched by the layer loop; an untied embedding is looked up, not gathered.
    assert "gathers.append(launch_gather(part, 'Head', keep=True))" in source
    assert "head_weights = wait_gather(params['head'], 'Head')" in source
    assert main(["torch", "llama-3.1-8b", "--fully-shard", "--entry", "loss_packed"]) == 0
    source = capsys.readouterr().out
    assert "x = lookup(tokens, params['embedding'], 'Embedding', 'embed_tokens')" in source
    assert "gather(params['embedding']" not in source
    # Hybrid sharding's form: the all-reduces across replicas are waited for where the backward ends,
    # made first in the function that holds the loop (before the embedding's lookup).
    assert main(["torch", "llama-3.1-8b", "--fully-shard", "--replicas", "2", "--entry", "loss_packed"]) == 0
    source = capsys.readouterr().out
    assert "layers 1 ahead, each part on 2 replicas." in source.splitlines()[0]
    assert ("    parts = across_replicas(params['layers'])  # the layer loop's\n"
            "    params['head'] = across_replicas(params['head'])\n"
            "    x = lookup(tokens, params['embedding'], 'Embedding', 'embed_tokens')") in source
    # The first layer is reduced last: its mean across the replicas follows the backward (late), as a tied
    # embedding's does, which each entry gathers first.
    assert "launch_gather(part, 'Layer', keep=i + 1 >= len(parts) - 2, late=(i == -1))" in source
    assert main(["torch", "llama-3.2-1b", "--fully-shard", "--replicas", "2", "--entry", "loss_packed"]) == 0
    source = capsys.readouterr().out
    assert "params = {**params, 'embedding': gather(params['embedding'], 'Embedding', late=True)}" in source


# Parameter counts of the published models (transformers' LlamaForCausalLM with each config.json).
PUBLISHED_PARAMETERS = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
                        "llama-3.1-70b": 70_553_706_496}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
@pytest.mark.parametrize("variant", ["", "-instruct"])
def test_cards_have_the_published_parameter_counts(name, variant):
    from linnet.hf.read import weight_specs

    count = sum(prod(spec.shape) for spec in weight_specs(cards.resolve(name + variant).checked()))
    assert count == PUBLISHED_PARAMETERS[name]
