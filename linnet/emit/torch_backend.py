"""The PyTorch backend of the emitter."""

from linnet.emit import prims_torch
from linnet.emit.source import Backend

TORCH = Backend(
    name="torch",
    imports="import math\n\nimport torch\nimport torch.nn.functional as F",
    prims={"exact": prims_torch.EXACT, "fast": prims_torch.FAST},
    dtypes={"f32": "torch.float32", "bf16": "torch.bfloat16", "f16": "torch.float16"},
    cast="to",
)
