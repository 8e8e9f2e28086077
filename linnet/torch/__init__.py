"""Linnet for PyTorch: `fully_shard(model)` over the custom ops in linnet._C, and the training loop.

    from linnet.torch import fully_shard, train, evaluate
"""

from linnet.torch.shard import fully_shard
from linnet.torch.train import evaluate, train

__all__ = ["evaluate", "fully_shard", "train"]
