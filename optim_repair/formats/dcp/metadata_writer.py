"""Writing a DCP ``.metadata`` without torch: the original pickle, followed by opcodes that change its tables.

The new file is the original's bytes with its final STOP turned into a MARK, then opcodes, then POP_MARK
and STOP; every original byte keeps its meaning, and the MARK keeps the last frame's length right. To add
entries (``extended_metadata``), the opcodes fetch the original's ``state_dict_metadata``,
``planner_data`` and ``storage_data`` dicts from the unpickler's memo and set the new entries in them, as
torch's own classes pickle themselves. To rename or drop entries (``rebuilt_metadata``), which no opcode
can remove from a dict, they build three new tables from memo references to the original's own objects
and give them to the ``Metadata`` by BUILD. ``pickle.load`` (what ``dcp.load`` uses) builds the
``Metadata`` torch would have written.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from itertools import chain
from typing import Any, NamedTuple

from optim_repair.formats.dcp.metadata import MetadataPickle
from optim_repair.formats.dcp.metadata_memo import MemoObjects
from optim_repair.formats.dcp.planning import NewEntry, Rekeyed
from optim_repair.records.dtypes import contiguous_strides
from optim_repair.records.repair_plan import FreshTensor

_METADATA = "torch.distributed.checkpoint.metadata"
_BATCH = 1000
"""Items per SETITEMS, as the pickler batches them."""
_CONTIGUOUS = 0
"""``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT``: every fresh tensor is contiguous."""

Field = Callable[[], None] | str | int | None
"""A dataclass field's value: text, an integer, None, or a function that emits it."""


class Place(NamedTuple):
    """Where an entry's bytes are: its shard, offset and length."""

    shard: str
    offset: int
    length: int


Emit = Callable[[], None]
"""Writes the opcodes of one value."""
Item = tuple[Emit, Emit]
"""One item of a table: what writes its key, and what writes its value."""


class _Ops:
    """Pickle opcodes for the few kinds of value a ``.metadata`` holds, written to a growing buffer."""

    def __init__(self) -> None:
        self.out = bytearray()

    def op(self, code: bytes) -> None:
        self.out += code

    def get(self, index: int) -> None:
        self.out += pickle.BINGET + bytes([index]) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index)

    def text(self, value: str) -> None:
        encoded = value.encode("utf-8", "surrogatepass")
        if len(encoded) < 256:
            self.out += pickle.SHORT_BINUNICODE + bytes([len(encoded)]) + encoded
        else:
            self.out += pickle.BINUNICODE8 + struct.pack("<Q", len(encoded)) + encoded

    def integer(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += pickle.BININT1 + bytes([value])
        elif -(2**31) <= value < 2**31:
            self.out += pickle.BININT + struct.pack("<i", value)
        else:
            encoded = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += pickle.LONG1 + bytes([len(encoded)]) + encoded

    def key_part(self, value: str | int) -> None:
        if isinstance(value, str):
            self.text(value)
        else:
            self.integer(value)

    def global_(self, module: str, name: str) -> None:
        self.out += pickle.GLOBAL + f"{module}\n{name}\n".encode()

    def size(self, dims: Sequence[int]) -> None:
        """``torch.Size(dims)``, as it reduces: ``torch.Size((dims...))``."""
        self.global_("torch", "Size")
        self.op(pickle.MARK)
        for dim in dims:
            self.integer(dim)
        self.op(pickle.TUPLE + pickle.TUPLE1 + pickle.REDUCE)

    def new(self, module: str, name: str) -> None:
        """``cls.__new__(cls)``, as ``copyreg.__reduce_ex__`` pickles a dataclass; its state follows."""
        self.global_(module, name)
        self.op(pickle.EMPTY_TUPLE + pickle.NEWOBJ)

    def fields(self, items: Iterable[tuple[str, Field]]) -> None:
        """A dataclass's state, then BUILD."""
        self.op(pickle.EMPTY_DICT + pickle.MARK)
        for name, value in items:
            self.text(name)
            if value is None:
                self.op(pickle.NONE)
            elif isinstance(value, str):
                self.text(value)
            elif isinstance(value, int):
                self.integer(value)
            else:
                value()
        self.op(pickle.SETITEMS + pickle.BUILD)


def _tensor_metadata(ops: _Ops, value: FreshTensor, property_fields: int) -> None:
    ops.new(_METADATA, "TensorStorageMetadata")

    def properties() -> None:
        # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory-format code, pin_memory), and
        # from torch 2.15 on the tensor's strides: written as many as the original's have, so that the torch
        # that wrote it reads them.
        ops.new(_METADATA, "TensorProperties")
        ops.op(pickle.MARK)
        ops.global_("torch", value.dtype)
        ops.global_("torch.serialization", "_get_layout")
        ops.text("torch.strided")
        ops.op(pickle.TUPLE1 + pickle.REDUCE + pickle.NEWFALSE)
        ops.global_(_METADATA, "_MEM_FORMAT_ENCODING")
        ops.integer(_CONTIGUOUS)
        ops.op(pickle.TUPLE1 + pickle.REDUCE + pickle.NEWFALSE)
        if property_fields == 6:
            ops.op(pickle.MARK)
            for stride in contiguous_strides(value.shape):
                ops.integer(stride)
            ops.op(pickle.TUPLE)
        ops.op(pickle.TUPLE + pickle.BUILD)

    def chunks() -> None:
        ops.op(pickle.EMPTY_LIST)
        ops.new(_METADATA, "ChunkStorageMetadata")
        zeros = [0] * len(value.shape)
        ops.fields([("offsets", lambda: ops.size(zeros)), ("sizes", lambda: ops.size(value.shape))])
        ops.op(pickle.APPEND)

    ops.fields([("properties", properties), ("size", lambda: ops.size(value.shape)), ("chunks", chunks)])


def _storage_index(ops: _Ops, entry: NewEntry) -> None:
    """The entry's ``MetadataIndex``: a tensor's names its only chunk, at offset zero."""
    if isinstance(entry.value, FreshTensor):
        _index(ops, entry.key, [0] * len(entry.value.shape), 0)
    else:
        _index(ops, entry.key, None, None)


class _Batches:
    """Items set on the dict on the stack, ``_BATCH`` per MARK ... SETITEMS, as the pickler batches them."""

    def __init__(self, ops: _Ops) -> None:
        self.ops = ops
        self.count = 0

    def item(self) -> None:
        """Call before the key and value of each item."""
        if self.count % _BATCH == 0:
            if self.count:
                self.ops.op(pickle.SETITEMS)
            self.ops.op(pickle.MARK)
        self.count += 1

    def close(self) -> None:
        if self.count:
            self.ops.op(pickle.SETITEMS)


def _items(ops: _Ops, items: Iterable[Item]) -> None:
    """Set ``items`` in the dict on top of the stack, in batches of ``_BATCH`` as the pickler writes them."""
    batches = _Batches(ops)
    for key, value in items:
        batches.item()
        key()
        value()
    batches.close()


def _new_items(
    ops: _Ops, entries: Sequence[NewEntry], placed: Mapping[str, Place], property_fields: int
) -> tuple[Iterator[Item], Iterator[Item], Iterator[Item]]:
    """The new entries' items of the three tables: descriptions, key paths, and storage."""
    return (
        ((partial(ops.text, e.key), partial(_description, ops, e, property_fields)) for e in entries),
        ((partial(ops.text, e.key), partial(_path, ops, e.path)) for e in entries),
        ((partial(_storage_index, ops, e), partial(_info, ops, placed[e.key])) for e in entries),
    )


def _kept_descriptions(ops: _Ops, objects: MemoObjects, rekeyed: Rekeyed) -> Iterator[Item]:
    """Every kept entry's description, a reference to the original's, under its new key; then the aliases'."""
    for key, memo in objects.items.items():
        new = rekeyed.new_key(key)
        if new is not None:
            yield partial(ops.text, new), partial(ops.get, memo)
    for alias, (source, _) in rekeyed.aliases.items():
        yield partial(ops.text, alias), partial(ops.get, objects.items[source])


def _kept_paths(ops: _Ops, objects: MemoObjects, rekeyed: Rekeyed) -> Iterator[Item]:
    """Every kept entry's key path: the original's, or a renamed entry's new one; then the aliases'."""
    for key, memo in objects.paths.items():
        new = rekeyed.new_key(key)
        if new is not None:
            value = partial(ops.get, memo) if new == key else partial(_path, ops, rekeyed.paths[new])
            yield partial(ops.text, new), value
    for alias, (_, path) in rekeyed.aliases.items():
        yield partial(ops.text, alias), partial(_path, ops, path)


def _kept_storage(ops: _Ops, objects: MemoObjects, rekeyed: Rekeyed, placed: Mapping[str, Place]) -> Iterator[Item]:
    """Every kept entry's ``MetadataIndex`` and ``_StorageInfo``: the original's, a renamed entry's new index,
    or a rewritten ``params`` list's new place; then the aliases', sharing their source's bytes."""
    for stored in objects.storage:
        new = rekeyed.new_key(stored.fqn)
        if new is None:
            continue
        if stored.fqn in rekeyed.params:  # a params list written anew, into the new shard
            yield partial(ops.get, stored.index_memo), partial(_info, ops, placed[stored.fqn])
        elif new != stored.fqn:
            yield partial(_index, ops, new, stored.offsets, stored.chunk_index), partial(ops.get, stored.info_memo)
        else:
            yield partial(ops.get, stored.index_memo), partial(ops.get, stored.info_memo)
    by_key = {stored.fqn: stored for stored in objects.storage}
    for alias, (source, _) in rekeyed.aliases.items():
        stored = by_key[source]
        yield partial(_index, ops, alias, stored.offsets, stored.chunk_index), partial(ops.get, stored.info_memo)


def rebuilt_metadata(
    original: MetadataPickle,
    objects: MemoObjects,
    rekeyed: Rekeyed,
    entries: Sequence[NewEntry],
    placed: Mapping[str, Place],
) -> bytes:
    """The original ``.metadata`` with its three tables rebuilt: every kept entry a reference to the original's
    own object (renamed keys get a new key path and ``MetadataIndex``), dropped entries left out, rewritten
    ``params`` lists and ``entries`` stored where ``placed`` says (shard, offset, length, by key), and the
    ``Metadata`` given the new tables by BUILD."""
    ops = _Ops()
    ops.get(objects.root)
    ops.op(pickle.EMPTY_DICT + pickle.MARK)
    descriptions, paths, storage = _new_items(ops, entries, placed, original.property_fields)
    tables = (
        ("state_dict_metadata", chain(_kept_descriptions(ops, objects, rekeyed), descriptions)),
        ("planner_data", chain(_kept_paths(ops, objects, rekeyed), paths)),
        ("storage_data", chain(_kept_storage(ops, objects, rekeyed, placed), storage)),
    )
    for name, items in tables:
        ops.text(name)
        ops.op(pickle.EMPTY_DICT)
        _items(ops, items)
    ops.op(pickle.SETITEMS + pickle.BUILD)
    return original.data[: original.end - 1] + pickle.MARK + bytes(ops.out) + pickle.POP_MARK + pickle.STOP


def _description(ops: _Ops, entry: NewEntry, property_fields: int) -> None:
    if isinstance(entry.value, FreshTensor):
        _tensor_metadata(ops, entry.value, property_fields)
    else:
        ops.new(_METADATA, "BytesStorageMetadata")


def _path(ops: _Ops, path: Sequence[str | int]) -> None:
    ops.op(pickle.MARK)
    for part in path:
        ops.key_part(part)
    ops.op(pickle.TUPLE)


def _index(ops: _Ops, fqn: str, offsets: Sequence[int] | None, chunk_index: Any) -> None:
    """A ``MetadataIndex`` for the key ``fqn`` (a renamed entry's), with the original's offsets and index."""
    ops.new(_METADATA, "MetadataIndex")
    offset: Field = None if offsets is None else (lambda: ops.size(offsets))
    ops.fields([("fqn", fqn), ("offset", offset), ("index", chunk_index if isinstance(chunk_index, int) else None)])


def _info(ops: _Ops, place: Place) -> None:
    ops.new("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    ops.fields([("relative_path", place.shard), ("offset", place.offset), ("length", place.length)])


def extended_metadata(original: MetadataPickle, entries: Sequence[NewEntry], placed: Mapping[str, Place]) -> bytes:
    """The original ``.metadata`` with ``entries`` added to its tables; ``placed`` holds each entry's shard,
    offset and length, by key."""
    ops = _Ops()
    for table, items in zip(original.tables, _new_items(ops, entries, placed, original.property_fields), strict=True):
        ops.get(table)
        _items(ops, items)
    return original.data[: original.end - 1] + pickle.MARK + bytes(ops.out) + pickle.POP_MARK + pickle.STOP
