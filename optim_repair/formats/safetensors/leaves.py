"""A safetensors file's leaves: each tensor its header describes, where its bytes lie."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from optim_repair.formats.safetensors.adapter import placed_weights
from optim_repair.records.leaves import Leaf, LeafPath, Piece, TensorLeaf


def safetensors_leaves(
    path: Path, rel: str, source: str, opener: Callable[[], BinaryIO] | None = None
) -> dict[LeafPath, Leaf]:
    """The tensors of the safetensors file ``rel`` (at ``path``, or what ``opener`` opens), each by its name."""
    weights, starts = placed_weights(path, source, opener=opener)
    leaves: dict[LeafPath, Leaf] = {}
    for name, meta in weights.tensors:
        piece = Piece((0,) * len(meta.shape), meta.shape, rel, starts[name], meta.stride, 0)
        leaves[(name,)] = TensorLeaf(meta.dtype, meta.shape, meta.stride, (piece,))
    return leaves
