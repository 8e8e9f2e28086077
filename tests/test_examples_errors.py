"""A run that cannot be lost: the fine-tuning examples find a mistake in their options, card or data
before the first step and say it in one line, from one process, naming what and where, with exit
status 2 and no traceback; a run re-run after it finished still writes --out.

The checks are tested as functions; the scripts run for a few representative cases (a torchrun
launch costs 10 to 60 s here)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from linnet import cards, nest
from linnet.checkpoint import lock as folder_lock
from linnet.recipes import sft
from linnet.errors import ArgumentParser, UserError, at_least, positive_number
from linnet.data.packing import Example, pack

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "sft" / "data" / "tasks.jsonl"
LINES = TASKS.read_text(encoding="utf-8").splitlines(keepends=True)
TINY = ["--card", "tiny-llama", "--tokens", "256", "--lr", "3e-3"]


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
    assert sft.alpaca_rows(str(TASKS), most=500) == [dict(row) for row in shuffled.select(range(500))]


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
    assert raises(sft.alpaca_rows, None).startswith("no --data given, and the hub's tatsu-lab/alpaca cannot be read")


def test_tokens_too_few_for_any_answer_are_refused():
    """A chat's prompt runs to dozens of tokens: --tokens 2 packs the first steps' rows from prompts alone."""
    chats = [Example.prompted(list(range(1, 41)), [4, 5, 6]) for _ in range(20)]
    message = raises(sft.rows_for_run, pack(chats, 2), 3, 2)
    assert message.startswith("--tokens 2 leaves no answer in the packed rows")


def run_python(code: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False, env={**os.environ, **(env or {})})


RAISE = "from linnet.errors import UserError, exit_on_user_error\nexit_on_user_error()\nraise {}('bad --steps')\n"


def test_a_user_error_is_one_line_and_status_2_and_a_bug_keeps_its_traceback():
    said = run_python(RAISE.format("UserError"))
    assert (said.returncode, said.stdout, said.stderr) == (2, "", "error: bad --steps\n")
    bug = run_python(RAISE.format("ValueError"))
    assert bug.returncode == 1 and "Traceback" in bug.stderr and "ValueError: bad --steps" in bug.stderr


def test_another_rank_lets_the_first_speak():
    """Under torchrun the first rank's exit stops the others (SIGTERM): they leave with its status, silent;
    a rank whose first never spoke says it itself."""
    started = time.monotonic()
    code = RAISE.replace("raise", "print('raising', flush=True)\nraise").format("UserError")
    waiting = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env={**os.environ, "RANK": "1"})
    assert waiting.stdout.readline() == "raising\n"
    time.sleep(1)  # in the hook, waiting
    assert waiting.poll() is None
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=30) == 2 and waiting.communicate() == ("", "")
    alone = run_python("import linnet.errors\nlinnet.errors.FIRST_SPEAKS_WITHIN = 0.5\n" + RAISE.format("UserError"),
                       env={"RANK": "1"})
    assert (alone.returncode, alone.stderr) == (2, "error (rank 1): bad --steps\n")
    assert time.monotonic() - started < 60


TAKE = ("from pathlib import Path\nfrom linnet.checkpoint import lock as folder_lock\n"
        "from linnet.errors import exit_on_user_error\n"
        "exit_on_user_error()\nfolder_lock.take(Path({!r}))\n")


def test_a_second_run_on_a_held_checkpoint_folder_is_one_line_and_status_2(tmp_path):
    """The checkpoint folder's errors (FolderInUse, DamagedCheckpoints, StorageError) are user errors: a run
    on a folder that a live run holds is refused in one line, as the examples' Checkpointer would be."""
    folder = tmp_path / "run"
    lock = folder_lock.take(folder)
    try:
        said = run_python(TAKE.format(str(folder)))
    finally:
        lock.release()
    assert (said.returncode, said.stdout, said.stderr.count("\n")) == (2, "", 1), said.stderr
    assert said.stderr.startswith(f"error: checkpoint folder {folder} is in use by another run (pid {os.getpid()} on ")


# The scripts.

def run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "examples/sft/sft_torch.py",
                *TINY, *args])


def jax_example(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "examples/sft/sft_jax.py", *TINY, *args])


def said_once(result: subprocess.CompletedProcess, script: str) -> str:
    """The one `error:` line of a run that stopped on a user error, before any step, with no traceback of
    its own (torchrun adds its summary, and a traceback of its own launcher, after it)."""
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if line.startswith("error")]
    assert result.returncode != 0 and len(lines) == 1, output[-3000:]
    assert f'{script}", line' not in output and "[rank" not in output, output[-3000:]  # no worker's traceback
    assert "step 1:" not in output
    return lines[0]


def test_jax_example_stops_on_mistakes_before_training(tmp_path):
    for args, expected in (
        (["--data", str(data(tmp_path, LINES[0], b'{"instruction": "\xff"}\n', name="latin.jsonl"))],
         f"{tmp_path}/latin.jsonl:2: not UTF-8"),
        (["--data", str(data(tmp_path, *LINES[:3], '{"instruction": "x"}\n', name="no-output.jsonl"))],
         f"{tmp_path}/no-output.jsonl:4: the row has no 'output'"),
        (["--data", str(data(tmp_path, *LINES[:150], name="short.jsonl"))],
         f"{tmp_path}/short.jsonl has 150 rows, and --held-out 200"),
        (["--data", str(TASKS), "--steps", "2000"], "--steps 2000 on 4 devices takes 8000 packed rows"),
        (["--data", str(TASKS), "--out", str(TASKS)], f"--out {TASKS} is a file, not a folder"),
    ):
        result = jax_example(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert said_once(result, "sft_jax.py").startswith(f"error: {expected}")


def test_torch_example_stops_on_mistakes_before_training(tmp_path):
    for args, expected in (
        (["--card", "tiny-lama"], "error: unknown card 'tiny-lama' (did you mean 'tiny-llama'?)"),
        (["--data", str(data(tmp_path, LINES[0], '{"instruction": "x", "input": ""\n'))],
         f"error: {tmp_path}/data.jsonl:2: not valid JSON"),
        (["--data", str(TASKS), "--out", str(TASKS / "weights")], f"error: --out {TASKS / 'weights'} cannot be made"),
        (["--data", str(TASKS), "--steps", "2000"], "error: --steps 2000 on 2 processes takes 4000 packed rows"),
    ):
        result = torchrun(*args)
        assert result.returncode != 0
        assert said_once(result, "sft_torch.py").startswith(expected)
        # The first rank's status; the other's too, unless torchrun stopped it before it found the mistake.
        assert "rank      : 0 (local_rank: 0)\n  exitcode  : 2" in result.stderr


@pytest.mark.parametrize("example", [torchrun, jax_example], ids=["torch", "jax"])
def test_a_finished_run_run_again_writes_out(tmp_path, example):
    """--steps 2 with the default warm-up; then the same command, its checkpoint at its last step, exports."""
    command = ["--data", str(TASKS), "--steps", "2", "--checkpoint", str(tmp_path / "run")]
    first = example(*command)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step 2:" in first.stdout
    again = example(*command, "--out", str(tmp_path / "weights"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "no steps left to run" in again.stdout and "step 1:" not in again.stdout
    assert (tmp_path / "weights" / "model.safetensors").exists()
