"""A checkpoint as leaves: every tensor and every plain value it holds, by a name any format gives alike.

A leaf's name is its file (relative to the argument, ``""`` for the argument itself) and its path of keys and
indices inside that file, each part as text: a DCP checkpoint's ``optim.state.w.exp_avg`` and the same entry of
the torch file ``dcp_to_torch_save`` makes of it have one name. Readers in ``optim_repair.formats`` list leaves;
comparing two checkpoints matches them by name. No torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from optim_repair.records.dtypes import numel

LeafPath = tuple[str, ...]
LeafName = tuple[str, LeafPath]
"""A leaf's file and its path inside it."""


@dataclass(frozen=True)
class Piece:
    """Where one box of a tensor's elements lies: the box (``start``, ``size``) of the whole tensor, stored in
    ``file`` from byte ``base`` on, its first element at element ``offset`` there, laid out by ``stride``."""

    start: tuple[int, ...]
    size: tuple[int, ...]
    file: str
    base: int
    stride: tuple[int, ...]
    offset: int
    archive: int | None = None
    """For a DCP chunk: the length of the ``torch.save`` archive at ``base`` that holds it (its layout is the
    archive's, read only when its bytes are compared); None where ``base``, ``stride`` and ``offset`` are known."""
    transforms: tuple[str, ...] = ()
    """DCP's stream transforms on the archive (``stream.zstd/1``)."""


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor: what it is, and where its elements lie."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None
    """Its strides where the format records them (a DCP checkpoint before torch 2.15 does not)."""
    pieces: tuple[Piece, ...]
    shares: tuple[LeafPath, int] | None = None
    """The first leaf (by path) of its file on its storage, and how many are on it; None where the format cannot
    share a storage."""

    @property
    def numel(self) -> int:
        return numel(self.shape)


@dataclass(frozen=True)
class ValueLeaf:
    """Anything but a tensor: a number, a text, an empty container, an object, compared by ``value``."""

    value: Hashable
    """The value in a form that compares as its bits do (a float by its bytes, ``-0.0`` apart from ``0.0``)."""
    shown: str


@dataclass(frozen=True)
class RawLeaf:
    """Bytes compared as they are stored: a file no reader parses (``trainer_state.json``, a torch file that
    names other code), or a DCP entry whose pickle is not read or that encodes a tensor its own way."""

    file: str
    offset: int
    length: int


Leaf = TensorLeaf | ValueLeaf | RawLeaf


def path_part(key: object) -> str:
    """A dict key or list index as a part of a leaf's path: ``0`` and ``"0"`` alike, as DCP names both."""
    return key if isinstance(key, str) else str(key) if isinstance(key, int) else repr(key)


def leaf_text(name: LeafName) -> str:
    """``("optimizer.pt", ("state", "0", "exp_avg"))`` -> ``optimizer.pt:state.0.exp_avg``."""
    file, path = name
    inside = ".".join(path)
    if not file:
        return inside or "(the argument)"
    return f"{file}:{inside}" if inside else file
