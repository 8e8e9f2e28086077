"""Linnet for PyTorch: `fully_shard(model)` over the custom ops in linnet._C."""

from linnet.torch.shard import fully_shard

__all__ = ["fully_shard"]
