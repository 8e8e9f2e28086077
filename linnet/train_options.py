"""The options of a training run that both wings' `train` take, with one meaning: their checks, and when
the held-out loss is evaluated."""

from __future__ import annotations

import math

__all__ = ["check_train_options", "evaluates_after"]


def check_train_options(accumulate, max_grad_norm, eval_rows, eval_every) -> None:
    """A ValueError naming the first of train's `accumulate`, `max_grad_norm`, `eval_rows`/`eval_every` that
    is not what train takes."""
    if not (isinstance(accumulate, int) and accumulate >= 1):
        raise ValueError(f"train(accumulate={accumulate!r}): rows a rank takes a step, a whole number of at least 1")
    if max_grad_norm is not None and not 0 < max_grad_norm < math.inf:
        raise ValueError(f"train(max_grad_norm={max_grad_norm!r}): a finite norm above 0, or None for no clipping")
    if (eval_every is None) != (eval_rows is None) or (eval_every is not None and eval_every < 1):
        raise ValueError(f"train(eval_every={eval_every!r}) takes eval_rows, and a whole number of steps of at least 1")


def evaluates_after(step: int, steps: int, eval_every: int | None) -> bool:
    """Whether a run of `steps` steps evaluating every `eval_every` evaluates after `step`: every
    `eval_every` steps, and after the last."""
    return eval_every is not None and (step % eval_every == 0 or step == steps)
