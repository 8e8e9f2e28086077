"""Each training step's metrics, written where a person looks for them, whatever the framework: one JSON
line a step in a file, TensorBoard's event files beside it when `tensorboard` is installed, and W&B when
`wandb` is installed and a project is named. An on_step callback of either wing's train:

    metrics = Metrics("run/metrics.jsonl", flops_per_token=flops_per_token(model, 4096), devices=world,
                      peak_flops=peak_flops(torch.cuda.get_device_name()), peak_memory=peak_memory_gib)
    train(model, rows, ..., on_step=metrics)

A line holds the step, its loss, gradient norm (where the run clips), learning rate, held-out loss (where
evaluated), seconds, tokens, tokens a second, the TFLOP/s a device reached and their share of its bf16
peak (MFU, where the device's peak is known), and the peak memory a device held (where measured). Only
the first process writes; a resumed run appends to the same file."""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path

from linnet.history import Step

__all__ = ["Metrics", "flops_per_token", "parameters", "peak_flops"]

# Dense bf16 tensor FLOP/s of a device, by a name its driver reports (the first that the name contains).
PEAK_BF16_FLOPS = {"GH200": 989e12, "H200": 989e12, "H100": 989e12, "H800": 989e12, "B200": 2250e12,
                   "A100": 312e12, "A800": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def parameters(model) -> int:
    """The model's weights, counted from its card (tied weights once)."""
    return sum(math.prod(spec.shape) for spec in model.specs())


def flops_per_token(model, positions: int) -> int:
    """A training step's FLOPs a token of a row of `positions`: 6 x the matrix products' weights (the
    embedding's where it is the head too), plus causal attention's 6 x layers x positions x D."""
    checked = model.checked
    matmuls = parameters(model) - (0 if checked.consts["tied"] else checked.dims["Vocab"] * checked.dims["D"])
    return 6 * matmuls + 6 * checked.dims["Layers"] * positions * checked.dims["D"]


def peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 FLOP/s, or None for a device not in PEAK_BF16_FLOPS (a CPU, say)."""
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in device_name:
            return flops
    return None


class Metrics:
    """The on_step callback that writes each Step's metrics (see the module's docstring)."""

    def __init__(self, path: str | Path, *, flops_per_token: int | None = None, devices: int = 1,
                 peak_flops: float | None = None, peak_memory: Callable[[], float] | None = None,
                 writer: bool = True, wandb_project: str | None = None, config: dict | None = None):
        self.path = Path(path)
        self.flops_per_token, self.devices, self.peak_flops = flops_per_token, devices, peak_flops
        self.peak_memory, self.writer = peak_memory, writer
        self._file = self._tensorboard = self._wandb = None
        if not writer:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"))
        if wandb_project is not None:
            if importlib.util.find_spec("wandb") is None:
                raise ValueError(f"W&B project {wandb_project!r} asked for, but wandb is not installed: "
                                 f"pip install wandb, or leave the project out")
            import wandb

            self._wandb = wandb.init(project=wandb_project, config=config or {})

    def record(self, step: Step) -> dict:
        """The step's metrics, as written."""
        tokens_per_s = step.tokens / step.seconds if step.seconds > 0 else None
        tflops = (self.flops_per_token * tokens_per_s / self.devices / 1e12
                  if self.flops_per_token is not None and tokens_per_s is not None else None)
        return {
            "step": step.step, "loss": step.loss, "grad_norm": step.grad_norm,
            "lr": None if math.isnan(step.lr) else step.lr, "held_out_loss": step.held_out_loss,
            "seconds": step.seconds, "tokens": step.tokens, "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak_flops if tflops is not None and self.peak_flops else None,
            "peak_memory_gib": self.peak_memory() if self.peak_memory is not None else None,
        }

    def __call__(self, step: Step) -> None:
        if not self.writer:
            return
        record = self.record(step)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {name: value for name, value in record.items() if name != "step" and value is not None}
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(f"train/{name}", value, step.step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step.step)

    def close(self) -> None:
        for sink in (self._file, self._tensorboard):
            if sink is not None:
                sink.close()
        if self._wandb is not None:
            self._wandb.finish()
