"""One process a machine: joining the others before any device is touched.

Start the same script on every machine with the coordinator's address (the first machine's, any free
port), how many processes there are and which one this is:

    JAX_COORDINATOR_ADDRESS=HOST:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python sft_jax.py ...   # machine 0
    JAX_COORDINATOR_ADDRESS=HOST:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 python sft_jax.py ...   # machine 1

Each process then sees every machine's devices; linnet.jax.train.default_mesh() makes each machine a
replica (its devices split the parts among them) and own_rows picks the rows this machine's devices
take. On CPUs the processes' collectives go over Gloo."""

from __future__ import annotations

import os

import jax

VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def join() -> bool:
    """Joins the run's other processes when the environment names a coordinator (VARIABLES); returns
    whether it did. Call it first: JAX cannot join others once it has used a device."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        return False
    missing = [name for name in VARIABLES[1:] if not os.environ.get(name)]
    if missing:
        raise ValueError(f"JAX_COORDINATOR_ADDRESS={address} is set, so this process joins others, but "
                         f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: set all of "
                         f"{', '.join(VARIABLES)}")
    count, index = (_integer(name) for name in VARIABLES[1:])
    if not 0 <= index < count:
        raise ValueError(f"JAX_PROCESS_ID={index} is not one of the {count} processes (0 to {count - 1})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; GPUs use NCCL
    jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=index)
    return True


def _integer(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a whole number") from None
