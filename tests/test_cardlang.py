"""Every class of card mistake gives a message naming the card file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from linnet.cardlang import CardError, check_program, parse_program
from linnet.cardlang.errors import GenericsError
from linnet.cards import CARDS_DIR, resolve
from linnet.generics import bind_generics

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
    assert checked.program.entries == ["logits", "loss", "loss_packed"]
    assert checked.dims["D"] == 96


def test_syntax_error():
    source, line = broken("    h = rms_norm(x, w.input_layernorm, eps=norm_eps)", "    h = rms_norm(x, w.input_layernorm, eps=norm_eps")
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


def test_statements_and_declarations_outside_the_language():
    source, line = broken("    return x\n\n\n@entry", "    print(x)\n    return x\n\n\n@entry")
    expect(source, line, "expected an assignment")
    source, _ = broken("T = dtype()", "T = dtype()\nimport os")
    expect(source, line_of(source, "import os"), "expected a declaration", "got import")


def test_missing_config_key_names_the_instance_card():
    config = {k: v for k, v in CONFIG.items() if k != "head_dim"}
    with pytest.raises(CardError, match=r"tiny-llama.toml: \[config\] head_dim must be a positive integer"):
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
