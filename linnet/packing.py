"""`linnet.packing`, as the first example scripts import it: linnet.data.packing."""

from linnet.data.packing import *  # noqa: F403
from linnet.data.packing import __all__  # noqa: F401
