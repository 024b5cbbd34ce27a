"""Reading a DCP ``.metadata`` safely, without torch: an allowlisting unpickler, then a parse into ``DcpMetadata``.

Torch reads ``.metadata`` with plain ``pickle.load``; here it is read by an unpickler that admits
only the DCP metadata classes and plain data, so a crafted file is refused before anything in it runs.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, ClassVar, cast

from optim_repair.errors import InputError, UnsafeInputError, os_error_reason, shown
from optim_repair.formats.dcp.metadata import (
    METADATA_FILE,
    DcpBytes,
    DcpChunk,
    DcpItem,
    DcpMetadata,
    DcpStorage,
    DcpTensor,
    KeyPath,
    MetadataPickle,
    StorageIndex,
    check_stored,
    display_path,
)
from optim_repair.formats.dcp.metadata_records import MODULE as SUMMARY_MODULE
from optim_repair.formats.dcp.metadata_records import (
    ChunkRun,
    NotSummarized,
    ShardEnds,
    StorageRun,
    Summary,
    path_fault,
)
from optim_repair.formats.dcp.metadata_summary import summarize
from optim_repair.formats.pickle_limits import check_pickle
from optim_repair.formats.unpickling import AllowlistUnpickler, collection_paused
from optim_repair.records.dtypes import DTYPES, itemsize, numel
from optim_repair.storage.answers import CHANGED
from optim_repair.storage.disk import ReadAhead, check_same, open_regular, read_whole, status_of


class MetadataRecord:
    """An object of an allowlisted DCP class, standing in for it: the state its pickle gave it."""

    kind: ClassVar[str] = ""
    state: Any = None

    def __hash__(self) -> int:  # as torch's dataclasses: unhashable but the frozen MetadataIndex, by its fields
        if self.kind != "MetadataIndex":
            raise TypeError(f"unhashable type: '{self.kind}'")
        state = self.state if isinstance(self.state, dict) else {}
        return hash((state.get("fqn"), state.get("offset"), state.get("index")))

    def __setstate__(self, state: Any) -> None:
        # As pickle's BUILD treats an object without __setstate__: a dict state updates the one it has.
        if isinstance(state, dict) and isinstance(self.state, dict):
            self.state = {**self.state, **state}
        else:
            self.state = state


def _record_class(kind: str) -> type[MetadataRecord]:
    return type(kind, (MetadataRecord,), {"kind": kind})


@dataclass(frozen=True)
class _DType:
    name: str


def _torch_size(*args: Any) -> tuple[int, ...]:
    sizes = args[0] if args else ()
    return int_tuple(sizes, "a torch.Size")


def _layout(name: Any) -> str:
    if not isinstance(name, str):
        raise InputError(f"a layout is named by {shown(name)}")
    return name


@dataclass(frozen=True)
class _MemoryFormat:
    """What ``_MEM_FORMAT_ENCODING(code)`` gives: one of torch's three memory-format codes."""

    code: int


def _enum_value(value: Any) -> _MemoryFormat:
    if isinstance(value, bool) or value not in (0, 1, 2):
        raise InputError(f"a memory-format code is {shown(value)}; torch knows 0, 1 and 2")
    return _MemoryFormat(value)


def _pure_path(*parts: Any) -> str:
    return str(PurePosixPath(*(str(part) for part in parts)))


_INT = {int}
_CHECKPOINT = "torch.distributed.checkpoint.metadata"
_SHARDED = "torch.distributed._shard.sharded_tensor.metadata"
_STANDINS: dict[tuple[str, str], Any] = {
    **{
        (_CHECKPOINT, kind): _record_class(kind)
        for kind in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        )
    },
    (_SHARDED, "TensorProperties"): _record_class("TensorProperties"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _record_class("_StorageInfo"),
    (_CHECKPOINT, "_MEM_FORMAT_ENCODING"): _enum_value,
    (_SHARDED, "MEM_FORMAT_ENCODING"): _enum_value,
    ("torch", "Size"): _torch_size,
    ("torch.serialization", "_get_layout"): _layout,
    **{
        ("pathlib", name): _pure_path
        for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    },
}
"""Every global a DCP ``.metadata`` may name (besides ``torch.<dtype>``), with what stands in for it."""


def _allowlist(module: str, name: str) -> Any:
    """Admits the DCP metadata classes and plain data only, each as its stand-in."""
    is_dtype = module == "torch" and name in DTYPES
    if (module, name) not in _STANDINS and not is_dtype:
        raise UnsafeInputError(
            f"refuses to load global {module}.{name} "
            "(a DCP .metadata names only torch.distributed.checkpoint metadata classes); nothing was run"
        )
    return _DType(name) if is_dtype else _STANDINS[(module, name)]


def unpickler(data: bytes, source: str, summary: Summary | None = None) -> AllowlistUnpickler:
    """An unpickler of a ``.metadata`` pickle that admits stand-ins for the DCP classes only (and, in what
    remains of a ``summary``, its stand-ins for the runs it summarized)."""
    if summary is None:
        return AllowlistUnpickler(io.BytesIO(data), source, _allowlist)

    def allowlist(module: str, name: str) -> Any:
        return summary.stand_in if (module, name) == (SUMMARY_MODULE, summary.name) else _allowlist(module, name)

    return AllowlistUnpickler(io.BytesIO(data), source, allowlist)


def int_tuple(value: Any, what: str, source: str | None = None) -> tuple[int, ...]:
    if type(value) is tuple and set(map(type, value)) <= _INT:  # the common case, at C speed: a million a second
        return value
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InputError(f"{what} is {shown(value)}, not a tuple of integers", path=source)
    return tuple(value)


def _record_fields(value: Any, kind: str, source: str) -> dict[str, Any]:
    if not (isinstance(value, MetadataRecord) and value.kind == kind):
        raise InputError(f"expected a {kind}, found {type(value).__name__}", path=source)
    if value.state is None:
        return {}
    if not isinstance(value.state, dict):
        raise InputError(f"a {kind} holds {type(value.state).__name__}, not its fields", path=source)
    return value.state


def _tensor_item(value: Any, key: str, source: str, view: bool) -> tuple[DcpTensor, int, int]:
    """The tensor entry, how many fields its ``TensorProperties`` pickled, and how many of its chunks were
    summarized (``view``: one rank's own metadata, whose chunks are that rank's alone)."""
    fields = _record_fields(value, "TensorStorageMetadata", source)
    properties = fields.get("properties")
    if not (isinstance(properties, MetadataRecord) and properties.kind == "TensorProperties"):
        raise InputError(f"{key} has no tensor properties", path=source)
    state = properties.state
    # As torch's TensorProperties.__setstate__ takes it: (dtype, layout, requires_grad, memory format, pin_memory),
    # and from torch 2.15 on the saved tensor's strides (or None) after them.
    if not (isinstance(state, tuple) and len(state) in (5, 6) and isinstance(state[3], _MemoryFormat)):
        raise InputError(f"{key} has tensor properties {shown(state)}, not what torch writes", path=source)
    dtype = state[0]
    if not isinstance(dtype, _DType):
        raise InputError(f"{key} names no dtype", path=source)
    size = int_tuple(fields.get("size"), f"the size of {key}", source)
    if any(dimension < 0 for dimension in size):
        raise InputError(f"{key} has the size {shown(size)}", path=source)
    strides = None if len(state) == 5 or state[5] is None else int_tuple(state[5], f"the strides of {key}", source)
    if strides is not None and (len(strides) != len(size) or any(stride < 0 for stride in strides)):
        raise InputError(f"{key} of size {shown(size)} has the strides {shown(strides)}", path=source)
    chunks = fields.get("chunks")
    if not isinstance(chunks, list):
        raise InputError(f"{key} lists no chunks", path=source)
    parsed, held, summarized = [], 0, 0
    for chunk in chunks:
        if isinstance(chunk, ChunkRun):  # chunks summarized as they were read (read_summary)
            if chunk.outside(size):
                raise InputError(f"a summarized chunk of {key} lies outside it", path=source)
            held += chunk.held
            summarized += chunk.count
            continue
        chunk_fields = _record_fields(chunk, "ChunkStorageMetadata", source)
        offsets = int_tuple(chunk_fields.get("offsets"), f"a chunk offset of {key}", source)
        sizes = int_tuple(chunk_fields.get("sizes"), f"a chunk size of {key}", source)
        inside = len(offsets) == len(sizes) == len(size) and all(
            start >= 0 and length >= 0 and start + length <= whole
            for start, length, whole in zip(offsets, sizes, size, strict=True)
        )
        if not inside:
            raise InputError(f"a chunk of {key} lies outside it ({shown(offsets)} + {shown(sizes)})", path=source)
        parsed.append(DcpChunk(offsets, sizes))
        held += numel(sizes)
    # What is sized by the tensor's size (a fresh fill) must be backed by chunks that hold as much.
    whole = numel(size)
    if held < whole and not view:
        raise InputError(f"the chunks of {key} hold {held} of its {whole} elements", path=source)
    return DcpTensor(dtype.name, size, tuple(parsed), strides), len(state), summarized


def _relative_path(value: Any, source: str) -> str:
    fault = path_fault(value)
    if fault is not None:
        raise InputError(fault, path=source)
    return str(value)


def _storage_entry(
    key_record: Any, info_record: Any, source: str, checked: set[str]
) -> tuple[StorageIndex, DcpStorage]:
    index = _record_fields(key_record, "MetadataIndex", source)
    fqn = index.get("fqn")
    if not isinstance(fqn, str):
        raise InputError(f"a storage entry has the key {shown(fqn)}", path=source)
    offset = index.get("offset")
    offsets = None if offset is None else int_tuple(offset, f"the chunk offset of {fqn}", source)
    info = _record_fields(info_record, "_StorageInfo", source)
    start, length = info.get("offset"), info.get("length")
    if not (isinstance(start, int) and isinstance(length, int) and start >= 0 and length >= 0):
        raise InputError(f"{fqn} has the byte range {shown(start)}+{shown(length)}", path=source)
    transforms = info.get("transform_descriptors") or ()
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise InputError(f"{fqn} has the stream transforms {shown(transforms)}", path=source)
    relative = info.get("relative_path")
    if not (isinstance(relative, str) and relative in checked):
        relative = _relative_path(relative, source)
        checked.add(relative)
    return (fqn, offsets), DcpStorage(relative, start, length, tuple(transforms))


def _parse_metadata(root: Any, source: str, view: bool) -> tuple[DcpMetadata, int]:
    """The metadata, and how many fields its ``TensorProperties`` pickle (5 when it has no tensor); ``view``: a
    rank's own (``__<rank>.metadata``), whose tensors hold that rank's chunks alone."""
    fields = _record_fields(root, "Metadata", source)
    entries = fields.get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise InputError("holds no state_dict_metadata", path=source)
    items: dict[str, DcpItem] = {}
    property_fields: dict[int, str] = {}
    summarized = 0
    for key, value in entries.items():
        if not isinstance(key, str):
            raise InputError(f"has the key {shown(key)}", path=source)
        if isinstance(value, MetadataRecord) and value.kind == "BytesStorageMetadata":
            items[key] = DcpBytes()
        else:
            items[key], count, runs_of = _tensor_item(value, key, source, view)
            property_fields.setdefault(count, key)
            summarized += runs_of
    if len(property_fields) > 1:
        raise InputError(
            f"its tensor properties have 5 fields ({shown(property_fields[5])}) and 6 ({shown(property_fields[6])}): "
            "one torch writes all alike",
            path=source,
        )
    planner = fields.get("planner_data")
    if not isinstance(planner, dict):
        raise InputError(
            "records no planner_data (the key paths), so parameter names containing dots "
            "cannot be told apart; it was written by a custom planner",
            path=source,
        )
    paths: dict[str, KeyPath] = {}
    for key, path in planner.items():
        if not (
            isinstance(key, str)
            and isinstance(path, (tuple, list))
            and all(isinstance(part, (str, int)) and not isinstance(part, bool) for part in path)
        ):
            raise InputError(f"planner_data maps {shown(key)} to {shown(path)}", path=source)
        paths[key] = tuple(path)
    storage_data = fields.get("storage_data")
    if not isinstance(storage_data, dict):
        raise InputError("holds no storage_data", path=source)
    checked: set[str] = set()
    runs = [index for index in storage_data if isinstance(index, StorageRun)]
    storage = dict(
        _storage_entry(index, info, source, checked)
        for index, info in storage_data.items()
        if not isinstance(index, StorageRun)
    )
    for key in chain((index[0] for index in storage), (key for run in runs for key in run.keys)):
        if key not in items:
            raise InputError(f"stores {shown(key)}, which its state_dict_metadata does not list", path=source)
    check_stored(items, storage, set(runs), summarized, source)
    for key in _compact(items, storage):
        items[key] = replace(cast(DcpTensor, items[key]), compact=True)
    shards = runs[0].shards if runs else ShardEnds()
    if len(set(runs)) != shards.runs:  # a summarized entry elsewhere than in storage_data: read it whole
        raise InputError("holds storage entries outside its storage_data", path=source)
    return DcpMetadata(items, paths, storage, summarized=shards.ends), next(iter(property_fields), 5)


def parse_tables(tables: dict[str, Any], source: str, view: bool) -> DcpMetadata:
    """What a ``Metadata`` whose fields are ``tables`` holds (the tables an appendix sets, read on their own)."""
    root = _record_class("Metadata")()
    root.state = tables
    return _parse_metadata(root, source, view)[0]


def _compact(items: Mapping[str, DcpItem], storage: Mapping[StorageIndex, DcpStorage]) -> list[str]:
    """The tensors with a chunk stored, without a transform, in fewer bytes than its elements take: what a tensor
    subclass's own encoding saves (torchao's 8-bit state). Their sizes are not bounded by the shards' own, so
    ``DcpTensor.compact`` marks them, and no fresh fill may be sized by them."""
    found = []
    for key, item in items.items():
        if not isinstance(item, DcpTensor) or item.dtype not in DTYPES:
            continue
        for chunk in item.chunks:
            info = storage.get((key, chunk.offsets))
            if info is not None and not info.transforms and info.length < numel(chunk.sizes) * itemsize(item.dtype):
                found.append(key)
                break
    return found


def read_summary(path: Path, rel: str = "", name: str = METADATA_FILE) -> DcpMetadata:
    """The ``.metadata`` of the DCP directory ``path`` as ``read_metadata`` reads it, in memory that does not grow
    with its chunks: the chunks and storage entries of tensors that ``summarize`` summarized are not listed
    (``DcpMetadata.summarized``), so that it serves inspection, not a writer. A pickle it does not follow, or
    one that its summary finds fault with, is read whole, for that read's own answer."""
    source = display_path(rel, name)
    try:
        with open_regular(path / name, source) as stream:
            summary = _summarized(stream, source)
        reading = unpickler(summary.data, source, summary)
        root = reading.load_safely("DCP metadata pickle")
        with collection_paused():
            return _parse_metadata(root, source, name != METADATA_FILE)[0]
    except InputError as exc:
        if exc.reason == CHANGED:
            raise
        return read_metadata(path, rel, name=name)
    except (NotSummarized, OSError, ValueError):
        return read_metadata(path, rel, name=name)


def _summarized(stream: BinaryIO, source: str) -> Summary:
    """The summary of the ``.metadata`` open as ``stream``, read as the walk goes; a file written to or cut short
    meanwhile is ``InputError`` (changed while being read)."""
    opened = status_of(stream)
    if opened[0] == 0:
        raise NotSummarized
    ahead = ReadAhead(stream, opened[0], source)
    with ahead.data:
        summary = summarize(ahead.data, ahead.release, ahead.reach)
    check_same(stream, opened, source)
    return summary


def _bounded(data: bytes, source: str) -> bool:
    """Whether the work of unpickling ``data`` is bounded without the pre-scan of all of it: the summarizing walk
    follows every opcode, refusing those the pre-scan must weigh (memo stores, frames out of place), and what
    remains once the records of fixed shape are summarized passes the pre-scan. Else the pre-scan decides."""
    try:
        check_pickle(io.BytesIO(summarize(data).data), source)
    except (NotSummarized, InputError):
        return False
    return True


def read_metadata(path: Path, rel: str = "", *, ours: bool = False, name: str = METADATA_FILE) -> DcpMetadata:
    """Read the ``.metadata`` of the DCP directory ``path`` safely, without torch (``ours``: one this run
    wrote, read back for verification, which keeps no ``pickle`` to extend; ``name``: a rank's own)."""
    source = display_path(rel, name)
    try:
        with open_regular(path / name, source) as stream:
            data = read_whole(stream, source)
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=source) from exc
    reading = unpickler(data, source)
    root = reading.load_safely("DCP metadata pickle", ours=ours, bounded=not ours and _bounded(data, source))
    with collection_paused():  # a record per chunk: see collection_paused
        meta, property_fields = _parse_metadata(root, source, name != METADATA_FILE)
    return replace(meta, pickle=None if ours else _extensible(data, reading, root, property_fields))


def _extensible(
    data: bytes, reading: AllowlistUnpickler, root: MetadataRecord, property_fields: int
) -> MetadataPickle | None:
    """The pickle and where its memo holds the three tables a repair extends; None when it does not hold
    them all (a pickler other than torch's wrote it)."""
    tables = [id(root.state[name]) for name in ("state_dict_metadata", "planner_data", "storage_data")]
    found: dict[int, int] = {}
    for index, value in reading.memo.copy().items():
        if id(value) in tables:
            found[id(value)] = index
    end = reading.stream_position()
    if len(found) < len(tables) or data[end - 1 : end] != pickle.STOP:
        return None
    described, planner, stored = (found[table] for table in tables)
    return MetadataPickle(data, end, (described, planner, stored), property_fields)
