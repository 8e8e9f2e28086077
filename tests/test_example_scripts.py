"""A run that cannot be lost, as a user runs the examples: a mistake ends the run before the first step
in one line, from one process, with exit status 2 and no traceback of its own; another rank lets the
first speak; a second run on a held checkpoint folder is refused; a run re-run after it finished
still writes --out. Each torchrun launch costs 10 to 60 s here, so a few representative cases run;
the checks themselves are tests/test_examples_errors.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_examples_errors import LINES, ROOT, TASKS, data

from linnet.checkpoint import lock as folder_lock

TINY = ["--card", "tiny-llama", "--tokens", "256", "--lr", "3e-3"]


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

def run(command: list[str], timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4", **(env or {})}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def torchrun(*args: str, processes: int = 2) -> subprocess.CompletedProcess:
    """The example under `linnet-torchrun` (torchrun, ending as its workers' user errors do)."""
    return run([sys.executable, "-m", "linnet.torch.launch", f"--nproc_per_node={processes}",
                "examples/sft/sft_torch.py", *TINY, *args])


def jax_example(*args: str, devices: int = 4) -> subprocess.CompletedProcess:
    return run([sys.executable, "examples/sft/sft_jax.py", *TINY, *args],
               env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})


def said_once(result: subprocess.CompletedProcess) -> str:
    """The one line of a run that stopped on a user error before any step: all it printed, and status 2."""
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if line and not line.startswith(TORCHRUN_BANNER)]
    assert (result.returncode, len(lines)) == (2, 1), output[-3000:]
    assert lines[0].startswith("error: ")
    return lines[0]


# torchrun's warning that it sets OMP_NUM_THREADS, four lines at its start
TORCHRUN_BANNER = ("W", "*****", "Setting OMP_NUM_THREADS")


def test_linnet_torchrun_ends_a_user_error_in_its_one_line_and_a_bug_as_torchrun_does(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(RAISE.format("UserError"))
    assert said_once(run([sys.executable, "-m", "linnet.torch.launch", "--nproc_per_node=2", str(script)])) == (
        "error: bad --steps")
    script.write_text(RAISE.format("ValueError"))
    bug = run([sys.executable, "-m", "linnet.torch.launch", "--nproc_per_node=2", str(script)])
    assert bug.returncode == 1 and "ValueError: bad --steps" in bug.stderr and "ChildFailedError" in bug.stderr


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
        assert said_once(jax_example(*args)).startswith(f"error: {expected}")


def test_torch_example_stops_on_mistakes_before_training(tmp_path):
    for args, expected in (
        (["--card", "tiny-lama"], "error: unknown card 'tiny-lama' (did you mean 'tiny-llama'?)"),
        (["--data", str(data(tmp_path, LINES[0], '{"instruction": "x", "input": ""\n'))],
         f"error: {tmp_path}/data.jsonl:2: not valid JSON"),
        (["--data", str(TASKS), "--out", str(TASKS / "weights")], f"error: --out {TASKS / 'weights'} cannot be made"),
        (["--data", str(TASKS), "--steps", "2000"], "error: --steps 2000 on 2 processes takes 4000 packed rows"),
    ):
        assert said_once(torchrun(*args)).startswith(expected)


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


def losses(result: subprocess.CompletedProcess) -> dict[int, float]:
    assert result.returncode == 0, result.stderr[-3000:]
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+): loss ([\d.]+)", result.stdout, re.M)}


def resumed_elsewhere(tmp_path, first, then) -> tuple[dict, dict]:
    """The losses of a run of 4 steps by `first` that saves at step 2, and of its step-2 checkpoint resumed
    by `then` (on another number of ranks, with as many rows a step through --accumulate)."""
    command = ["--data", str(TASKS), "--steps", "4", "--held-out", "20", "--checkpoint-every", "2"]
    straight = losses(first(*command, "--checkpoint", str(tmp_path / "run")))
    shutil.copytree(tmp_path / "run" / "step-00000002", tmp_path / "resumed" / "step-00000002")
    resumed = losses(then(*command, "--checkpoint", str(tmp_path / "resumed")))
    assert set(straight) == {1, 2, 3, 4} and set(resumed) == {3, 4}
    return straight, resumed


def test_the_torch_example_resumes_on_another_number_of_processes_to_the_same_losses(tmp_path):
    """2 processes, then 1 taking 2 rows a step: the same rows a step, so the same losses (to the printed
    3 decimals, within a unit of the last for rounding)."""
    straight, resumed = resumed_elsewhere(tmp_path, lambda *args: torchrun(*args, processes=2),
                                          lambda *args: torchrun(*args, "--accumulate", "2", processes=1))
    for step in (3, 4):
        assert resumed[step] == pytest.approx(straight[step], abs=1.5e-3)


def test_the_torch_example_resumes_on_another_number_of_processes_one_to_three(tmp_path):
    """1 process taking 3 rows a step, then 3 taking one each."""
    straight, resumed = resumed_elsewhere(tmp_path, lambda *args: torchrun(*args, "--accumulate", "3", processes=1),
                                          lambda *args: torchrun(*args, processes=3))
    for step in (3, 4):
        assert resumed[step] == pytest.approx(straight[step], abs=1.5e-3)


def test_the_jax_example_resumes_on_another_number_of_devices_to_the_same_losses(tmp_path):
    straight, resumed = resumed_elsewhere(tmp_path, lambda *args: jax_example(*args, devices=4),
                                          lambda *args: jax_example(*args, "--accumulate", "2", devices=2))
    for step in (3, 4):
        assert resumed[step] == pytest.approx(straight[step], abs=1.5e-3)
