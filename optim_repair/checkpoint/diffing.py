"""Comparing two checkpoints read from any listing: their leaves matched by name, each tensor's bytes read in order.

Each side is read as ``inspect`` reads it (``read_parsed``), then listed leaf by leaf by its formats' readers
(``formats.*.leaves``). Two tensors are compared over the boxes where their pieces meet (a DCP chunk, a whole
storage; the pieces swept in the order they start, so each meets only those it overlaps), each box as the runs
of bytes its stored elements occupy, each stored element once where both sides lay the box out alike, in blocks
of ``CHUNK`` bytes, in memory that does not grow with the tensors. Equal blocks pass at the speed of the disk or
the store; ``decisions.elements`` counts and decodes those that differ.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from optim_repair import signals
from optim_repair.checkpoint.reading import Listing, read_parsed
from optim_repair.decisions.difference import (
    Values,
    described,
    files_compared,
    leaf_differences,
    optimizer_differences,
)
from optim_repair.decisions.elements import ElementTally
from optim_repair.decisions.layouts import Box, meets, runs, walk
from optim_repair.errors import InputError, NotATorchFile, UnsafeInputError, UsageError, os_error_reason
from optim_repair.formats.dcp import is_rank_metadata
from optim_repair.formats.dcp.leaves import dcp_leaves
from optim_repair.formats.dcp.metadata import display_path
from optim_repair.formats.pickle_opcodes import PICKLE
from optim_repair.formats.pickled import tensor_meta
from optim_repair.formats.planned import Parsed
from optim_repair.formats.safetensors.leaves import safetensors_leaves
from optim_repair.formats.torchfile.leaves import torch_leaves
from optim_repair.formats.torchfile.zipformat import ZIP_MAGIC, open_zip
from optim_repair.records.difference import Difference, FileChange, LeafDifference, LeafTally
from optim_repair.records.dtypes import CHUNK, decode_element, itemsize, numel
from optim_repair.records.inventory import CheckpointInventory
from optim_repair.records.leaves import Leaf, LeafName, Piece, RawLeaf, TensorLeaf, ValueLeaf, leaf_text
from optim_repair.storage.ranged import FileSlice

_SWITCH_SECONDS = 0.0005
_REPEATED = 1 << 20


class _Files:
    """The files of one side, each opened once (a few at a time), to read by ranges."""

    def __init__(self, listing: Listing, stack: contextlib.ExitStack) -> None:
        self.listing, self._stack = listing, stack
        self._open: dict[str, BinaryIO] = {}

    def stream(self, file: str) -> BinaryIO:
        stream: BinaryIO | None = self._open.get(file)
        if stream is None:
            if len(self._open) >= 8:
                self._open.pop(next(iter(self._open))).close()
            try:
                stream = self._open[file] = self.listing.reader(file)()
            except OSError as exc:
                raise InputError(f"cannot read ({os_error_reason(exc)})", path=self.listing.named(file)) from exc
            self._stack.callback(stream.close)
        return stream

    def read(self, file: str, offset: int, length: int) -> bytes:
        stream = self.stream(file)
        stream.seek(offset)
        data = stream.read(length)
        if len(data) != length:
            raise InputError(f"truncated: {length} bytes at {offset} lie past its end", path=self.listing.named(file))
        return data

    def size(self, file: str) -> int:
        return self.stream(file).seek(0, 2)


class _Shards:
    """One DCP checkpoint's shards, read through its side's files (``ShardFiles``)."""

    def __init__(self, files: _Files, rel: str) -> None:
        self._files, self._rel = files, rel

    def size(self, relative: str, where: str) -> int:
        return self._files.size(display_path(self._rel, relative))

    def read(self, relative: str, ranges: Sequence[tuple[int, int]], where: str) -> Iterator[bytes]:
        for offset, length in ranges:
            yield self._files.read(display_path(self._rel, relative), offset, length)


def _dcp_directory(key: str) -> tuple[str, str]:
    """A kept metadata's DCP directory, and the file its leaves are listed under (a rank's view: its own)."""
    head, _, base = key.rpartition("/")
    if is_rank_metadata(base):
        return head, key
    if is_rank_metadata(key):
        return "", key
    return key, key


def _whole_file(files: _Files, rel: str) -> RawLeaf:
    return RawLeaf(rel, 0, files.size(rel))


def _torch(listing: Listing, parsed: Parsed, files: _Files, rel: str) -> dict[LeafName, Leaf]:
    try:
        torch_file = parsed.torch_files.get(rel) or listing.parse_torch(rel)
    except (UnsafeInputError, NotATorchFile, UsageError):
        return {(rel, ()): _whole_file(files, rel)}
    return {(rel, path): leaf for path, leaf in torch_leaves(torch_file, rel, listing.named(rel)).items()}


def side_leaves(listing: Listing, parsed: Parsed, files: _Files) -> dict[LeafName, Leaf]:
    """Every leaf of the checkpoint ``listing`` found (``parsed``: what reading it kept)."""
    if listing.is_file:
        return _torch(listing, parsed, files, "")
    leaves: dict[LeafName, Leaf] = {}
    for key, meta in parsed.dcp.items():
        rel, file = _dcp_directory(key)
        found = dcp_leaves(meta, _Shards(files, rel), rel, file or ".")
        leaves.update(((file, path), leaf) for path, leaf in found.items())
    for item in listing.listed():
        if item.unread is not None or item.role == "dcp":
            continue
        if item.role == "torch":
            leaves.update(_torch(listing, parsed, files, item.rel))
        elif item.role == "safetensors":
            try:
                found = safetensors_leaves(Path(item.rel), item.rel, listing.named(item.rel), listing.reader(item.rel))
            except InputError:
                found = {(): _whole_file(files, item.rel)}
            leaves.update(((item.rel, path), leaf) for path, leaf in found.items())
    for rel, size in listing.others():
        leaves[rel, ()] = RawLeaf(rel, 0, size)
    return leaves


def _resolved(piece: Piece, dtype: str, files: _Files) -> Piece:
    """A piece whose layout is known: a DCP chunk's from the ``torch.save`` archive holding it (or its raw bytes,
    where a storage writer stores them as they are)."""
    if piece.archive is None:
        return piece
    where = f"{files.listing.named(piece.file)}@{piece.base}"
    if piece.transforms:
        raise UsageError(
            f"its chunks are compressed ({', '.join(piece.transforms)}): compare them with {{argument}}",
            path=where,
            argument="metadata_only",
        )
    if files.read(piece.file, piece.base, min(len(ZIP_MAGIC), piece.archive)) != ZIP_MAGIC:
        if piece.archive != numel(piece.size) * itemsize(dtype):
            raise InputError(f"a chunk of {piece.archive} bytes holds {numel(piece.size)} {dtype} elements", path=where)
        return Piece(piece.start, piece.size, piece.file, piece.base, piece.stride, 0)
    chunk = cast(BinaryIO, FileSlice(files.stream(piece.file), piece.base, piece.archive))
    archive = open_zip(chunk, Path(where), where, allowed=PICKLE)  # dcp.load reads it with weights_only=False
    meta = tensor_meta(archive.graph.root)
    if meta is None or meta.shape != piece.size or meta.dtype != dtype or not meta.in_bounds:
        raise InputError(f"its chunk is no {dtype} tensor of shape {list(piece.size)}", path=where)
    base = piece.base + archive.offsets[meta.storage]
    return Piece(piece.start, piece.size, piece.file, base, meta.stride, meta.storage_offset)


class _Reader:
    """The bytes of a sequence of runs in one file (``layouts.runs``), taken a block at a time: a run taken more
    than once and no longer than ``_REPEATED`` bytes is read once and repeated in memory."""

    def __init__(self, files: _Files, file: str, runs: Iterator[tuple[int, int, int]]) -> None:
        self._files, self._file, self._runs = files, file, runs
        self._offset, self._unit, self._done, self._total = 0, 1, 0, 0
        self._held: bytes | None = None

    def take(self, length: int) -> bytes:
        parts = []
        while length:
            if self._done == self._total:
                self._offset, self._unit, times = next(self._runs)
                self._done, self._total, self._held = 0, self._unit * times, None
            at = self._done % self._unit
            if self._total > self._unit and self._unit <= _REPEATED:
                if self._held is None:
                    self._held = self._files.read(self._file, self._offset, self._unit)
                size = min(length, self._total - self._done)
                again = (size - (self._unit - at)) // self._unit + 1
                parts.append((self._held[at:] + self._held * again)[:size])
            else:
                size = min(length, self._total - self._done, self._unit - at)
                parts.append(self._files.read(self._file, self._offset + at, size))
            self._done, length = self._done + size, length - size
        return b"".join(parts) if len(parts) != 1 else parts[0]


@dataclass
class _Compared:
    tally: ElementTally
    covered: int = 0
    nbytes: int = 0
    first: tuple[bytes, bytes] | None = None


def _stream_pair(
    compared: _Compared, files: tuple[_Files, _Files], pieces: tuple[Piece, Piece], box: Box, item: int
) -> None:
    """Compare the box's elements in both pieces: each side's walk over them read in blocks, as its storage lays
    them out where both sides lay them out alike (each stored element read once, however often the tensor holds
    it); where they differ, element by element as the walk pairs them, refused past what both sides store."""
    paired = walk(pieces, box)
    compared.covered += numel(box[1])
    stored = paired.spanned(0) + paired.spanned(1)
    if paired.walked > stored:
        raise UsageError(
            f"its elements, laid out by strides {list(pieces[0].stride)} in A and {list(pieces[1].stride)} in B, "
            f"pair {paired.walked} elements where both sides store {stored}: compare them with {{argument}}",
            path=f"{files[0].listing.named(pieces[0].file)}@{pieces[0].base}",
            argument="metadata_only",
        )
    readers = [
        _Reader(side, piece.file, runs(piece, paired.first[at], [(dim[0], dim[1 + at]) for dim in paired.dims], item))
        for at, (side, piece) in enumerate(zip(files, pieces, strict=True))
    ]
    left = paired.walked * item
    block = CHUNK - CHUNK % item
    while left:
        length = min(block, left)
        a, b = readers[0].take(length), readers[1].take(length)
        if compared.first is None:
            compared.first = (a[:item], b[:item])
        compared.tally.add(a, b, paired.times)
        compared.nbytes += length
        left -= length


def _boxes(leaf: TensorLeaf) -> dict[Box, Piece]:
    """A tensor's pieces by the box each holds (of two that hold the same box, the last, as a load would leave it)."""
    return {(piece.start, piece.size): piece for piece in leaf.pieces}


def compare_tensors(a: TensorLeaf, b: TensorLeaf, files: tuple[_Files, _Files]) -> _Compared:
    """The elements of two tensors of one dtype and shape, compared where their pieces meet; refused where both
    sides' pieces overlap one another so that they meet in more elements than they hold (else at most one side's)."""
    item = itemsize(a.dtype)
    compared = _Compared(ElementTally(a.dtype))
    pieces_a = [_resolved(piece, a.dtype, files[0]) for piece in _boxes(a).values()]
    pieces_b = [_resolved(piece, b.dtype, files[1]) for piece in _boxes(b).values()]
    held = sum(numel(piece.size) for piece in (*pieces_a, *pieces_b))
    for piece_a, piece_b, box in meets(pieces_a, pieces_b):
        if compared.covered + numel(box[1]) > held:
            reason = f"its chunks overlap one another on both sides, meeting in more than the {held} elements they hold"
            raise InputError(reason, path=f"{files[0].listing.named(piece_a.file)}@{piece_a.base}")
        _stream_pair(compared, files, (piece_a, piece_b), box, item)
    return compared


def compare_raw(a: RawLeaf, b: RawLeaf, files: tuple[_Files, _Files]) -> _Compared:
    """Two stretches of stored bytes of one length, byte by byte."""
    whole = ((0,), (a.length,))
    pieces = tuple(Piece((0,), (leaf.length,), leaf.file, leaf.offset, (1,), 0) for leaf in (a, b))
    compared = _Compared(ElementTally("bits8"))
    _stream_pair(compared, files, (pieces[0], pieces[1]), whole, 1)
    return compared


def _place(leaf: Leaf) -> tuple[str, int]:
    if isinstance(leaf, TensorLeaf) and leaf.pieces:
        return leaf.pieces[0].file, leaf.pieces[0].base
    return (leaf.file, leaf.offset) if isinstance(leaf, RawLeaf) else ("", -1)


@dataclass
class _Sides:
    """Both sides, read, listed and opened."""

    inventories: tuple[CheckpointInventory, CheckpointInventory]
    leaves: tuple[dict[LeafName, Leaf], dict[LeafName, Leaf]]
    files: tuple[_Files, _Files]


def _bytes_differ(
    name: LeafName, a: Leaf, b: Leaf, sides: _Sides, values: tuple[Values, Values]
) -> tuple[LeafDifference | None, int]:
    if isinstance(a, TensorLeaf) and isinstance(b, TensorLeaf):
        compared = compare_tensors(a, b, sides.files)
        if compared.covered != a.numel and _boxes(a).keys() != _boxes(b).keys():
            return LeafDifference(leaf_text(name), "chunks", described(a), described(b)), compared.nbytes
        if a.numel == 1 and compared.first is not None:
            values[0][name], values[1][name] = (decode_element(a.dtype, first) for first in compared.first)
    else:
        assert isinstance(a, RawLeaf) and isinstance(b, RawLeaf)
        compared = compare_raw(a, b, sides.files)
    tally = compared.tally
    if not tally.differing:
        return None, compared.nbytes
    numel_ = a.numel if isinstance(a, TensorLeaf) else a.length
    found = LeafDifference(
        leaf_text(name), "bytes", described(a), described(b), tally.differing, numel_, tally.largest, tally.non_finite
    )
    return found, compared.nbytes


def _kind(leaf: Leaf) -> str:
    """What a leaf is counted as in a tally: ``tensors``, ``values`` or ``raw``."""
    return "tensors" if isinstance(leaf, TensorLeaf) else "values" if isinstance(leaf, ValueLeaf) else "raw"


def compared(sides: _Sides, *, metadata_only: bool, paths: tuple[str, str], started: float) -> Difference:
    """What differs between the two sides."""
    leaves_a, leaves_b = sides.leaves
    found: list[LeafDifference] = []
    differing: set[str] = set()
    only = [
        (n, LeafDifference(leaf_text(n), "only in A", described(x), None))
        for n, x in leaves_a.items()
        if n not in leaves_b
    ]
    only += [
        (n, LeafDifference(leaf_text(n), "only in B", None, described(x)))
        for n, x in leaves_b.items()
        if n not in leaves_a
    ]
    found.extend(difference for _, difference in only)
    differing.update(n[0] for n, _ in only)
    values: tuple[Values, Values] = ({}, {})
    counts = {"tensors": 0, "values": 0, "raw": 0, "identical": 0, "bytes": 0}
    both = sorted((name for name in leaves_a if name in leaves_b), key=lambda name: _place(leaves_a[name]))
    for name in both:
        a, b = leaves_a[name], leaves_b[name]
        kind = _kind(a)
        counts[kind] += 1
        differs = leaf_differences(name, a, b)
        found.extend(differs)
        read = not metadata_only or (isinstance(a, TensorLeaf) and a.numel == 1)  # a step is read either way
        if read and kind != "values" and not any(d.what in ("kind", "dtype", "shape", "bytes") for d in differs):
            difference, nbytes = _bytes_differ(name, a, b, sides, values)
            counts["bytes"] += nbytes
            if difference is not None:
                differs = [*differs, difference]
                found.append(difference)
        counts["identical"] += not differs
        if differs:
            differing.add(name[0])
    optimizers, only_a, only_b = optimizer_differences(*sides.inventories, values[0], values[1])
    tally = LeafTally(counts["tensors"], counts["values"], counts["raw"], counts["identical"], counts["bytes"])
    seconds = time.monotonic() - started
    files = files_compared(leaves_a, leaves_b, differing)
    return Difference(
        paths[0], paths[1], metadata_only, optimizers, only_a, only_b, tuple(found), tally, seconds, files
    )


def same_bytes(a: Listing, b: Listing) -> int | None:
    """For two file arguments: their size where they hold the same bytes, read side by side in blocks up to the
    first that differs; else None."""
    with a.reader("")() as first, b.reader("")() as second:
        size = first.seek(0, 2)
        if second.seek(0, 2) != size:
            return None
        first.seek(0)
        second.seek(0)
        block_a, block_b = bytearray(CHUNK), bytearray(CHUNK)
        into_a, into_b = cast(io.RawIOBase, first).readinto, cast(io.RawIOBase, second).readinto
        while True:
            read = into_a(block_a)
            if into_b(block_b) != read:
                return None
            if read < CHUNK:
                return size if block_a[:read] == block_b[:read] else None
            if block_a != block_b:  # whole bytearrays compare by memcmp
                return None


def _same_file(
    a: Listing, b: Listing, read: tuple[CheckpointInventory, Parsed], size: int, started: float
) -> Difference:
    """Two file arguments of the same ``size`` bytes: one holds what the other does, every leaf identical."""
    inventory, parsed = read
    with contextlib.ExitStack() as stack:
        leaves = side_leaves(a, parsed, _Files(a, stack))
    count = Counter(_kind(leaf) for leaf in leaves.values())
    optimizers, _, _ = optimizer_differences(inventory, inventory, {}, {})
    tally = LeafTally(count["tensors"], count["values"], count["raw"], len(leaves), size)
    files = (FileChange("", "same", size),)
    return Difference(a.root, b.root, False, optimizers, (), (), (), tally, time.monotonic() - started, files)


def diff_listings(a: Listing, b: Listing, *, metadata_only: bool = False) -> Difference:
    """Compare the checkpoints two listings found: everything each holds, ``metadata_only`` without tensor bytes.

    Two file arguments are first compared whole, side by side with reading the first (on a thread: the reads
    release the interpreter); when their bytes are the same, the second is not parsed again."""
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        whole = None
        if a.is_file and b.is_file and not metadata_only:
            # The reading thread waits for the interpreter after every block; parsing holds it meanwhile, for
            # up to a switch interval (5 ms) each time: a shorter one lets the reads go at the disk's speed.
            stack.callback(sys.setswitchinterval, sys.getswitchinterval())
            sys.setswitchinterval(_SWITCH_SECONDS)
            with signals.held():  # the thread inherits the mask: the ending signals reach the main thread alone
                whole = stack.enter_context(ThreadPoolExecutor(1)).submit(same_bytes, a, b)
        read = [read_parsed(a)]
        size = whole.result() if whole is not None else None
        if size is not None:
            a.check_unchanged()
            b.check_unchanged()
            return _same_file(a, b, read[0], size, started)
        read.append(read_parsed(b))
        files = (_Files(a, stack), _Files(b, stack))
        leaves = (side_leaves(a, read[0][1], files[0]), side_leaves(b, read[1][1], files[1]))
        for listing in (a, b):
            listing.check_unchanged()
        sides = _Sides((read[0][0], read[1][0]), leaves, files)
        return compared(sides, metadata_only=metadata_only, paths=(a.root, b.root), started=started)
