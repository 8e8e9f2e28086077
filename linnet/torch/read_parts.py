"""This rank's parts of a sharded model's groups, read from a checkpoint's SafeTensors: only the rows that
cover each part (linnet.hf.read.SliceReader), one group at a time."""

from __future__ import annotations

import torch

from linnet.hf.read import SliceReader, check_checkpoint, checkpoint_files, group_specs, locate
from linnet.sharding.layout import GroupLayout
from linnet.torch.model import TorchModel

__all__ = ["read_part", "read_parts_into"]


def read_part(reader: SliceReader, specs, layout: GroupLayout, rank: int) -> torch.Tensor:
    """This rank's part of one group, in f32 on the CPU, from the checkpoint's rows that cover it."""
    start = rank * layout.part_size
    return reader.read_flat(specs, layout.offsets, start, start + layout.part_size)


def read_parts_into(model: TorchModel, source) -> None:
    """Overwrites a sharded model's parts, in place, with this rank's parts of the weights in `source` (a
    model folder or its SafeTensors; checked against the card's names and shapes first), one group at a
    time: what resuming a run from a folder of full weights reads."""
    files = checkpoint_files(locate(source))
    check_checkpoint(model.checked, files)
    reader, sharding = SliceReader(files), model.sharding
    with torch.no_grad():
        for decl, index, specs in group_specs(model.checked, model.specs()):
            part = model.params[decl.key] if index is None else model.params[decl.key][index]
            part.copy_(read_part(reader, specs, sharding.layouts[decl.name], sharding.rank))
