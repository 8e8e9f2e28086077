"""A model's weights as the generated code takes them (`TorchModel.params`): a tree of dicts and lists
whose leaves are parts, or whatever takes a part's place in a tree of the same shape (None where a part
has nothing)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

__all__ = ["leaves", "map_leaves"]


def leaves(tree) -> Iterator:
    """The tree's leaves, in the order of its dicts and lists."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from leaves(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from leaves(value)
    else:
        yield tree


def map_leaves(tree, function: Callable):
    """A tree of the same shape, each leaf `function(leaf)`."""
    if isinstance(tree, dict):
        return {key: map_leaves(value, function) for key, value in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(value, function) for value in tree]
    return function(tree)
