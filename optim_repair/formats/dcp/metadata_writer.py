"""Writing a DCP ``.metadata`` without torch: the original pickle, extended by opcodes that add entries.

The new file is the original's bytes with its final STOP turned into a MARK, then opcodes that fetch
the original's ``state_dict_metadata``, ``planner_data`` and ``storage_data`` dicts from the
unpickler's memo and add the new entries to them, pickled as torch's own classes pickle themselves,
then POP_MARK and STOP. ``pickle.load`` (what ``dcp.load`` uses) builds the ``Metadata`` torch would
have written; every original byte keeps its meaning, and the MARK keeps the last frame's length right.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Iterable, Sequence

from optim_repair.formats.dcp.layout import NewEntry
from optim_repair.formats.dcp.metadata import MetadataPickle
from optim_repair.repair_plan import FreshTensor

_METADATA = "torch.distributed.checkpoint.metadata"
_BATCH = 1000
"""Items per SETITEMS, as the pickler batches them."""
_CONTIGUOUS = 0
"""``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT``: every fresh tensor is contiguous."""

Field = Callable[[], None] | str | int | None
"""A dataclass field's value: text, an integer, None, or a function that emits it."""


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


def _tensor_metadata(ops: _Ops, value: FreshTensor) -> None:
    ops.new(_METADATA, "TensorStorageMetadata")

    def properties() -> None:
        # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory-format code, pin_memory).
        ops.new(_METADATA, "TensorProperties")
        ops.op(pickle.MARK)
        ops.global_("torch", value.dtype)
        ops.global_("torch.serialization", "_get_layout")
        ops.text("torch.strided")
        ops.op(pickle.TUPLE1 + pickle.REDUCE + pickle.NEWFALSE)
        ops.global_(_METADATA, "_MEM_FORMAT_ENCODING")
        ops.integer(_CONTIGUOUS)
        ops.op(pickle.TUPLE1 + pickle.REDUCE + pickle.NEWFALSE + pickle.TUPLE + pickle.BUILD)

    def chunks() -> None:
        ops.op(pickle.EMPTY_LIST)
        ops.new(_METADATA, "ChunkStorageMetadata")
        zeros = [0] * len(value.shape)
        ops.fields([("offsets", lambda: ops.size(zeros)), ("sizes", lambda: ops.size(value.shape))])
        ops.op(pickle.APPEND)

    ops.fields([("properties", properties), ("size", lambda: ops.size(value.shape)), ("chunks", chunks)])


def _storage_index(ops: _Ops, entry: NewEntry) -> None:
    """The entry's ``MetadataIndex``: a tensor's names its only chunk, at offset zero."""
    ops.new(_METADATA, "MetadataIndex")
    if isinstance(entry.value, FreshTensor):
        zeros = [0] * len(entry.value.shape)
        ops.fields([("fqn", entry.key), ("offset", lambda: ops.size(zeros)), ("index", 0)])
    else:
        ops.fields([("fqn", entry.key), ("offset", None), ("index", None)])


def _batched(ops: _Ops, table: int, entries: Sequence[NewEntry], item: Callable[[NewEntry], None]) -> None:
    """Fetch the memoized dict ``table`` and set one item per entry, ``_BATCH`` per SETITEMS."""
    for start in range(0, len(entries), _BATCH):
        ops.get(table)
        ops.op(pickle.MARK)
        for entry in entries[start : start + _BATCH]:
            item(entry)
        ops.op(pickle.SETITEMS)


def extended_metadata(
    original: MetadataPickle, entries: Sequence[NewEntry], placed: Sequence[tuple[str, int, int]]
) -> bytes:
    """The original ``.metadata`` with ``entries`` added; ``placed`` holds each entry's shard, offset and length."""
    described, planner, stored = original.tables
    ops = _Ops()

    def describe(entry: NewEntry) -> None:
        ops.text(entry.key)
        if isinstance(entry.value, FreshTensor):
            _tensor_metadata(ops, entry.value)
        else:
            ops.new(_METADATA, "BytesStorageMetadata")

    def path(entry: NewEntry) -> None:
        ops.text(entry.key)
        ops.op(pickle.MARK)
        for part in entry.path:
            ops.key_part(part)
        ops.op(pickle.TUPLE)

    where = {entry.key: place for entry, place in zip(entries, placed, strict=True)}

    def storage(entry: NewEntry) -> None:
        _storage_index(ops, entry)
        shard, offset, length = where[entry.key]
        ops.new("torch.distributed.checkpoint.filesystem", "_StorageInfo")
        ops.fields([("relative_path", shard), ("offset", offset), ("length", length)])

    _batched(ops, described, entries, describe)
    _batched(ops, planner, entries, path)
    _batched(ops, stored, entries, storage)
    return original.data[: original.end - 1] + pickle.MARK + bytes(ops.out) + pickle.POP_MARK + pickle.STOP
