"""The tiny tokenizer and the task data: how they load, and that their generators reproduce them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from linnet.data.synthetic_tasks import generate, messages

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "linnet" / "cards" / "tokenizers" / "tiny"
TASKS = REPO / "examples" / "sft" / "data" / "tasks.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TINY))


def run_script(*args):
    # The scripts import linnet, which need not be installed.
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    subprocess.run([sys.executable, *args], cwd=REPO, env=env, check=True)


def test_loads_as_fast_tokenizer_of_512(tokenizer):
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert len(tokenizer) == 512
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|eot_id|>"
    assert tokenizer.pad_token == "<|pad|>"


def test_ids_match_the_tiny_llama_card(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 4)


def test_chat_template(tokenizer):
    chat = [{"role": "user", "content": "What is 12 + 34?"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
        "What is 12 + 34?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    answer = {"role": "assistant", "content": "46"}
    answered = tokenizer.apply_chat_template([*chat, answer], tokenize=False)
    assert answered == text + "46<|eot_id|>"


SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>",
]


@pytest.mark.parametrize("token", SPECIAL_TOKENS)
def test_special_tokens_are_single_ids(tokenizer, token):
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    assert ids == [tokenizer.convert_tokens_to_ids(token)]


def test_bos_only_with_special_tokens(tokenizer):
    bare = tokenizer("Sort 3 1 2", add_special_tokens=False)["input_ids"]
    assert tokenizer("Sort 3 1 2")["input_ids"] == [tokenizer.bos_token_id, *bare]
    assert tokenizer.bos_token_id not in bare


def test_round_trips_a_rendered_row(tokenizer):
    for row in generate(50, seed=3):
        text = tokenizer.apply_chat_template(messages(row), tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_round_trips_bytes_it_never_saw(tokenizer):
    text = "naïve café ✓ 😀"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_generate_is_deterministic():
    rows = generate(200, seed=7)
    assert rows == generate(200, seed=7)
    assert rows != generate(200, seed=8)
    for row in rows:
        assert set(row) == {"instruction", "input", "output"}
        assert all(isinstance(value, str) for value in row.values())
        assert row["instruction"] and row["output"]


def test_make_tasks_reproduces_committed_file(tmp_path):
    out = tmp_path / "tasks.jsonl"
    run_script("examples/sft/make_tasks.py", "--out", str(out))
    assert out.read_bytes() == TASKS.read_bytes()
    lines = TASKS.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 4000
    assert [json.loads(line) for line in lines[:5]] == generate(5, seed=0)


def test_make_tiny_reproduces_committed_files(tmp_path):
    run_script("-m", "linnet.cards.tokenizers.make_tiny", "--out", str(tmp_path))
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == sorted(path.name for path in TINY.iterdir())
    for name in names:
        assert (tmp_path / name).read_bytes() == (TINY / name).read_bytes(), name
