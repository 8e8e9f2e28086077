"""`linnet.train`, as the first example scripts import it: the PyTorch training loop, linnet.torch.train."""

from linnet.torch.train import *  # noqa: F403
from linnet.torch.train import __all__  # noqa: F401
