"""A run that cannot be lost: the checks the fine-tuning examples make of their options, card and data
before the first step (linnet.recipes.sft), each a UserError that names what and where. The scripts
themselves, run as a user runs them, are tests/test_example_scripts.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from linnet import cards, nest
from linnet.recipes import sft
from linnet.errors import ArgumentParser, UserError, at_least, non_negative_number, positive_number
from linnet.data.packing import Example, pack

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "sft" / "data" / "tasks.jsonl"
LINES = TASKS.read_text(encoding="utf-8").splitlines(keepends=True)

pytestmark = pytest.mark.quick


def data(tmp_path: Path, *lines: str | bytes, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(b"".join(line.encode() if isinstance(line, str) else line for line in lines))
    return path


def raises(function, *args, **kwargs) -> str:
    """The message of the UserError function(*args) raises."""
    with pytest.raises(UserError) as raised:
        function(*args, **kwargs)
    return str(raised.value)


# The data file: every mistake names the file and the line.

def test_rows_are_read_with_input_optional(tmp_path):
    path = data(tmp_path, "\ufeff" + LINES[0], "\n", '{"instruction": "a", "output": "b"}\n',
                '{"instruction": "c", "input": null, "output": "d"}')
    rows = sft.read_rows(path)
    assert rows[0] == json.loads(LINES[0])
    assert rows[1:] == [{"instruction": "a", "input": "", "output": "b"},
                        {"instruction": "c", "input": "", "output": "d"}]


@pytest.mark.parametrize("lines, expected", [
    ([], r"data.jsonl holds no rows: give one row a line"),
    (["\n", "  \n"], r"data.jsonl holds no rows"),
    ([LINES[0], '{"instruction": "x", "input": ""\n'],
     r"data.jsonl:2: not valid JSON \(Expecting ',' delimiter, column 33\)"),
    ([LINES[0], b'{"instruction": "caf\xe9", "output": "x"}\n'],
     r"data.jsonl:2: not UTF-8 text \(byte 0xe9 at column 21\)"),
    ([LINES[0], LINES[1], '{"instruction": "x", "input": ""}\n'], r"data.jsonl:3: the row has no 'output'"),
    (['{"input": "x"}\n'], r"data.jsonl:1: the row has no 'instruction' and no 'output'"),
    (['{"instruction": "x", "output": 5}\n'], r"data.jsonl:1: 'output' is 5, not a string"),
    (['["instruction", "output"]\n'], r"data.jsonl:1: a JSON list, not a row"),
])
def test_a_bad_data_file_names_the_file_and_the_line(tmp_path, lines, expected):
    message = raises(sft.read_rows, data(tmp_path, *lines))
    assert message.startswith(str(tmp_path))
    assert re.search(expected, message), message
    assert '"instruction", "output"' in message or "UTF-8" in message


def test_a_missing_data_file_is_named(tmp_path):
    assert raises(sft.read_rows, tmp_path / "absent.jsonl") == (
        f"cannot read the data file {tmp_path / 'absent.jsonl'}: No such file or directory")


def test_the_rows_come_in_the_order_datasets_shuffled_them():
    """So that the README's losses, measured when the examples read the data with `datasets`, still hold."""
    from datasets import load_dataset

    shuffled = load_dataset("json", data_files=str(TASKS), split="train").shuffle(seed=0)
    assert sft.data_rows(str(TASKS), most=500) == [dict(row) for row in shuffled.select(range(500))]


# The split, the packed rows, the warm-up and --out: checked before the first step.

def examples(count: int) -> list[Example]:
    return [Example.prompted([1, 2, 3], [4, 5, 6, 7]) for _ in range(count)]  # 7 positions each


def test_too_few_rows_for_the_held_out_split():
    assert sft.split_held_out(list(range(10)), 3, "d.jsonl") == (list(range(3, 10)), [0, 1, 2])
    assert raises(sft.split_held_out, list(range(150)), 200, "d.jsonl") == (
        "d.jsonl has 150 rows, and --held-out 200 of them are kept for the held-out loss, which leaves none to "
        "train on: lower --held-out (at most 149) or give more rows")


def test_rows_for_the_steps_are_counted_before_the_first_step():
    packed = sft.rows_for_run(pack(examples(20), 16), steps=3, ranks=2)  # 2 examples a row: 10 rows
    assert len(packed) == 6
    assert raises(sft.rows_for_run, pack(examples(20), 16), 6, 2) == (
        "--steps 6 on 2 processes takes 12 packed rows (one a step on each), but the training rows pack into "
        "10 rows of --tokens 16: lower --steps (to 5 at most), lower --tokens, or give more rows")
    assert "on 4 devices" in raises(sft.rows_for_run, iter([]), 1, 4, None, "devices")
    assert len(sft.rows_for_run(pack(examples(20), 16), steps=2, ranks=2, accumulate=2)) == 8
    assert raises(sft.rows_for_run, pack(examples(20), 16), 3, 2, accumulate=2) == (
        "--steps 3 on 2 processes takes 12 packed rows (--accumulate 2 a step on each), but the training rows pack "
        "into 10 rows of --tokens 16: lower --steps (to 2 at most), lower --tokens, or give more rows")


def test_rows_for_the_steps_pack_no_more_than_they_need():
    taken = []

    def counted():
        for example in examples(1000):
            taken.append(example)
            yield example

    sft.rows_for_run(pack(counted(), 16), steps=2, ranks=2)
    assert len(taken) < 1000


def saved_at(folder: Path, step: int, rows_consumed: int) -> Path:
    checkpoint = folder / f"step-{step:08d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "MANIFEST.json").write_text(json.dumps({"step": step, "rows_consumed": rows_consumed}))
    return folder


@pytest.mark.parametrize("saved_ranks,ranks", [(2, 1), (1, 3), (4, 2)])
def test_a_resumed_run_has_rows_for_its_steps_at_any_number_of_ranks(tmp_path, saved_ranks, ranks):
    """The run saved at step 4 used 4 x saved_ranks rows of the one stream; the resumed run takes them and
    one a rank for each of its 2 steps left, whatever its own number of ranks."""
    folder = saved_at(tmp_path / "ckpt", 4, 4 * saved_ranks)
    assert len(sft.rows_for_run(pack(examples(200), 16), 6, ranks, folder)) == 4 * saved_ranks + 2 * ranks
    assert raises(sft.rows_for_run, pack(examples(2 * (4 * saved_ranks + 1)), 16), 6, ranks, folder) == (
        f"--steps 6 on {ranks} processes takes {4 * saved_ranks + 2 * ranks} packed rows (one a step on each after "
        f"the {4 * saved_ranks} that the run it resumes used (to step 4)), but the training rows pack into "
        f"{4 * saved_ranks + 1} rows of --tokens 16: lower --steps (to {4 + 1 // ranks} at most), lower --tokens, "
        f"or give more rows")


def test_each_process_needs_a_held_out_row():
    assert len(sft.enough_held_out(pack(examples(4), 16), 2, 4)) == 2
    assert raises(sft.enough_held_out, pack(examples(1), 16), 2, 1) == (
        "--held-out 1: the held-out rows pack into 1 rows of --tokens 16, fewer than the 2 processes, each of "
        "which evaluates at least one: raise --held-out")


def test_the_default_warmup_fits_a_short_run_and_a_given_one_is_checked():
    assert [sft.warmup_steps(None, steps) for steps in (1, 2, 3, 4, 30)] == [0, 1, 2, 3, 3]
    assert sft.warmup_steps(0, 1) == 0 and sft.warmup_steps(9, 10) == 9
    assert raises(sft.warmup_steps, 5, 5).startswith("--warmup 5 must be less than --steps 5")


def test_out_needs_room_for_the_cards_weights(tmp_path, monkeypatch):
    sft.check_out_folder(tmp_path / "weights", "tiny-llama")
    monkeypatch.setattr(sft.storage, "free_space", lambda path: 10_000)
    message = raises(sft.check_out_folder, tmp_path / "weights", "tiny-llama")
    assert message.startswith(f"--out {tmp_path / 'weights'}: no space left for the trained weights: they need ")
    assert "GB in bf16, and 1e-05 GB is free there" in message


def test_out_is_checked_without_leaving_anything(tmp_path):
    for fine in (tmp_path / "new" / "weights", tmp_path):
        sft.check_out_folder(fine)
    sft.check_out_folder(None)
    assert list(tmp_path.iterdir()) == []
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert raises(sft.check_out_folder, blocker) == (
        f"--out {blocker} is a file, not a folder: give a folder for the trained weights")
    assert raises(sft.check_out_folder, blocker / "weights") == (
        f"--out {blocker / 'weights'} cannot be made: {blocker} is a file, not a folder")
    # /proc takes no new file, whoever asks (a read-only folder does not stop root).
    assert raises(sft.check_out_folder, "/proc/linnet/weights").startswith(
        "--out /proc/linnet/weights cannot be written: /proc does not take a new file (")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_out_is_found(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert "cannot be written" in raises(sft.check_out_folder, locked)
    assert "cannot be written" in raises(sft.check_out_folder, locked / "weights")


# The card, the options and the one line.

def test_an_unknown_card_suggests_the_closest():
    with pytest.raises(KeyError) as raised:  # a KeyError, as it always was
        cards.resolve("tiny-lama")
    assert isinstance(raised.value, UserError)
    assert str(raised.value).startswith("unknown card 'tiny-lama' (did you mean 'tiny-llama'?): "
                                        "give a shipped card's name (")
    assert "did you mean" not in str(pytest.raises(KeyError, cards.resolve, "gpt-5").value)


def test_card_file_mistakes_are_user_errors(tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        cards.resolve(tmp_path / "absent.toml")
    assert isinstance(raised.value, UserError)
    (tmp_path / "latin1.toml").write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(UserError, match="latin1.toml: not UTF-8 text"):
        cards.resolve(tmp_path / "latin1.toml")
    (tmp_path / "table.toml").write_text('name = "x"\nfamily = "llama"\nweights = "repo"\nconfig = {}\n')
    with pytest.raises(UserError, match="table.toml: weights must be a table, got 'repo'"):
        cards.resolve(tmp_path / "table.toml")


def test_a_card_without_its_tokenizer_says_how_to_get_it(tmp_path):
    card = (ROOT / "linnet" / "cards" / "tiny-llama.toml").read_text().replace('"tokenizers/tiny"', '"./absent"')
    (tmp_path / "llama.arch").write_text((ROOT / "linnet" / "cards" / "llama.arch").read_text())
    (tmp_path / "card.toml").write_text(card)
    with pytest.raises(UserError, match=f"no tokenizer for tiny-llama from {tmp_path}/absent .*: download it first"):
        nest.tokenizer(tmp_path / "card.toml")
    assert nest.tokenizer("tiny-llama").eos_token == "<|eot_id|>"


def test_option_mistakes_are_user_errors():
    parser = ArgumentParser(prog="sft.py")
    parser.add_argument("--steps", type=at_least(1), default=30)
    assert parser.parse_args(["--steps", "2"]).steps == 2
    for given, expected in ((["--steps", "0"], "argument --steps: must be at least 1, got 0 (see sft.py --help)"),
                            (["--steps", "x"],
                             "argument --steps: expected a whole number, got 'x' (see sft.py --help)"),
                            (["--stpes", "2"], "unrecognized arguments: --stpes 2 (see sft.py --help)")):
        with pytest.raises(UserError) as raised:
            parser.parse_args(given)
        assert str(raised.value) == expected


@pytest.mark.parametrize("given", ["nan", "-1", "0", "inf", "x"])
def test_a_learning_rate_that_is_not_a_finite_positive_number_is_refused_before_anything_is_built(given):
    parser = ArgumentParser(prog="sft.py")
    parser.add_argument("--lr", type=positive_number, default=1e-5)
    assert parser.parse_args(["--lr", "3e-3"]).lr == 3e-3
    expected = "expected a number, got 'x'" if given == "x" else f"must be a finite number above 0, got {given}"
    assert raises(parser.parse_args, ["--lr", given]) == f"argument --lr: {expected} (see sft.py --help)"


@pytest.mark.parametrize("given", ["nan", "-1", "inf", "x"])
def test_a_clipping_norm_that_is_not_a_finite_number_of_at_least_0_is_refused(given):
    parser = ArgumentParser(prog="sft.py")
    parser.add_argument("--max-grad-norm", type=non_negative_number, default=1.0)
    assert parser.parse_args(["--max-grad-norm", "0"]).max_grad_norm == 0.0  # no clipping
    expected = "expected a number, got 'x'" if given == "x" else f"must be a finite number of at least 0, got {given}"
    assert raises(parser.parse_args, ["--max-grad-norm", given]) == (
        f"argument --max-grad-norm: {expected} (see sft.py --help)")


def test_a_resume_of_another_card_or_past_the_steps_is_refused_before_anything_is_built(tmp_path):
    folder = saved_at(tmp_path / "ckpt", 100, 200)
    manifest = folder / "step-00000100" / "MANIFEST.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "card": "tiny-llama"}))
    sft.check_resume(folder, "tiny-llama", 120)
    sft.check_resume(tmp_path / "none", "tiny-qwen3", 1)
    assert raises(sft.check_resume, folder, "tiny-qwen3", 120) == (
        f"--checkpoint {folder} holds a run of tiny-llama, not of --card tiny-qwen3: resume it with --card "
        f"tiny-llama, or point --checkpoint at another folder")
    assert raises(sft.check_resume, folder, "tiny-llama", 50) == (
        f"--checkpoint {folder} is at step 100, past --steps 50: give --steps 100 or more to resume it, or point "
        f"--checkpoint at another folder")


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    tokenizer = nest.tokenizer("tiny-llama")
    sft.check_chat_template(tokenizer, "tiny-llama")
    tokenizer.chat_template = None
    assert raises(sft.check_chat_template, tokenizer, "base") .startswith("base's tokenizer has no chat template")


def test_the_default_data_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert raises(sft.data_rows, None).startswith("no --data given, and the hub's tatsu-lab/alpaca cannot be read")


def test_tokens_too_few_for_any_answer_are_refused():
    """A chat's prompt runs to dozens of tokens: --tokens 2 packs the first steps' rows from prompts alone."""
    chats = [Example.prompted(list(range(1, 41)), [4, 5, 6]) for _ in range(20)]
    message = raises(sft.rows_for_run, pack(chats, 2), 3, 2)
    assert message.startswith("--tokens 2 leaves no answer in the packed rows")


def test_a_learning_rate_floor_above_the_peak_is_refused():
    assert sft.lr_floor(0.1) == 0.1
    assert raises(sft.lr_floor, 1.5) == ("--lr-floor 1.5 is a fraction of --lr, from 0 to 1: the learning rate at the "
                                         "last step is --lr times it")
