"""Test settings: the tests folder is importable (its helpers), warnings stay quiet, a module that sets
LIMIT_S has each of its tests bounded by that many seconds, and tests marked `slow` (more variants of
what another test covers) run only with `--all`."""

import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Four CPU devices for JAX's meshes (set before JAX is first imported); the other tests use the first.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def bounded(request):
    """In a module that sets LIMIT_S, each test fails, rather than hangs, past LIMIT_S seconds
    (SIGALRM: there is no pytest-timeout)."""
    limit = getattr(request.module, "LIMIT_S", None)
    if limit is None:
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"the test ran past {limit} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true",
                     help="also run the tests marked slow: further variants (worlds, compilers, meshes) of what the "
                          "default run covers once")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--all"):
        return
    skip = pytest.mark.skip(reason="slow: a further variant of what the default run covers (pytest --all runs it)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
