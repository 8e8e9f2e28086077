"""Every class of card mistake gives a message naming the card file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from linnet.cardlang import CardError, check_program, parse_program
from linnet.cardlang.errors import GenericsError
from linnet.cards import CARDS_DIR, resolve
from linnet.cardlang.generics import bind_generics

pytestmark = pytest.mark.quick

LLAMA = (CARDS_DIR / "llama.arch").read_text()
CONFIG = resolve("tiny-llama").config


def check(source: str, path: str = "broken.arch"):
    return check_program(parse_program(source, path), CONFIG, "tiny-llama.toml")


def line_of(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def broken(old: str, new: str) -> tuple[str, int]:
    assert old in LLAMA
    source = LLAMA.replace(old, new, 1)
    return source, line_of(source, new.splitlines()[0])


def expect(source: str, line: int, *fragments: str) -> CardError:
    with pytest.raises(CardError) as caught:
        check(source)
    error = caught.value
    assert error.path == "broken.arch" and error.line == line, str(error)
    assert str(error).startswith(f"broken.arch:{line}: ")
    for fragment in fragments:
        assert fragment in str(error)
    return error


def test_the_shipped_family_checks():
    checked = check(LLAMA)
    assert checked.program.entries == ["logits", "logits_packed", "token_statistics_packed", "loss", "loss_packed"]
    assert checked.dims["D"] == 96


def test_syntax_error():
    source, line = broken("    h = rms_norm(x, w.input_layernorm, eps=norm_eps)",
                          "    h = rms_norm(x, w.input_layernorm, eps=norm_eps")
    expect(source, line, "syntax error")


def test_unknown_operation():
    source, line = broken("silu(linear(h, w.gate_proj))", "gelu(linear(h, w.gate_proj))")
    expect(source, line, "unknown operation `gelu`", "silu")


def test_shape_mismatch_in_a_primitive():
    # the down projection applied to the hidden state rather than to the MLP's inner width
    source, line = broken("w.up_proj), w.down_proj)", "w.up_proj), w.up_proj)")
    expect(source, line, "shape mismatch in linear()", "Ffn = 256", "D = 96")


def test_shape_mismatch_in_an_operator():
    source, line = broken("    x = x + linear(merge_heads(attention(q, k, v, mask)), w.o_proj)",
                          "    x = x + linear(h, w.k_proj)")
    expect(source, line, "shape mismatch", "+")


def test_unbound_generic_dimension():
    source, line = broken("def decoder_layer(x: T[Batch, MaxSeq, D]", "def decoder_layer(x: T[Batch, Seq, D]")
    expect(source, line, "unknown dimension `Seq`", "dim(")


def test_weight_shapes_cannot_be_generic():
    source, line = broken("    input_layernorm: W[D]", "    input_layernorm: W[Batch]")
    expect(source, line, "generic dimensions", "Batch")


def test_unknown_name_and_wrong_return():
    source, line = broken("    return x\n\n\n@entry", "    return y\n\n\n@entry")
    expect(source, line, "unknown name `y`")
    source, line = broken("    return to_f32(linear(", "    return (linear(")
    expect(source, line, "returns T[", "f32[")


def test_a_return_before_a_functions_end_is_refused():
    source, line = broken("        x = decoder_layer(x, w, cos, sin, mask)\n",
                          "        x = decoder_layer(x, w, cos, sin, mask)\n        return x\n")
    expect(source, line + 1, "`return` only as a function's last statement")


@pytest.mark.parametrize("loop", [
    "        y = decoder_layer(x, w, cos, sin, mask)\n        x = y\n",
    "        y = decoder_layer(x, w, cos, sin, mask)\n",  # y made in the loop: no layer's input
    "        x = decoder_layer(h, w, cos, sin, mask)\n",  # every layer from h: x not carried
])
def test_a_layer_loop_is_one_assignment_carrying_its_value(loop):
    source, line = broken("    for w in Layer:\n        x = decoder_layer(x, w, cos, sin, mask)\n",
                          "    h = x\n    for w in Layer:\n" + loop)
    expect(source, line + 1, "a loop over Layer must be one assignment, `x = layer(x, w, ...)`, of a value made "
                             "before the loop, from itself")


def test_a_value_carried_through_the_layers_must_keep_its_type():
    source, line = broken("    for w in Layer:\n        x = decoder_layer(x, w, cos, sin, mask)\n",
                          "    for w in Layer:\n        x = linear(decoder_layer(x, w, cos, sin, mask), w.gate_proj)\n")
    expect(source, line, "`x` is T[Batch, MaxSeq, D] before the loop and T[Batch, MaxSeq, Ffn] after a pass of it",
           "from one Layer to the next")


@pytest.mark.parametrize("old, new, fragment", [
    ('"model.layers.{i}.mlp.up_proj.weight"', '"model.layers.mlp.up_proj.weight"',
     "lacks {i}: group Layer repeats, and each layer's weights need names of their own"),
    ('"model.layers.{i}.mlp.up_proj.weight"', '"model.layers.{j}.mlp.up_proj.weight"',
     "may hold {i}, the layer's number, in a repeated group only; got {j}"),
    ('"model.layers.{i}.mlp.up_proj.weight"', '"model.layers.{i.mlp.up_proj.weight"', "is not a name template"),
    ('"model.layers.{i}.mlp.up_proj.weight"', '"model.layers.{i}.mlp.down_proj.weight"',
     "'model.layers.{i}.mlp.down_proj.weight' is Layer.up_proj's too"),
    ('embed_tokens: W[Vocab, D] = "model.embed_tokens.weight"', 'embed_tokens: W[Vocab, D] = "model.embed_tokens.{i}"',
     "may hold {i}, the layer's number, in a repeated group only; got {i}"),
])
def test_checkpoint_names_that_would_load_the_wrong_weight_are_refused_at_their_line(old, new, fragment):
    source = LLAMA.replace(old, new, 1)
    line = line_of(source, new) if "is Layer.up_proj's too" not in fragment else line_of(source, "down_proj: W")
    expect(source, line, fragment)


@pytest.mark.parametrize("old, new, fragment", [
    ("cos: f32[Batch, MaxSeq, HeadDim], sin: f32", "cos: f32[Batch, MaxSeq, HeadDim], cos: f32",
     "function decoder_layer: parameter cos is named twice"),
    ("def logits(tokens: i32[Batch, MaxSeq])", "def logits(tokens: i32[Batch, MaxSeq], mask: Mask[Batch, MaxSeq])",
     "entry logits: parameter mask is Mask[Batch, MaxSeq]; an entry takes tensors only"),
])
def test_parameters_a_call_could_not_give_are_refused(old, new, fragment):
    source, line = broken(old, new)
    expect(source, line, fragment)


def test_statements_and_declarations_outside_the_language():
    source, line = broken("    return x\n\n\n@entry", "    print(x)\n    return x\n\n\n@entry")
    expect(source, line, "expected an assignment")
    source, _ = broken("T = dtype()", "T = dtype()\nimport os")
    expect(source, line_of(source, "import os"), "expected a declaration", "got import")


@pytest.mark.parametrize("old, new, fragment", [
    ("def decoder(tokens", "def gather(tokens", "`gather` is reserved for generated code"),
    ("def decoder(tokens", "def hold(tokens", "`hold` is reserved for generated code"),  # fully_shard binds it
    ("    h = rms_norm(x, w.input_layernorm, eps=norm_eps)", "    part = rms_norm(x, w.input_layernorm, eps=norm_eps)",
     "`part` is reserved for generated code"),  # the scheduled layer loop's local
    ("def decoder_layer(x", "def decoder_layer_region(x", "any name ending in _region"),
    ("def decoder_layer(x", "def silu(x", "`silu` is a primitive of the card language"),  # the emitted one lost
    ("    h = rms_norm(x, w.input_layernorm, eps=norm_eps)",
     "    h_weights = rms_norm(x, w.input_layernorm, eps=norm_eps)",
     "any name ending in _weights"),
])
def test_names_generated_code_defines_are_refused(old, new, fragment):
    """A function or local that the generated source would define itself (a layer's function compiled
    once is `<name>_region`, a group's gathered weights `<group>_weights`) is refused at its line."""
    source, line = broken(old, new)
    expect(source, line, fragment, "choose another")


def test_missing_config_key_names_the_instance_card():
    config = {k: v for k, v in CONFIG.items() if k != "num_key_value_heads"}
    with pytest.raises(CardError, match=r"tiny-llama.toml: \[config\] num_key_value_heads must be a positive integer"):
        check_program(parse_program(LLAMA, "llama.arch"), config, "tiny-llama.toml")


def test_bad_toml_names_the_file_and_line(tmp_path: Path):
    card = tmp_path / "bad.toml"
    card.write_text('name = "bad"\nfamily = "llama"\n[weights\nrepo = "x"\n')
    with pytest.raises(CardError, match=r"bad.toml:3: not valid TOML"):
        resolve(card)


@pytest.mark.parametrize(
    "generics, message",
    [
        ({"Batch": 1, "T": "bf16"}, "missing ['MaxSeq']"),
        ({"Batch": 1, "MaxSeq": 8, "T": "bf16", "Seq": 3}, "unknown ['Seq']"),
        ({"Batch": 1, "MaxSeq": "8", "T": "bf16"}, "MaxSeq is a dimension and must be a positive integer"),
        ({"Batch": 1, "MaxSeq": 8, "T": "float64"}, "T is a dtype and must be one of"),
    ],
)
def test_generics_errors(generics, message):
    with pytest.raises(GenericsError) as caught:
        bind_generics(resolve("tiny-llama").checked(), generics)
    assert message in str(caught.value)


# Settings of the instance card that a family does not compute fail when the card is checked (at load),
# with the [config] key, the value and what the family computes; a key the card leaves out is transformers'
# default.

def refused(config: dict, program: str = LLAMA, *fragments: str) -> str:
    with pytest.raises(CardError) as caught:
        check_program(parse_program(program, "family.arch"), config, "mine.toml")
    message = str(caught.value)
    assert message.startswith("mine.toml: [config] ") and caught.value.path == "mine.toml", message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_rope_scaling_that_rope_does_not_compute_fails_at_load_not_in_the_first_forward(tmp_path: Path):
    from hf_models import write_card

    from linnet import nest

    config = {k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures", "rope_scaling")}
    card = write_card(tmp_path, config, {"rope_type": "linear", "factor": 2.0}, repo="no weights")
    with pytest.raises(CardError) as caught:
        nest.load(card, generics={"Batch": 1, "MaxSeq": 8, "T": "f32"}, weights="random")
    message = str(caught.value)
    assert message.startswith(f"{card}: [config] rope_scaling = ")
    assert '"rope_type": "linear"' in message and 'rope_type "default" or "llama3", not "linear"' in message
    assert "llama.arch:" in message  # where rope() is called


@pytest.mark.parametrize("key", ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"])
def test_a_llama3_scaling_lacking_a_key_is_refused(key):
    scaling = {k: v for k, v in CONFIG["rope_scaling"].items() if k != key}
    refused({**CONFIG, "rope_scaling": scaling}, LLAMA, "[config] rope_scaling = ", f"needs {key} in a llama3 scaling")


@pytest.mark.parametrize("scaling, fragment", [
    ({"type": "llama3"}, 'needs a table with rope_type ("default" or "llama3"), or no rope_scaling'),
    ({**CONFIG["rope_scaling"], "low_freq_factor": 4.0}, "needs low_freq_factor < high_freq_factor"),
    ({**CONFIG["rope_scaling"], "factor": "8"}, "needs positive numbers for factor"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor must be 1.0"),
])
def test_rope_scalings_rope_cannot_compute_are_refused(scaling, fragment):
    refused({**CONFIG, "rope_scaling": scaling}, LLAMA, fragment)


@pytest.mark.parametrize("key, value, fragment", [
    ("tie_word_embeddings", "false", '[config] tie_word_embeddings = "false" must be true or false: it says whether '
                                     'weight lm_head is tied to Embedding.embed_tokens'),
    ("rms_norm_eps", "1e-5", 'rms_norm_eps = "1e-5": rms_norm() needs a positive number for eps'),
    ("rms_norm_eps", -1e-5, "rms_norm_eps = -1e-05: rms_norm() needs a positive number for eps"),
])
def test_a_setting_of_the_wrong_kind_is_refused_by_name(key, value, fragment):
    refused({**CONFIG, key: value}, LLAMA, fragment)


def test_an_odd_head_dimension_is_refused_where_rope_rotates_halves():
    with pytest.raises(CardError,
                       match=r"rope\(\): the head dimension, rotated in halves: HeadDim = 25 does not divide by 2"):
        check_program(parse_program(LLAMA, "family.arch"), {**CONFIG, "head_dim": 25}, "mine.toml")


@pytest.mark.parametrize("key, value, computed", [
    ("hidden_act", "gelu", 'hidden_act = "silu" only'),
    ("attention_bias", True, "attention_bias = false only"),
    ("attention_bias", 0, "attention_bias = false only"),  # false, not a number that Python would call false
    ("mlp_bias", True, "mlp_bias = false only"),
    ("attention_dropout", 0.1, "attention_dropout = 0.0 only"),
    ("sliding_window", 4096, "sliding_window = null only"),  # Mistral 7B v0.1's window
    ("model_type", "qwen2", 'model_type = "llama" or "mistral" only'),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor = 1.0 only"),
])
def test_llama_settings_it_does_not_compute_are_refused(key, value, computed):
    import json

    refused({**CONFIG, key: value}, LLAMA,
            f"[config] {key} = {json.dumps(value)} is not supported: family.arch computes {computed}",
            f"(const {key}, family.arch:")


def test_absent_settings_are_transformers_defaults_and_numbers_compare_as_numbers():
    assert not {"hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "sliding_window"} & set(CONFIG)
    checked = check_program(parse_program(LLAMA, "family.arch"), {**CONFIG, "attention_dropout": 0}, "mine.toml")
    assert checked.consts["hidden_act"] == "silu" and checked.consts["sliding_window"] is None
    no_scaling = {k: v for k, v in CONFIG.items() if k != "rope_scaling"}
    assert check_program(parse_program(LLAMA, "family.arch"), no_scaling, "mine.toml").consts["rope_scaling"] is None
    with pytest.raises(CardError, match=r"mine.toml: \[config\] lacks model_type \(const model_type of family.arch:"):
        check_program(parse_program(LLAMA, "family.arch"), {k: v for k, v in CONFIG.items() if k != "model_type"},
                      "mine.toml")


QWEN2 = (CARDS_DIR / "qwen2.arch").read_text()
QWEN3 = (CARDS_DIR / "qwen3.arch").read_text()


@pytest.mark.parametrize("program", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
def test_qwen_sliding_windows_are_refused_and_full_attention_layers_are_not(program):
    name = "qwen2" if program is QWEN2 else "qwen3"
    config = {**resolve(f"tiny-{name}").config}
    refused({**config, "use_sliding_window": True}, program, "[config] use_sliding_window = true is not supported")
    sliding = ["full_attention", "sliding_attention"]
    refused({**config, "layer_types": sliding}, program, 'layer_types = null or a list of "full_attention" only')
    checked = check_program(parse_program(program, "family.arch"), {**config, "layer_types": ["full_attention"] * 2,
                                                                    "sliding_window": 4096}, "mine.toml")
    assert checked.consts["layer_types"] == ["full_attention"] * 2  # transformers 5.x writes one a layer
    refused({**config, "model_type": "llama"}, program, f'model_type = "{name}" only')


def test_a_dimension_left_out_is_its_default():
    qwen2 = resolve("tiny-qwen2").config
    assert "head_dim" not in qwen2
    assert check_program(parse_program(QWEN2, "qwen2.arch"), qwen2, "mine.toml").dims["HeadDim"] == 96 // 4
    qwen3 = {k: v for k, v in resolve("tiny-qwen3").config.items() if k != "head_dim"}
    assert check_program(parse_program(QWEN3, "qwen3.arch"), qwen3, "mine.toml").dims["HeadDim"] == 128  # Qwen3Config's
    with pytest.raises(CardError, match=r"mine.toml: \[config\] lacks head_dim, and its default \(hidden_size // "
                                        r"num_attention_heads = 96 // 5, dimension HeadDim of .*\) does not divide "
                                        r"exactly: give head_dim"):
        check_program(parse_program(QWEN2, "qwen2.arch"), {**qwen2, "num_attention_heads": 5}, "mine.toml")


@pytest.mark.parametrize("old, new, fragment", [
    ('hidden_act = const(config="hidden_act", default="silu", allowed=["silu"])',
     'hidden_act = const(config="hidden_act", default="gelu", allowed=["silu"])',
     "its default 'gelu' is not among the values it allows"),
    ('mlp_bias = const(config="mlp_bias", default=False, allowed=[False])',
     'mlp_bias = const(config="mlp_bias", default=False, allowed=False)',
     "allowed= must be a non-empty list of values"),
    ('mlp_bias = const(config="mlp_bias", default=False, allowed=[False])',
     'mlp_bias = const(config="mlp_bias", default=tied, allowed=[False])',
     "default= must be a literal value, got `tied`"),
    ('HeadDim = dim(config="head_dim", default=D // Heads)', 'HeadDim = dim(config="head_dim", default=D // Batch)',
     "default=: `Batch` is not a dimension of the instance card declared above"),
    ('HeadDim = dim(config="head_dim", default=D // Heads)', 'HeadDim = dim(config="head_dim", default=D - Heads)',
     "a product or quotient (`*`, `//`) of them, got `D - Heads`"),
])
def test_mistakes_in_a_setting_or_a_default_name_the_program_line(old, new, fragment):
    source, line = broken(old, new)
    expect(source, line, fragment)


def test_settings_a_card_only_checks_are_not_in_the_generated_source():
    from linnet.emit.source import emit
    from linnet.emit.torch_backend import TORCH

    source = emit(resolve("tiny-llama").checked(), TORCH, card_name="tiny",
                  generics={"Batch": 1, "MaxSeq": 8, "T": "f32"}, numerics="exact", cast_dtype=False).source
    assert "rope_scaling = {" in source and "norm_eps = 1e-05" in source
    assert "hidden_act" not in source and "model_type" not in source
