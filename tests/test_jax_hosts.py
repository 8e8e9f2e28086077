"""linnet.jax over several processes, as on several machines: two processes on the
loopback address, 2 host devices each, joined by linnet.jax.hosts, train as one process does on 4
devices; the checkpoint they write resumes in one process."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from distributed import free_port
from test_jax_train import adamw, card as card, load, mesh, rows  # noqa: F401  (the card fixture)

from linnet.jax import hosts
jax_train = importlib.import_module("linnet.jax.train")  # the module: linnet.jax.train is also the function

HERE = Path(__file__).resolve().parent


def run_two_processes(card, steps: int, checkpoint: Path | str, out: Path, *, failing: bool = False,
                      run_rows: int = 4 * 4) -> dict | list[str]:
    """The losses the first process writes; with `failing`, each process's error, both having stopped."""
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    processes = [subprocess.Popen([sys.executable, str(HERE / "jax_hosts_driver.py"), str(card), str(steps),
                                   str(checkpoint), str(out), str(run_rows)], env={**env, "JAX_PROCESS_ID": str(index)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for index in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == (3 if failing else 0), output[-3000:]
    if failing:
        return [Path(f"{out}.error-{index}").read_text() for index in range(2)]
    return json.loads(out.read_text())


def test_two_processes_train_as_one_and_resume_from_and_into_one(card, tmp_path):
    batches = rows(4 * 4)
    straight_model = load(card)
    straight = jax_train.train(straight_model, batches, optimizer=adamw(), steps=4, mesh=mesh(4),
                               on_step=lambda step: None)[1]
    two = run_two_processes(card, 2, tmp_path / "run", tmp_path / "two.json")
    assert two["mesh"] == {"replicate": 2, "shard": 2}
    # f32: the same global batch a step, summed in another order (2 x 2 devices against 4).
    np.testing.assert_allclose(two["losses"], [s.loss for s in straight.steps[:2]], rtol=1e-5)
    assert two["loss_tokens"] == [s.loss_tokens for s in straight.steps[:2]]  # the whole step's, not a process's
    two_steps = load(card)
    jax_train.train(two_steps, batches, optimizer=adamw(), steps=2, mesh=mesh(4), on_step=lambda step: None)
    np.testing.assert_allclose(two["held_out"], jax_train.evaluate(two_steps, rows(4, seed=11)), rtol=1e-5)
    assert (tmp_path / "run-weights" / "config.json").exists()  # written once, by the first process
    resumed = jax_train.train(load(card), batches, optimizer=adamw(), steps=3, mesh=mesh(4),
                              on_step=lambda step: None, checkpoint=tmp_path / "run")[1]
    assert resumed.resumed_from == 2
    np.testing.assert_allclose([s.loss for s in resumed.steps], [straight.steps[2].loss], rtol=1e-5)
    # And back to two processes: each skips its own share of the rows the three steps used.
    last = run_two_processes(card, 4, tmp_path / "run", tmp_path / "last.json")
    np.testing.assert_allclose(last["losses"], [straight.steps[3].loss], rtol=1e-5)


def test_joining_needs_the_whole_environment(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert hosts.join() is False  # one process: nothing to join
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
    with pytest.raises(ValueError, match="JAX_PROCESS_ID is not"):
        hosts.join()
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID=2 is not one of the 2 processes"):
        hosts.join()
    monkeypatch.setenv("JAX_PROCESS_ID", "one")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID='one' is not a whole number"):
        hosts.join()


def test_a_process_fetches_an_array_from_its_own_devices_blocks():
    """shard.to_host's assembly, which a process of several uses: every distinct block once, whether the
    array is split along its first axis or its second (layers stacked), and an error where a block is missing."""
    from jax.sharding import NamedSharding, PartitionSpec

    from linnet.jax import shard

    two_axes = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("replicate", "shard"))
    for spec, shape in [(PartitionSpec("shard"), (8,)), (PartitionSpec(None, "shard"), (3, 8)), (PartitionSpec(), ())]:
        array = jax.device_put(np.arange(np.prod(shape), dtype=np.float32).reshape(shape),
                               NamedSharding(two_axes, spec))
        np.testing.assert_array_equal(shard._assemble(array), np.asarray(array))

    class Partial:  # what a process holds of an array split across processes: one block of two
        shape, dtype, size = (8,), np.float32, 8
        addressable_shards = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(
            two_axes, PartitionSpec("shard"))).addressable_shards[:1]

    with pytest.raises(ValueError, match=r"split over several processes"):
        shard._assemble(Partial())


def test_processes_that_find_different_checkpoints_stop_together_naming_each(card, tmp_path):
    """Each process reads the checkpoint folder itself (as on machines whose disks are their own): one that
    finds step 2 and one that finds none would train different weights as one run."""
    jax_train.train(load(card), rows(4 * 4), optimizer=adamw(), steps=2, mesh=mesh(4), on_step=lambda step: None,
                    checkpoint=tmp_path / "run-0")
    errors = run_two_processes(card, 3, f"{tmp_path}/run-{{process}}", tmp_path / "out.json", failing=True)
    for index, error in enumerate(errors):
        assert error.startswith("ValueError: the processes found different checkpoints to resume from (step 2 on "
                                f"process 0, step 0 on process 1; {tmp_path}/run-{index} on process {index})"), error


def test_a_save_that_fails_on_the_first_process_stops_every_process(card, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "step-00000002.partial").write_text("a file where the save makes its folder")
    errors = run_two_processes(card, 2, tmp_path / "run", tmp_path / "out.json", failing=True)
    assert "step-00000002.partial" in errors[0], errors[0]
    assert errors[1] == (f"RuntimeError: saving a checkpoint into {tmp_path / 'run'} failed on process 0; "
                         f"its own error says why")


def test_a_process_whose_rows_run_out_first_stops_every_process(card, tmp_path):
    """Ten rows over four devices: the first process's share holds three steps, the second's two."""
    errors = run_two_processes(card, 3, tmp_path / "run", tmp_path / "out.json", failing=True, run_rows=10)
    assert errors[1].startswith("ValueError: the batches ran out at step 3 of 3"), errors[1]
    assert errors[0] == "RuntimeError: taking the rows of step 3 failed on process 1; its own error says why"

