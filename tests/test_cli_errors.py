"""The `linnet` command: a mistake in it (an unknown card, a bad option, a bad card file) is one line,
`linnet: error: ...`, and exit status 2, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from linnet.cli import main

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("argv, expected", [
    (["torch", "tiny-lama"], "unknown card 'tiny-lama' (did you mean 'tiny-llama'?): give a shipped card's name ("),
    (["jax", "tiny-llama", "--numerics", "fastest"],
     "argument --numerics: invalid choice: 'fastest' (choose from 'exact', 'fast') (see linnet jax --help)"),
    (["torch", "tiny-llama", "--fully-shard", "--prefetch", "-1"],
     "argument --prefetch: must be at least 0, got -1 (see linnet torch --help)"),
    (["torch", "tiny-llama", "--fully-shard", "--replicas", "0"],
     "argument --replicas: must be at least 1, got 0 (see linnet torch --help)"),
    (["torch", "tiny-llama", "--entry", "lossy"], "--entry lossy: tiny-llama has no such entry; its entries are "),
    (["torch", "tiny-llama", "--generic", "MaxSeq"], "--generic MaxSeq: expected NAME=VALUE, such as MaxSeq=4096"),
    (["torch", "tiny-llama", "--generic", "MaxSeq=long"],
     "generic MaxSeq is a dimension and must be a positive integer, got 'long'"),
    (["torch", "absent.toml"], "no card file at "),
    (["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
])
def test_a_mistake_is_one_line_and_status_2(capsys, argv, expected):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"linnet: error: {expected}") and err.count("\n") == 1, err


def test_a_bad_card_file_names_the_file(capsys, tmp_path):
    card = tmp_path / "bad.toml"
    card.write_text('name = "x"\nfamily = "llama"\n[weights\n')
    assert main(["jax", str(card)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"linnet: error: {card}:3: not valid TOML: ") and err.count("\n") == 1


def test_the_installed_command_exits_2_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "linnet.cli", "torch", "tiny-lama"], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("linnet: error: unknown card 'tiny-lama' (did you mean 'tiny-llama'?)")
