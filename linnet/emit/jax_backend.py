"""The JAX backend of the emitter (`backend="jax_source"`)."""

from linnet.emit import prims_jax
from linnet.emit.source import Backend

JAX = Backend(
    name="jax",
    imports="import math\n\nimport jax\nimport jax.numpy as jnp\nimport numpy as np",
    prims={"exact": prims_jax.EXACT, "fast": prims_jax.FAST},
    dtypes={"f32": "jnp.float32", "bf16": "jnp.bfloat16", "f16": "jnp.float16"},
    cast="astype",
)
