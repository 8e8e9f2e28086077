"""The XLA options Linnet's JAX functions compile with on GPUs, each kept only if the installed jaxlib
knows it and the user's XLA_FLAGS does not name it (theirs wins): set per compile
(`jax.jit(..., compiler_options=...)`), never in the user's environment."""

from __future__ import annotations

import functools
import os
import re

import jax
import numpy as np

# What a scanned step asks of XLA on GPUs: the latency-hiding scheduler, and the collective pipeliner, which
# moves the next iteration's all-gather (and the previous one's reduce-scatter) of a `lax.scan` under this
# iteration's compute; double buffering unrolls the loop by two so that the moved collectives have their
# own buffers. No combine thresholds: a layer's weights are already one flat buffer, one collective.
# Conditionals in command buffers (CUDA graphs' conditional nodes): the fast attention's `lax.switch` on the
# rows' document count, one a layer each way, otherwise has the host read its branch index, a stall each
# time (docs/design/jax_speed.md). The rest of the list is XLA's default kinds, which naming the list replaces.
GPU_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL",
}


@functools.cache
def xla_options(platform: str) -> dict:
    """GPU_OPTIONS on a GPU, less those the installed jaxlib does not know (a flag renamed or retired is
    left out, not an error) and those XLA_FLAGS sets; none elsewhere."""
    if platform != "gpu" and platform != "cuda":
        return {}
    known, theirs = {}, user_flags()
    for name, value in GPU_OPTIONS.items():
        if name in theirs:
            continue
        try:
            jax.jit(lambda x: x, compiler_options={name: value}).lower(np.zeros(1, np.float32)).compile()
            known[name] = value
        except Exception:  # noqa: BLE001  (jaxlib says "No such compile option" as a runtime error)
            continue
    return known


def user_flags() -> set[str]:
    """The option names XLA_FLAGS sets ("--xla_gpu_enable_command_buffer=" turns command buffers off)."""
    return set(re.findall(r"--(\w+)=", os.environ.get("XLA_FLAGS", "")))
