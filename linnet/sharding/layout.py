"""Where each weight of a group lies in its flat buffer, and how the buffer is cut into parts: one layout
for both wings. The arithmetic is csrc/flat_layout.cpp's (bound by linnet._C): each tensor starts at a
multiple of `align` elements, and the buffer is padded to split into equal parts, each a multiple of
`align` (PyTorch aligns to 64 bytes in f32; JAX lays the tensors end to end, `align=1`).

    layouts = group_layouts(checked, parts=4, align=16)
    layouts["Layer"].offsets, layouts["Layer"].part_size
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch  # noqa: F401  (first: it loads the libraries that linnet._C links against)

from linnet import _C
from linnet.cardlang.check import Checked


@dataclass(frozen=True)
class GroupLayout:
    """Where each weight of one group lies in its flat buffer."""

    group: str  # the card's group name ("Layer")
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    total: int  # padded: parts * part_size
    part_size: int

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def extent(self) -> int:
        """Where the last weight ends: the buffer's content, before the padding."""
        return self.offsets[-1] + math.prod(self.shapes[-1])


def group_layouts(checked: Checked, parts: int, align: int = 1, *, what: str = "ranks") -> dict[str, GroupLayout]:
    """The flat layout of every group of the card (a tied weight belongs to the group it is read from), for
    `parts` parts each; refuses a split where most of a group's buffer would be padding, naming the group
    and `what` the parts are (ranks, devices)."""
    layouts = {}
    for decl in checked.program.groups.values():
        weights = [w for w in decl.weights if not checked.is_tied(w)]
        shapes = tuple(checked.weight_shape(w) for w in weights)
        flat = _C.flat_layout([math.prod(s) for s in shapes], align, parts)
        layout = GroupLayout(decl.name, tuple(w.name for w in weights), shapes, tuple(flat.offsets), flat.total,
                             flat.part_size)
        if 2 * layout.extent < layout.total:  # a world so large that it is a mistake, not a plan
            multiple = f" (a multiple of {align})" if align > 1 else ""
            raise ValueError(f"group {layout.group} has {layout.numel} elements: split over {parts} {what} into "
                             f"parts of {layout.part_size}{multiple}, more than half of its buffer would be "
                             f"padding. Use fewer {what}.")
        layouts[decl.name] = layout
    return layouts
