"""Where two tensors' pieces meet, and how the elements of each box they share lie in both: pure functions.

A piece is a box of a tensor's elements stored somewhere (``records.leaves.Piece``): a whole torch storage, a DCP
chunk. Two sides' pieces are swept in the order they start, so each meets only those it overlaps; a box they share
is walked as both lay it out, each stored element once where both repeat it (stride 0), and read as the runs of
bytes its elements take. No I/O.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from optim_repair.records.dtypes import numel
from optim_repair.records.leaves import Piece

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A box of a tensor's elements: where it starts, and its size."""


def meet(a: Piece, b: Piece) -> Box | None:
    """The box where two pieces meet, or None where they do not (a scalar's meet in its one element)."""
    start = tuple(max(x, y) for x, y in zip(a.start, b.start, strict=True))
    end = tuple(min(x + dx, y + dy) for x, dx, y, dy in zip(a.start, a.size, b.start, b.size, strict=True))
    if any(lo >= hi for lo, hi in zip(start, end, strict=True)):
        return None if start else ((), ())
    return start, tuple(hi - lo for lo, hi in zip(start, end, strict=True))


def meets(a: Sequence[Piece], b: Sequence[Piece]) -> Iterator[tuple[Piece, Piece, Box]]:
    """Every piece of A and piece of B whose boxes meet, and the box where they do: both sides' pieces swept in
    the order they start along the dimension in which they start at the most places, each met only with the
    pieces of the other side it overlaps along it (sorting, then the pairs that overlap there)."""
    pieces = (a, b)
    rank = len(a[0].start) if a else 0
    along = max(range(rank), key=lambda dim: len({piece.start[dim] for piece in (*a, *b)}), default=None)
    if along is None:  # a scalar's pieces all hold its one element
        yield from ((x, y, ((), ())) for x in a for y in b)
        return
    starts = sorted((piece.start[along], side, index) for side in (0, 1) for index, piece in enumerate(pieces[side]))
    open_: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])  # by where each ends along it
    for begin, side, index in starts:
        piece, others = pieces[side][index], open_[1 - side]
        while others and others[0][0] <= begin:
            heapq.heappop(others)
        for _, other in others:
            pair = (piece, pieces[1][other]) if side == 0 else (pieces[0][other], piece)
            box = meet(*pair)
            if box is not None:
                yield pair[0], pair[1], box
        heapq.heappush(open_[side], (begin + piece.size[along], index))


@dataclass(frozen=True)
class Walk:
    """How the elements of a box lie in both pieces: where each side's first one is (in elements from its
    piece's base), the dimensions to walk (size, stride in A, stride in B), outermost first as the side that
    spans more of its storage lays them out, and how many of the box's elements each walked one stands for: a
    dimension of one element, or along which both sides repeat one element (stride 0, as ``expand`` leaves it),
    is not walked."""

    first: tuple[int, int]
    dims: tuple[tuple[int, int, int], ...]
    times: int

    @property
    def walked(self) -> int:
        return numel(tuple(size for size, _, _ in self.dims))

    def spanned(self, side: int) -> int:
        """How many elements of its storage the side's walk spans, first to last."""
        return 1 + sum((dim[0] - 1) * dim[1 + side] for dim in self.dims)


def walk(pieces: tuple[Piece, Piece], box: Box) -> Walk:
    """How the elements of ``box`` lie in both pieces."""
    start, size = box
    first = tuple(
        piece.offset + sum((s - p) * stride for s, p, stride in zip(start, piece.start, piece.stride, strict=True))
        for piece in pieces
    )
    dims, times = [], 1
    for extent, stride_a, stride_b in zip(size, pieces[0].stride, pieces[1].stride, strict=True):
        if extent > 1 and stride_a == stride_b == 0:
            times *= extent
        elif extent > 1:
            dims.append((extent, stride_a, stride_b))
    wider = int(sum((dim[0] - 1) * (dim[2] - dim[1]) for dim in dims) > 0)
    dims.sort(key=lambda dim: (dim[1 + wider], dim[2 - wider]), reverse=True)
    return Walk((first[0], first[1]), tuple(dims), times)


def runs(piece: Piece, first: int, dims: Sequence[tuple[int, int]], item: int) -> Iterator[tuple[int, int, int]]:
    """The runs of bytes that a walk over ``dims`` (size, stride) from element ``first`` takes in the piece's
    file, in order: ``(offset, length, times)``, the ``length`` bytes at ``offset`` taken ``times`` over (where
    the walk goes along a stride of 0 inside them), adjacent runs joined."""
    inner, span = len(dims), 1  # the trailing dimensions that lie as one run
    while inner > 0 and dims[inner - 1][1] == span:
        span *= dims[inner - 1][0]
        inner -= 1
    times = 1  # and those outside it along which the walk takes it again
    while inner > 0 and dims[inner - 1][1] == 0:
        times *= dims[inner - 1][0]
        inner -= 1
    length = span * item
    pending: tuple[int, int, int] | None = None
    strides = [stride for _, stride in dims[:inner]]
    for index in itertools.product(*(range(extent) for extent, _ in dims[:inner])):
        offset = piece.base + (first + sum(i * stride for i, stride in zip(index, strides, strict=True))) * item
        if pending is not None and pending[2] == times == 1 and pending[0] + pending[1] == offset:
            pending = (pending[0], pending[1] + length, 1)
            continue
        if pending is not None and (pending[0], pending[1]) == (offset, length):
            pending = (offset, length, pending[2] + times)
            continue
        if pending is not None:
            yield pending
        pending = (offset, length, times)
    if pending is not None:
        yield pending
