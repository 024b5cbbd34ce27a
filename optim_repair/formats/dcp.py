"""torch.distributed.checkpoint (DCP) directories: read their optimizers, write repaired copies, verify them.

A DCP directory holds a pickled ``.metadata`` and ``*.distcp`` shard files. The metadata maps every
flattened state-dict key to a tensor (dtype, global size, the chunks each rank wrote) or to a bytes
entry (a ``torch.save``'d object), says where each chunk or entry lies in which shard, and records in
``planner_data`` the original path of keys behind each flattened key. Torch reads ``.metadata`` with
plain ``pickle.load``; here it is read by an unpickler that admits only the DCP metadata classes and
plain data, so a crafted file is refused before anything in it runs. Reading takes shapes and dtypes
from the metadata alone; of the shards it reads only the small bytes entries of optimizers
(``param_groups`` and non-tensor state), each through the safe torch-pickle reader.

A repair never rewrites a shard: the copy keeps every original file, adds one shard holding the new
entries and a new ``.metadata`` describing old and new entries, so stock ``dcp.load`` accepts it.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import shutil
import struct
import zipfile
import zlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, ClassVar, Literal

from optim_repair.errors import InputError, OutputError, RepairRefused, UnsafeInputError, VerificationError
from optim_repair.formats.encode import tensor_bytes
from optim_repair.formats.pickled import PickleGraph, load_graph, option_value, state_value, tensor_meta
from optim_repair.fresh import FreshTensor
from optim_repair.inventory import (
    ELEMENT_SIZES,
    FileInventory,
    OptimizerInventory,
    ParamGroup,
    ParamKey,
    StateEntry,
    StateValue,
    TensorMeta,
    WeightMap,
    contiguous_strides,
)
from optim_repair.repair import AddedValue, Addition
from optim_repair.verify import Verification

METADATA_FILE = ".metadata"
SHARD_SUFFIX = ".distcp"
MODEL_KEY = "model"
"""The top-level key under which trainers (UniRL, torchtitan) save the model's weights."""

Layout = Literal["nested", "flattened"]
KeyPath = tuple[ParamKey, ...]
StorageIndex = tuple[str, tuple[int, ...] | None]
"""A storage entry's identity, as DCP's ``MetadataIndex``: the key, and a tensor chunk's offsets."""

_SECTIONS = ("state", "param_groups")
_COMPARE_BLOCK = 16 << 20
_MAX_PICKLE_BYTES = 256 << 20
"""The most a bytes entry's pickle may unpack to: a guard against compressed zip bombs."""


# --- What a .metadata says ------------------------------------------------------------------------


@dataclass(frozen=True)
class DcpChunk:
    """One rank's piece of a tensor: where it starts in the global tensor, and its size."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class DcpTensor:
    """A tensor entry: dtype, global size, and the chunks it was saved in."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]

    def meta(self, key: str) -> TensorMeta:
        """The entry as the inventory describes a tensor: contiguous, its storage named by its key."""
        stride = contiguous_strides(self.size)
        numel = 1
        for size in self.size:
            numel *= size
        return TensorMeta(
            dtype=self.dtype,
            shape=self.size,
            stride=stride,
            storage=key,
            storage_offset=0,
            storage_nbytes=numel * ELEMENT_SIZES.get(self.dtype, 1),
        )


@dataclass(frozen=True)
class DcpBytes:
    """A bytes entry: a ``torch.save``'d object (hyperparameters, ``params`` lists, non-tensor state)."""


DcpItem = DcpTensor | DcpBytes


@dataclass(frozen=True)
class DcpStorage:
    """Where one chunk or bytes entry lies: a shard file, a byte range, and the stream transforms on it."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcpMetadata:
    """A checkpoint's ``.metadata``, read without torch."""

    items: Mapping[str, DcpItem]
    planner_data: Mapping[str, KeyPath]
    """Each key's original path of keys (``("optim", "state", "blocks.0.w", "exp_avg")``)."""
    storage: Mapping[StorageIndex, DcpStorage]

    def path_of(self, key: str) -> KeyPath:
        return self.planner_data.get(key, (key,))


# --- The restricted unpickler ---------------------------------------------------------------------


class _Record:
    """An object of an allowlisted DCP class, standing in for it: the state its pickle gave it."""

    kind: ClassVar[str] = ""
    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _record_class(kind: str) -> type[_Record]:
    return type(kind, (_Record,), {"kind": kind})


@dataclass(frozen=True)
class _DType:
    name: str


def _size(*args: Any) -> tuple[int, ...]:
    sizes = args[0] if args else ()
    return _ints(sizes, "a torch.Size")


def _layout(name: Any) -> str:
    if not isinstance(name, str):
        raise InputError(f"a layout is named by {name!r}")
    return name


def _enum_value(value: Any) -> int:
    if not isinstance(value, int):
        raise InputError(f"a memory-format code is {value!r}")
    return value


def _path(*parts: Any) -> str:
    return str(PurePosixPath(*(str(part) for part in parts)))


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
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    **{("pathlib", name): _path for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
}
"""Every global a DCP ``.metadata`` may name (besides ``torch.<dtype>``), with what stands in for it."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the DCP metadata classes and plain data only; ``real`` loads the real torch classes."""

    def __init__(self, file: BinaryIO, source: str, *, real: bool) -> None:
        super().__init__(file)
        self._source = source
        self._real = real

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and name in ELEMENT_SIZES
        if (module, name) not in _STANDINS and not is_dtype:
            raise UnsafeInputError(
                f"{self._source}: refuses to load global {module}.{name} "
                "(a DCP .metadata names only torch.distributed.checkpoint metadata classes); nothing was run"
            )
        if self._real:
            return getattr(importlib.import_module(module), name)
        return _DType(name) if is_dtype else _STANDINS[(module, name)]


_UNPICKLING_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    ImportError,
    UnicodeDecodeError,
    struct.error,
    MemoryError,
    RecursionError,
)


def _unpickle_metadata(path: Path, source: str, *, real: bool) -> Any:
    try:
        with path.open("rb") as stream:
            return _MetadataUnpickler(stream, source, real=real).load()
    except OSError as exc:
        raise InputError(f"{source}: cannot read ({exc.strerror or exc})") from None
    except InputError:
        raise
    except _UNPICKLING_ERRORS as exc:
        raise InputError(f"{source}: not a readable DCP metadata pickle ({type(exc).__name__}: {exc})") from None


# --- From stand-ins to DcpMetadata ----------------------------------------------------------------


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InputError(f"{what} is {value!r}, not a tuple of integers")
    return tuple(value)


def _fields(value: Any, kind: str, source: str) -> dict[str, Any]:
    if not (isinstance(value, _Record) and value.kind == kind):
        raise InputError(f"{source}: expected a {kind}, found {type(value).__name__}")
    if value.state is None:
        return {}
    if not isinstance(value.state, dict):
        raise InputError(f"{source}: a {kind} holds {type(value.state).__name__}, not its fields")
    return value.state


def _tensor_item(value: Any, key: str, source: str) -> DcpTensor:
    fields = _fields(value, "TensorStorageMetadata", source)
    properties = fields.get("properties")
    if not (isinstance(properties, _Record) and properties.kind == "TensorProperties"):
        raise InputError(f"{source}: {key} has no tensor properties")
    state = properties.state
    dtype = state[0] if isinstance(state, tuple) and state else state.get("dtype") if isinstance(state, dict) else None
    if not isinstance(dtype, _DType):
        raise InputError(f"{source}: {key} names no dtype")
    chunks = fields.get("chunks")
    if not isinstance(chunks, list):
        raise InputError(f"{source}: {key} lists no chunks")
    parsed = []
    for chunk in chunks:
        chunk_fields = _fields(chunk, "ChunkStorageMetadata", source)
        parsed.append(
            DcpChunk(
                _ints(chunk_fields.get("offsets"), f"{source}: a chunk offset of {key}"),
                _ints(chunk_fields.get("sizes"), f"{source}: a chunk size of {key}"),
            )
        )
    return DcpTensor(dtype.name, _ints(fields.get("size"), f"{source}: the size of {key}"), tuple(parsed))


def _relative_path(value: Any, source: str) -> str:
    if not isinstance(value, str) or not value:
        raise InputError(f"{source}: a storage entry names the file {value!r}")
    pure = PurePosixPath(value)
    if pure.is_absolute() or ".." in pure.parts or "\\" in value:
        raise InputError(f"{source}: a storage entry points outside the checkpoint directory ({value!r})")
    return value


def _storage(key_record: Any, info_record: Any, source: str, checked: set[str]) -> tuple[StorageIndex, DcpStorage]:
    index = _fields(key_record, "MetadataIndex", source)
    fqn = index.get("fqn")
    if not isinstance(fqn, str):
        raise InputError(f"{source}: a storage entry has the key {fqn!r}")
    offset = index.get("offset")
    offsets = None if offset is None else _ints(offset, f"{source}: the chunk offset of {fqn}")
    info = _fields(info_record, "_StorageInfo", source)
    start, length = info.get("offset"), info.get("length")
    if not (isinstance(start, int) and isinstance(length, int) and start >= 0 and length >= 0):
        raise InputError(f"{source}: {fqn} has the byte range {start!r}+{length!r}")
    transforms = info.get("transform_descriptors") or ()
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise InputError(f"{source}: {fqn} has the stream transforms {transforms!r}")
    relative = info.get("relative_path")
    if not (isinstance(relative, str) and relative in checked):
        relative = _relative_path(relative, source)
        checked.add(relative)
    return (fqn, offsets), DcpStorage(relative, start, length, tuple(transforms))


def _parse_metadata(root: Any, source: str) -> DcpMetadata:
    fields = _fields(root, "Metadata", source)
    entries = fields.get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise InputError(f"{source}: holds no state_dict_metadata")
    items: dict[str, DcpItem] = {}
    for key, value in entries.items():
        if not isinstance(key, str):
            raise InputError(f"{source}: has the key {key!r}")
        if isinstance(value, _Record) and value.kind == "BytesStorageMetadata":
            items[key] = DcpBytes()
        else:
            items[key] = _tensor_item(value, key, source)
    planner = fields.get("planner_data")
    if not isinstance(planner, dict):
        raise InputError(
            f"{source}: records no planner_data (the key paths), so parameter names containing dots "
            "cannot be told apart; it was written by a custom planner"
        )
    paths: dict[str, KeyPath] = {}
    for key, path in planner.items():
        if not (
            isinstance(key, str)
            and isinstance(path, (tuple, list))
            and all(isinstance(part, (str, int)) and not isinstance(part, bool) for part in path)
        ):
            raise InputError(f"{source}: planner_data maps {key!r} to {path!r}")
        paths[key] = tuple(path)
    storage_data = fields.get("storage_data")
    if not isinstance(storage_data, dict):
        raise InputError(f"{source}: holds no storage_data")
    checked: set[str] = set()
    storage = dict(_storage(index, info, source, checked) for index, info in storage_data.items())
    for index in storage:
        if index[0] not in items:
            raise InputError(f"{source}: stores {index[0]}, which its state_dict_metadata does not list")
    return DcpMetadata(items, paths, storage)


def is_dcp_directory(path: Path) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (it holds a ``.metadata`` file)."""
    return path.is_dir() and (path / METADATA_FILE).is_file()


def _where(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def read_metadata(path: Path, rel: str = "") -> DcpMetadata:
    """Read the ``.metadata`` of the DCP directory ``path`` safely, without torch."""
    source = _where(rel, METADATA_FILE)
    return _parse_metadata(_unpickle_metadata(path / METADATA_FILE, source, real=False), source)


# --- Finding optimizers among the keys ------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    """One metadata key that belongs to an optimizer's ``state`` or ``param_groups``."""

    key: str
    root: KeyPath
    section: str
    layout: Layout
    rest: KeyPath
    """Nested: the path after the section. Flattened: the path after the flattened element."""
    flat: str = ""
    """Flattened: the flattened element without its section (``blocks.0.w.exp_avg``)."""


def _classify(key: str, path: KeyPath) -> _Slot | None:
    for i, part in enumerate(path):
        if part in _SECTIONS and len(path) - i >= 3:
            return _Slot(key, path[:i], str(part), "nested", path[i + 1 :])
        if isinstance(part, str):
            for section in _SECTIONS:
                if part.startswith(f"{section}.") and len(part) > len(section) + 1:
                    return _Slot(key, path[:i], section, "flattened", path[i + 1 :], part[len(section) + 1 :])
    return None


def _joined(parts: Sequence[ParamKey]) -> str:
    return ".".join(str(part) for part in parts)


@dataclass(frozen=True)
class _Optimizer:
    root: KeyPath
    layout: Layout
    slots: tuple[_Slot, ...]

    @property
    def location(self) -> str:
        return _joined(self.root)


def _optimizers(meta: DcpMetadata, source: str) -> list[_Optimizer]:
    by_root: dict[KeyPath, list[_Slot]] = {}
    for key in meta.items:
        slot = _classify(key, meta.path_of(key))
        if slot is not None:
            by_root.setdefault(slot.root, []).append(slot)
    found = []
    for root, slots in by_root.items():
        if not any(slot.section == "param_groups" for slot in slots):
            continue
        layouts = {slot.layout for slot in slots}
        if len(layouts) > 1:
            raise InputError(f"{source}: the optimizer at {_joined(root)} mixes nested and flattened keys")
        found.append(_Optimizer(root, layouts.pop(), tuple(slots)))
    return found


def _weights(meta: DcpMetadata) -> list[tuple[str, TensorMeta]]:
    found = []
    for key, item in meta.items.items():
        path = meta.path_of(key)
        if isinstance(item, DcpTensor) and len(path) == 2 and path[0] == MODEL_KEY and isinstance(path[1], str):
            found.append((path[1], item.meta(key)))
    return found


# --- Reading bytes entries ------------------------------------------------------------------------


def _zstd_decompress(data: bytes, source: str) -> bytes:
    for module_name in ("compression.zstd", "zstandard"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            if module_name == "compression.zstd":
                return bytes(module.decompress(data))
            return bytes(module.ZstdDecompressor().stream_reader(io.BytesIO(data)).read())
        except Exception as exc:  # each zstd module raises its own error class
            raise InputError(f"{source}: corrupt zstd stream ({exc})") from None
    raise InputError(
        f"{source}: is zstd-compressed (stream.zstd/1); install the 'zstandard' package "
        "(or use Python 3.14+) to read it"
    )


def _untransform(data: bytes, transforms: tuple[str, ...], source: str) -> bytes:
    """Undo DCP's stream transforms, in the order torch's reader applies them."""
    for descriptor in transforms:
        name, _, version = descriptor.partition("/")
        if name != "stream.zstd" or version.partition(".")[0] != "1":
            raise InputError(f"{source}: unknown stream transform {descriptor!r}")
        data = _zstd_decompress(data, source)
    return data


@dataclass
class _Saved:
    """A ``torch.save``'d object read from a byte range: its pickle graph and its archive."""

    graph: PickleGraph
    archive: zipfile.ZipFile
    prefix: str


_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, RuntimeError, zlib.error)
"""What ``zipfile`` raises on a damaged, encrypted or oddly compressed archive."""


def _saved_object(data: bytes, source: str) -> _Saved:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise InputError(f"{source}: not a torch.save archive (no single data.pkl)")
        if archive.getinfo(pickles[0]).file_size > _MAX_PICKLE_BYTES:
            raise InputError(f"{source}: its pickle claims more than {_MAX_PICKLE_BYTES} bytes")
        pickle_bytes = archive.read(pickles[0])
    except _ZIP_ERRORS as exc:
        raise InputError(f"{source}: not a torch.save archive ({exc})") from None
    return _Saved(load_graph(pickle_bytes, source), archive, pickles[0][: -len("data.pkl")])


def _read_ranges(directory: Path, wanted: Mapping[str, DcpStorage], display: str) -> Iterator[tuple[str, bytes]]:
    """The bytes of each wanted entry, reading each file once, in offset order."""
    by_file: dict[str, list[tuple[str, DcpStorage]]] = {}
    for key, info in wanted.items():
        by_file.setdefault(info.relative_path, []).append((key, info))
    for relative, reads in by_file.items():
        try:
            with (directory / relative).open("rb") as stream:
                for key, info in sorted(reads, key=lambda read: read[1].offset):
                    stream.seek(info.offset)
                    data = stream.read(info.length)
                    if len(data) != info.length:
                        raise InputError(f"{_where(display, relative)}: truncated; {key} lies past its end")
                    yield key, data
        except OSError as exc:
            raise InputError(f"{_where(display, relative)}: cannot read ({exc.strerror or exc})") from None


def _bytes_storage(meta: DcpMetadata, key: str, source: str) -> DcpStorage:
    info = meta.storage.get((key, None))
    if info is None:
        raise InputError(f"{source}: {key} is listed but stored nowhere")
    return info


def _read_bytes_entries(directory: Path, meta: DcpMetadata, keys: Sequence[str], rel: str) -> dict[str, Any]:
    """The objects ``torch.save``'d in the bytes entries ``keys``, unpickled safely.

    Entries with the same bytes (the flattened layout repeats each option for every parameter)
    are unpickled once.
    """
    source = _where(rel, METADATA_FILE)
    wanted = {key: _bytes_storage(meta, key, source) for key in keys}
    values = {}
    unpickled: dict[tuple[bytes, tuple[str, ...]], Any] = {}
    for key, data in _read_ranges(directory, wanted, rel):
        info = wanted[key]
        if (data, info.transforms) not in unpickled:
            where = f"{_where(rel, info.relative_path)}:{key}"
            unpickled[data, info.transforms] = _saved_object(
                _untransform(data, info.transforms, where), where
            ).graph.root
        values[key] = unpickled[data, info.transforms]
    return values


# --- Building inventories -------------------------------------------------------------------------


def _slot_value(meta: DcpMetadata, key: str, values: Mapping[str, Any]) -> StateValue:
    item = meta.items[key]
    return item.meta(key) if isinstance(item, DcpTensor) else state_value(values[key], tensors=False)


def _option(meta: DcpMetadata, key: str, values: Mapping[str, Any]) -> StateValue | tuple[StateValue, ...]:
    item = meta.items[key]
    return item.meta(key) if isinstance(item, DcpTensor) else option_value(values[key], tensors=False)


def _entries(
    meta: DcpMetadata, state: Sequence[tuple[ParamKey, str, str]], values: Mapping[str, Any]
) -> tuple[StateEntry, ...]:
    by_param: dict[ParamKey, list[tuple[str, StateValue]]] = {}
    for param, state_key, key in state:
        by_param.setdefault(param, []).append((state_key, _slot_value(meta, key, values)))
    return tuple(StateEntry(param, tuple(items)) for param, items in by_param.items())


def _nested(
    optimizer: _Optimizer, meta: DcpMetadata, values: Mapping[str, Any], source: str
) -> tuple[tuple[ParamGroup, ...], tuple[StateEntry, ...]]:
    params: dict[int, tuple[ParamKey, ...]] = {}
    options: dict[int, list[tuple[str, StateValue | tuple[StateValue, ...]]]] = {}
    state: list[tuple[ParamKey, str, str]] = []
    for slot in optimizer.slots:
        head, tail = slot.rest[0], _joined(slot.rest[1:])
        if slot.section == "state":
            state.append((head, tail, slot.key))
            continue
        if not isinstance(head, int):
            raise InputError(f"{source}: {slot.key} is not under a param_groups index")
        options.setdefault(head, [])
        if tail != "params":
            options[head].append((tail, _option(meta, slot.key, values)))
            continue
        names = values.get(slot.key)
        if not isinstance(names, list) or not all(
            isinstance(name, (str, int)) and not isinstance(name, bool) for name in names
        ):
            raise InputError(f"{source}: {slot.key} is not a list of parameter names")
        params[head] = tuple(names)
    missing = sorted(set(options) - set(params))
    if missing:
        raise InputError(f"{source}: {optimizer.location}.param_groups.{missing[0]} has no params list")
    groups = tuple(ParamGroup(params[index], tuple(options[index])) for index in sorted(options))
    return groups, _entries(meta, state, values)


def _longest_name(flat: str, names: Collection[str]) -> str | None:
    """The longest of ``names`` that ``flat`` starts with, followed by a dot."""
    end = len(flat)
    while (end := flat.rfind(".", 0, end)) > 0:
        if flat[:end] in names:
            return flat[:end]
    return None


def _comparable(value: StateValue | tuple[StateValue, ...]) -> object:
    if isinstance(value, TensorMeta):
        return ("tensor", value.dtype, value.shape)
    return value


def _flattened(
    optimizer: _Optimizer, meta: DcpMetadata, values: Mapping[str, Any], known: Collection[str], source: str
) -> tuple[tuple[ParamGroup, ...], tuple[StateEntry, ...]]:
    per_name: dict[str, list[tuple[str, StateValue | tuple[StateValue, ...]]]] = {}
    for slot in optimizer.slots:
        if slot.section != "param_groups":
            continue
        name = _longest_name(slot.flat, known)
        if name is None:
            # Not a model weight's name: an option key is a param-group dict key, which has no dot.
            name = slot.flat.rpartition(".")[0]
        if not name:
            raise InputError(f"{source}: {slot.key} names no parameter")
        option = _joined((slot.flat[len(name) + 1 :], *slot.rest))
        per_name.setdefault(name, []).append((option, _option(meta, slot.key, values)))
    grouped: dict[object, tuple[list[str], list[tuple[str, StateValue | tuple[StateValue, ...]]]]] = {}
    for name, opts in per_name.items():
        signature = tuple((option, _comparable(value)) for option, value in opts)
        grouped.setdefault(signature, ([], opts))[0].append(name)
    groups = tuple(ParamGroup(tuple(names), tuple(opts)) for names, opts in grouped.values())
    state: list[tuple[ParamKey, str, str]] = []
    for slot in optimizer.slots:
        if slot.section != "state":
            continue
        name = _longest_name(slot.flat, per_name.keys())
        if name is None:
            raise InputError(f"{source}: {slot.key} is state of no parameter in the param_groups")
        state.append((name, _joined((slot.flat[len(name) + 1 :], *slot.rest)), slot.key))
    return groups, _entries(meta, state, values)


def read_dcp(path: Path, rel: str) -> FileInventory:
    """The optimizers (and model weights) of the DCP directory ``path``, from its metadata alone.

    ``rel`` is the directory relative to the user's argument ("" when it is the argument). Only the
    optimizers' bytes entries are read from the shards; no tensor bytes, and torch is not imported.
    """
    meta = read_metadata(path, rel)
    source = _where(rel, METADATA_FILE)
    optimizers = _optimizers(meta, source)
    wanted = [
        slot.key for optimizer in optimizers for slot in optimizer.slots if isinstance(meta.items[slot.key], DcpBytes)
    ]
    values = _read_bytes_entries(path, meta, wanted, rel)
    weights = _weights(meta)
    known = [name for name, _ in weights]
    inventories = []
    for optimizer in optimizers:
        if optimizer.layout == "nested":
            groups, entries = _nested(optimizer, meta, values, source)
        else:
            groups, entries = _flattened(optimizer, meta, values, set(known), source)
        params = [param for group in groups for param in group.params]
        key_style: Literal["name", "index"] = (
            "index" if params and all(isinstance(param, int) for param in params) else "name"
        )
        inventories.append(
            OptimizerInventory(
                file=rel,
                location=optimizer.location,
                address=optimizer.root,
                key_style=key_style,
                groups=groups,
                entries=entries,
            )
        )
    weight_maps = (WeightMap(f"{rel or '.'}:{MODEL_KEY}", tuple(weights)),) if weights else ()
    return FileInventory(file=rel, format="dcp", optimizers=tuple(inventories), weights=weight_maps)


# --- Writing a repaired copy ----------------------------------------------------------------------


@dataclass(frozen=True)
class _NewEntry:
    key: str
    path: KeyPath
    value: AddedValue


def _new_entries(meta: DcpMetadata, additions: Sequence[Addition], source: str) -> list[_NewEntry]:
    layouts = {optimizer.root: optimizer.layout for optimizer in _optimizers(meta, source)}
    entries: list[_NewEntry] = []
    taken = set(meta.items)
    for addition in additions:
        layout = layouts.get(addition.address)
        if layout is None:
            raise RepairRefused(f"{source}: holds no optimizer at {addition.location!r}")
        if not addition.state:
            raise RepairRefused(
                f"{source}: cannot add an empty state entry for {addition.param!r}: "
                "DCP stores no empty mappings; use the fresh fill"
            )
        for state_key, value in addition.state:
            key = _joined((*addition.address, "state", addition.param, state_key))
            path: KeyPath = (
                (*addition.address, "state", addition.param, state_key)
                if layout == "nested"
                else (*addition.address, f"state.{addition.param}.{state_key}")
            )
            if key in taken:
                raise RepairRefused(f"{source}: {key} already exists; refusing to overwrite it")
            taken.add(key)
            entries.append(_NewEntry(key, path, value))
    return entries


def _check_empty_destination(src: Path, dest: Path) -> None:
    if not dest.is_dir() or any(dest.iterdir()):
        raise OutputError(f"{dest}: the destination must be an existing empty directory")
    if dest.resolve().is_relative_to(src.resolve()):
        raise OutputError(f"{dest}: the destination lies inside the checkpoint {src}")


def _copy_tree(src: Path, dest: Path, *, link: bool, skip_metadata: bool) -> None:
    """Copy every file of ``src`` into ``dest``; shards hard-linked when ``link``."""

    def copy(source: str, target: str) -> None:
        if link and source.endswith(SHARD_SUFFIX):
            try:
                os.link(source, target)
            except OSError as exc:
                raise OutputError(
                    f"{target}: cannot hard-link {source} ({exc.strerror or exc}); "
                    "write the copy on the same file system, or copy instead of linking"
                ) from None
        else:
            shutil.copy2(source, target)

    def ignore(directory: str, names: list[str]) -> list[str]:
        return [METADATA_FILE] if skip_metadata and directory == os.fspath(src) else []

    try:
        shutil.copytree(src, dest, dirs_exist_ok=True, copy_function=copy, ignore=ignore)
    except shutil.Error as exc:
        raise OutputError(f"{dest}: copying {src} failed ({exc})") from None
    except OSError as exc:
        raise OutputError(f"{dest}: copying {src} failed ({exc.strerror or exc})") from None


def _shard_name(src: Path) -> str:
    number = 0
    while (src / f"__optim_repair_{number}{SHARD_SUFFIX}").exists():
        number += 1
    return f"__optim_repair_{number}{SHARD_SUFFIX}"


def _serialized(value: AddedValue, key: str) -> bytes:
    import torch

    buffer = io.BytesIO()
    if isinstance(value, FreshTensor):
        dtype = getattr(torch, value.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise RepairRefused(f"cannot create {key}: torch has no dtype {value.dtype!r}")
        try:
            tensor = torch.full(value.shape, value.fill, dtype=dtype)
        except (RuntimeError, TypeError) as exc:
            raise RepairRefused(f"cannot create {key} as a {value.dtype} tensor of {value.fill!r} ({exc})") from None
        torch.save(tensor, buffer)
    else:
        torch.save(value, buffer)
    return buffer.getvalue()


def write_dcp(src: Path, additions: Sequence[Addition], dest: Path, *, link: bool) -> None:
    """Write into the empty directory ``dest`` a copy of the DCP directory ``src`` with ``additions``.

    Every file of ``src`` is copied byte-identical (shards hard-linked when ``link``); the new entries
    go into one new shard, and a new ``.metadata`` lists old and new entries. The original metadata
    is checked by the safe reader before torch unpickles it, with the same allowlist, into the real
    DCP classes that stock ``dcp.load`` expects.
    """
    source = _where(str(src), METADATA_FILE)
    meta = read_metadata(src, str(src))
    entries = _new_entries(meta, additions, source)
    _check_empty_destination(src, dest)
    _copy_tree(src, dest, link=link, skip_metadata=bool(entries))
    if not entries:
        return

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    metadata = _unpickle_metadata(src / METADATA_FILE, source, real=True)
    if not isinstance(metadata, Metadata) or metadata.planner_data is None or metadata.storage_data is None:
        raise InputError(f"{source}: not a DCP Metadata with planner and storage data")
    shard = _shard_name(src)
    try:
        with (dest / shard).open("wb") as stream:
            for entry in entries:
                data = _serialized(entry.value, entry.key)
                info = _StorageInfo(shard, stream.tell(), len(data))
                stream.write(data)
                if isinstance(entry.value, FreshTensor):
                    zeros = [0] * len(entry.value.shape)
                    metadata.state_dict_metadata[entry.key] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=getattr(torch, entry.value.dtype)),
                        size=torch.Size(entry.value.shape),
                        chunks=[ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=torch.Size(entry.value.shape))],
                    )
                    metadata.storage_data[MetadataIndex(entry.key, zeros, 0)] = info
                else:
                    metadata.state_dict_metadata[entry.key] = BytesStorageMetadata()
                    metadata.storage_data[MetadataIndex(entry.key)] = info
                metadata.planner_data[entry.key] = entry.path
        with (dest / METADATA_FILE).open("wb") as stream:
            pickle.dump(metadata, stream)
    except OSError as exc:
        raise OutputError(f"{dest}: cannot write ({exc.strerror or exc})") from None


# --- Verifying a written copy ---------------------------------------------------------------------


def _same_bytes(first: BinaryIO, second: BinaryIO, length: int) -> bool:
    left = length
    while left > 0:
        block = min(left, _COMPARE_BLOCK)
        if first.read(block) != second.read(block):
            return False
        left -= block
    return True


def _same_range(src: Path, dest: Path, original: DcpStorage, copy: DcpStorage) -> bool:
    source, target = src / original.relative_path, dest / copy.relative_path
    if original.length != copy.length:
        return False
    if original.offset == copy.offset and os.path.samefile(source, target):
        return True
    with source.open("rb") as first, target.open("rb") as second:
        first.seek(original.offset)
        second.seek(copy.offset)
        return _same_bytes(first, second, original.length)


def _same_file(source: Path, target: Path) -> bool:
    if not target.is_file():
        return False
    if os.path.samefile(source, target):
        return True
    size = source.stat().st_size
    if target.stat().st_size != size:
        return False
    with source.open("rb") as first, target.open("rb") as second:
        return _same_bytes(first, second, size)


def _check_addition(dest: Path, copy: DcpMetadata, entry: _NewEntry) -> None:
    item = copy.items.get(entry.key)
    if copy.path_of(entry.key) != entry.path:
        raise VerificationError(f"{dest}: {entry.key} has the key path {copy.path_of(entry.key)}")
    value = entry.value
    index: StorageIndex = (entry.key, tuple(0 for _ in value.shape) if isinstance(value, FreshTensor) else None)
    info = copy.storage.get(index)
    if info is None:
        raise VerificationError(f"{dest}: {entry.key} is stored nowhere")
    where = f"{_where(str(dest), info.relative_path)}:{entry.key}"
    data = dict(_read_ranges(dest, {entry.key: info}, str(dest)))[entry.key]
    saved = _saved_object(_untransform(data, info.transforms, where), where)
    if isinstance(value, FreshTensor):
        meta = tensor_meta(saved.graph.root)
        expected = DcpTensor(value.dtype, value.shape, (DcpChunk(index[1] or (), value.shape),))
        if item != expected or meta is None or (meta.dtype, meta.shape) != (value.dtype, value.shape):
            raise VerificationError(f"{dest}: {entry.key} is not a {value.dtype} tensor of shape {value.shape}")
        storage = saved.graph.storages[meta.storage]
        if saved.archive.read(f"{saved.prefix}data/{storage.key}") != tensor_bytes(value):
            raise VerificationError(f"{dest}: {entry.key} does not hold {value.fill!r} everywhere")
    elif item != DcpBytes() or type(saved.graph.root) is not type(value) or saved.graph.root != value:
        raise VerificationError(f"{dest}: {entry.key} does not hold {value!r}")


def verify_dcp(src: Path, dest: Path, additions: Sequence[Addition]) -> Verification:
    """Prove, through ``dest``'s own new metadata, that every original entry's bytes are unchanged,
    every other file is identical and the additions are present; raise ``VerificationError`` if not.

    Counts the original tensor entries and the bytes of every original entry compared.
    """
    original = read_metadata(src, str(src))
    entries = _new_entries(original, additions, _where(str(src), METADATA_FILE))
    try:
        return _verify(src, dest, original, entries)
    except (InputError, OSError) as exc:
        raise VerificationError(f"{dest}: the copy cannot be read back ({exc})") from None


def _verify(src: Path, dest: Path, original: DcpMetadata, entries: Sequence[_NewEntry]) -> Verification:
    copy = read_metadata(dest, str(dest))
    expected = set(original.items) | {entry.key for entry in entries}
    if set(copy.items) != expected:
        extra, missing = sorted(set(copy.items) - expected), sorted(expected - set(copy.items))
        raise VerificationError(f"{dest}: the copy's keys differ (unexpected {extra[:3]}, missing {missing[:3]})")
    for key, item in original.items.items():
        if copy.items[key] != item or copy.path_of(key) != original.path_of(key):
            raise VerificationError(f"{dest}: the metadata of {key} changed")
    compared = 0
    for index, info in original.storage.items():
        copied = copy.storage.get(index)
        if copied is None or copied.transforms != info.transforms or not _same_range(src, dest, info, copied):
            raise VerificationError(f"{dest}: the bytes of {index[0]} differ from the original's")
        compared += info.length
    shards = {info.relative_path for info in original.storage.values()}
    for source in sorted(src.rglob("*")):
        relative = source.relative_to(src).as_posix()
        if not source.is_file() or relative == METADATA_FILE:
            continue
        target = dest / relative
        if relative in shards:
            if not target.is_file() or target.stat().st_size != source.stat().st_size:
                raise VerificationError(f"{target}: the shard's size differs from the original's")
        elif not _same_file(source, target):
            raise VerificationError(f"{target}: differs from {source}")
    for entry in entries:
        _check_addition(dest, copy, entry)
    tensors = sum(isinstance(item, DcpTensor) for item in original.items.values())
    return Verification(tensors=tensors, bytes=compared)
