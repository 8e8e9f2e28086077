"""The mesh `fully_shard` shards over under torchrun: one flat group, or, across machines, shards inside
each machine and one replica a machine (FSDP2's hybrid sharding), chosen from what torchrun reports."""

from __future__ import annotations

import os

from linnet.errors import UserError

SHARDINGS = ("auto", "flat", "hybrid")


def torchrun_mesh(device_type: str, sharding: str = "auto"):
    """None (fully_shard's flat group of every rank) or a ("replicate", "shard") DeviceMesh of machines x
    processes a machine. "auto" is hybrid when torchrun runs on more than one machine (LOCAL_WORLD_SIZE
    below WORLD_SIZE), where the network between machines is several times slower than inside one."""
    import torch.distributed as dist

    if sharding not in SHARDINGS:
        raise UserError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if sharding == "flat" or (sharding == "auto" and local == world):
        return None
    if local < 1 or world % local:
        raise UserError(f"hybrid sharding puts the same number of processes on every machine: {world} processes "
                        f"do not divide into machines of LOCAL_WORLD_SIZE={local}")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // local, local), mesh_dim_names=("replicate", "shard"))
