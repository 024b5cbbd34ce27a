"""Files written by ``torch.save``: the zip format and the legacy format.

Reading parses only the pickle (and, for the legacy format, the few bytes that say how long each
storage is): cost grows with the number of entries, not with the gigabytes. Writing copies every
storage's bytes as they are and pickles the edited object graph anew; nothing is ever unpickled
unsafely and torch is never imported.
"""

from __future__ import annotations

import math
import pickle
import struct
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Literal

from optim_repair.errors import InputError, NotATorchFile, UnsafeInputError
from optim_repair.formats.encode import decode_element, tensor_bytes
from optim_repair.formats.pickled import (
    PickleGraph,
    Reduced,
    StorageRef,
    dump_graph,
    is_tensor,
    load_graph,
    new_tensor,
    option_value,
    resolve,
    state_value,
    storage_for,
    tensor_meta,
    walk,
)
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
)
from optim_repair.repair import Addition

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
ALIGNMENT = 64
_CHUNK = 1 << 22
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_PADDING_FIELD = b"FB"
ZIP_ERRORS = (zipfile.BadZipFile, EOFError, UnicodeDecodeError, NotImplementedError, zlib.error)
"""What zipfile raises on a damaged archive (NotImplementedError: an unknown compression method)."""
"""What ``zipfile`` raises on a damaged archive (a bad CRC, a mangled header, an unknown method)."""
PHANTOM_PROBE_BYTES = 4096
"""How many leading bytes of a moment inspect reads, only when every ``step`` of an optimizer is 1."""


@dataclass
class TorchFile:
    """A parsed torch file: its object graph and where each storage's bytes lie."""

    path: Path
    kind: Literal["torch-zip", "torch-legacy"]
    graph: PickleGraph
    records: list[zipfile.ZipInfo] = field(default_factory=list)
    prefix: str = ""
    legacy_main_start: int = 0
    legacy_storage_start: int = 0
    legacy_storage_end: int = 0
    legacy_keys: list[str] = field(default_factory=list)

    def storage_range(self, key: str) -> tuple[int, int]:
        """Byte offset and length of a storage's bytes in the file."""
        ref = self.graph.storages[key]
        assert ref.byte_offset is not None
        return ref.byte_offset, ref.nbytes


def is_zip(path: Path) -> bool:
    with path.open("rb") as stream:
        return stream.read(4) == b"PK\x03\x04"


def open_torch_file(path: Path, source: str) -> TorchFile:
    """Parse ``path`` without reading tensor bytes. Raises InputError / UnsafeInputError."""
    try:
        if is_zip(path):
            return _open_zip(path, source)
        return _open_legacy(path, source)
    except OSError as exc:
        raise InputError(f"{source}: cannot read ({exc.strerror or exc})") from None


def _data_offset(stream: BinaryIO, info: zipfile.ZipInfo, source: str) -> int:
    stream.seek(info.header_offset)
    header = stream.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise InputError(f"{source}: damaged zip record {info.filename}")
    fields: tuple[int, ...] = _LOCAL_HEADER.unpack(header)
    return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]


def _open_zip(path: Path, source: str) -> TorchFile:
    try:
        archive = zipfile.ZipFile(path)
    except (*ZIP_ERRORS, zipfile.LargeZipFile, ValueError) as exc:
        raise InputError(f"{source}: damaged zip archive ({exc})") from None
    with archive:
        records = archive.infolist()
        pickles = [info for info in records if info.filename.endswith("/data.pkl")]
        if not pickles:
            raise NotATorchFile(f"{source}: a zip archive without data.pkl is not a torch.save file")
        encrypted = [info.filename for info in records if info.flag_bits & 0x1]
        if encrypted:
            raise InputError(f"{source}: damaged zip archive (record {encrypted[0]} is marked encrypted)")
        prefix = pickles[0].filename[: -len("data.pkl")]
        try:
            data = archive.read(pickles[0])
        except (*ZIP_ERRORS, OSError) as exc:
            raise InputError(f"{source}: damaged zip archive ({exc})") from None
        graph = load_graph(data, source)
        by_name = {info.filename: info for info in records}
        with path.open("rb") as stream:
            for key, ref in graph.storages.items():
                info = by_name.get(f"{prefix}data/{key}")
                if info is None:
                    raise InputError(f"{source}: storage {key} has no record in the archive")
                if info.compress_type != zipfile.ZIP_STORED or info.file_size != ref.nbytes:
                    raise InputError(
                        f"{source}: storage record {info.filename} holds {info.file_size} bytes, "
                        f"expected {ref.nbytes}"
                    )
                ref.byte_offset = _data_offset(stream, info, source)
    return TorchFile(path, "torch-zip", graph, records=records, prefix=prefix)


def _open_legacy(path: Path, source: str) -> TorchFile:
    size = path.stat().st_size
    if size == 0:
        raise InputError(f"{source}: empty file")
    with path.open("rb") as stream:
        try:
            magic = load_graph(stream, source).root
        except UnsafeInputError:
            raise
        except InputError:
            magic = None
        if magic != LEGACY_MAGIC:
            raise NotATorchFile(f"{source}: not a torch file (no zip archive, no legacy magic number)")
        load_graph(stream, source)
        load_graph(stream, source)
        main_start = stream.tell()
        graph = load_graph(stream, source)
        keys = load_graph(stream, source).root
        storage_start = stream.tell()
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise InputError(f"{source}: damaged legacy torch file (bad storage key list)")
        for key in keys:
            ref = graph.storages.get(key)
            header = stream.read(8)
            if ref is None or len(header) != 8:
                raise InputError(f"{source}: damaged legacy torch file (storage {key})")
            numel = struct.unpack("<q", header)[0]
            ref.byte_offset = stream.tell()
            end = ref.byte_offset + ref.nbytes
            if numel != ref.numel or end > size:
                raise InputError(f"{source}: truncated legacy torch file (storage {key})")
            stream.seek(end)
        missing = set(graph.storages) - set(keys)
        if missing:
            raise InputError(f"{source}: damaged legacy torch file (no bytes for storage {min(missing)})")
        return TorchFile(
            path,
            "torch-legacy",
            graph,
            legacy_main_start=main_start,
            legacy_storage_start=storage_start,
            legacy_storage_end=stream.tell(),
            legacy_keys=list(keys),
        )


# ---------------------------------------------------------------- inventory


class _SmallReads:
    """The few bytes inspect reads: one-element tensors, and moment heads for phantom-step."""

    def __init__(self, torch_file: TorchFile, stream: BinaryIO) -> None:
        self._file = torch_file
        self._stream = stream

    def read(self, meta: TensorMeta, limit: int) -> bytes:
        offset, _ = self._file.storage_range(meta.storage)
        self._stream.seek(offset + meta.storage_offset * ELEMENT_SIZES.get(meta.dtype, 1))
        return self._stream.read(min(meta.nbytes, limit))

    def scalar(self, meta: TensorMeta) -> TensorMeta:
        if meta.numel != 1 or meta.nbytes > 16:
            return meta
        return replace(meta, value=decode_element(meta.dtype, self.read(meta, meta.nbytes)))

    def zero_head(self, meta: TensorMeta) -> TensorMeta:
        if meta.numel == 0:
            return replace(meta, zero_head=True)
        return replace(meta, zero_head=not any(self.read(meta, PHANTOM_PROBE_BYTES)))


def _is_optimizer(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    state, groups = node.get("state"), node.get("param_groups")
    return (
        isinstance(state, dict)
        and isinstance(groups, list)
        and all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups)
    )


def describe_address(address: tuple[Any, ...]) -> str:
    """``('optimizer_states', 0)`` -> ``optimizer_states[0]``; the root is ``""``."""
    text = ""
    for step in address:
        if isinstance(step, int) and not isinstance(step, bool):
            text += f"[{step}]"
        else:
            text += f".{step}" if text else str(step)
    return text


def _entry(param: ParamKey, value: Any, reads: _SmallReads) -> StateEntry:
    if not isinstance(value, dict):
        return StateEntry(param, None, "tensor" if is_tensor(value) else type(value).__name__)
    items: list[tuple[str, StateValue]] = []
    for key, item in value.items():
        converted = state_value(item)
        if isinstance(converted, TensorMeta):
            converted = reads.scalar(converted)
        items.append((str(key), converted))
    return StateEntry(param, tuple(items))


def _probe_phantom(entries: list[StateEntry], reads: _SmallReads) -> list[StateEntry]:
    """Probe moment heads, but only when every entry's ``step`` is 1: a phantom-step candidate.

    At most ``PHANTOM_PROBE_BYTES`` of each moment are read, so the cost stays bounded by the
    number of entries, never by the size of the tensors.
    """
    populated = [entry for entry in entries if entry.values]
    steps = [entry.get("step") for entry in populated]
    if not populated or not all(isinstance(step, TensorMeta) and step.value == 1 for step in steps):
        return entries
    probed = []
    for entry in entries:
        values = tuple(
            (key, reads.zero_head(value) if isinstance(value, TensorMeta) and key != "step" else value)
            for key, value in entry.values or ()
        )
        probed.append(replace(entry, values=values) if entry.values else entry)
    return probed


def _optimizer_inventory(
    node: dict[Any, Any], file: str, address: tuple[Any, ...], reads: _SmallReads
) -> OptimizerInventory:
    groups = tuple(
        ParamGroup(
            params=tuple(group["params"]),
            options=tuple((str(k), option_value(v)) for k, v in group.items() if k != "params"),
        )
        for group in node["param_groups"]
    )
    entries = _probe_phantom([_entry(param, value, reads) for param, value in node["state"].items()], reads)
    keys = [param for group in groups for param in group.params] + [entry.param for entry in entries]
    style: Literal["name", "index"] = "name" if any(isinstance(k, str) for k in keys) else "index"
    return OptimizerInventory(
        file=file,
        location=describe_address(address),
        address=address,
        key_style=style,
        groups=groups,
        entries=tuple(entries),
    )


def _weight_map(node: dict[Any, Any], source: str) -> WeightMap | None:
    if not node or not all(isinstance(key, str) for key in node):
        return None
    tensors = []
    for key, value in node.items():
        meta = tensor_meta(value)
        if meta is None:
            return None
        tensors.append((key, meta))
    return WeightMap(source, tuple(tensors))


def find_optimizers(root: Any) -> list[tuple[tuple[Any, ...], dict[Any, Any]]]:
    """Every optimizer state dict in a graph, recognised by structure, outermost only."""
    found: list[tuple[tuple[Any, ...], dict[Any, Any]]] = []
    for address, node in walk(root):
        if any(address[: len(outer)] == outer for outer, _ in found):
            continue
        if _is_optimizer(node):
            found.append((address, node))
    return found


def read_inventory(path: Path, file: str, source: str) -> FileInventory:
    """Everything inspect needs from one torch file, reading no tensor bytes but ``step`` values."""
    torch_file = open_torch_file(path, source)
    found = find_optimizers(torch_file.graph.root)
    with path.open("rb") as stream:
        reads = _SmallReads(torch_file, stream)
        optimizers = tuple(_optimizer_inventory(node, file, address, reads) for address, node in found)
    weights = []
    for address, node in walk(torch_file.graph.root):
        if isinstance(node, dict) and not any(address[: len(outer)] == outer for outer, _ in found):
            weight_map = _weight_map(node, f"{source}:{describe_address(address)}" if address else source)
            if weight_map is not None:
                weights.append(weight_map)
    return FileInventory(file=file, format=torch_file.kind, optimizers=optimizers, weights=tuple(weights))


# ---------------------------------------------------------------- writing


def _sibling_location(state: dict[Any, Any], key: str) -> str:
    """Where the optimizer keeps ``key`` for other parameters (``cuda:0``, or ``cpu`` for a CPU ``step``)."""
    for entry in state.values():
        value = entry.get(key) if isinstance(entry, dict) else None
        if isinstance(value, Reduced) and value.args and isinstance(value.args[0], StorageRef):
            return value.args[0].location
    return "cpu"


def _apply(torch_file: TorchFile, additions: Sequence[Addition]) -> list[tuple[StorageRef, bytes]]:
    """Add the planned entries to the graph; return the new storages and their bytes."""
    legacy = torch_file.kind == "torch-legacy"
    taken = set(torch_file.graph.storages)
    created: list[tuple[StorageRef, bytes]] = []
    for addition in additions:
        state = resolve(torch_file.graph.root, addition.address)["state"]
        entry: dict[str, Any] = {}
        for key, value in addition.state:
            if isinstance(value, FreshTensor):
                location = _sibling_location(state, key)
                storage_key = f"optim-repair-{len(created)}" if legacy else str(len(taken))
                while storage_key in taken:
                    storage_key += "_"
                taken.add(storage_key)
                data = tensor_bytes(value)
                ref = storage_for(storage_key, value.dtype, math.prod(value.shape), legacy=legacy, location=location)
                entry[key] = new_tensor(ref, value.shape)
                created.append((ref, data))
            else:
                entry[key] = value
        state[addition.param] = entry
    return created


def _copy_range(source: BinaryIO, target: BinaryIO, offset: int, length: int) -> None:
    source.seek(offset)
    remaining = length
    while remaining:
        chunk = source.read(min(_CHUNK, remaining))
        if not chunk:
            raise InputError(f"{source.name}: ended while being copied")
        target.write(chunk)
        remaining -= len(chunk)


def _write_record(archive: zipfile.ZipFile, info: zipfile.ZipInfo, size: int, chunks: Iterator[bytes]) -> None:
    """Write one stored record whose data starts on an ``ALIGNMENT`` boundary, as torch does."""
    record = zipfile.ZipInfo(info.filename, date_time=info.date_time)
    record.compress_type = zipfile.ZIP_STORED
    record.external_attr = info.external_attr
    record.file_size = size
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT
    header = _LOCAL_HEADER.size + len(info.filename.encode()) + 4 + (20 if zip64 else 0)
    pad = -(archive.start_dir + header) % ALIGNMENT
    record.extra = _PADDING_FIELD + struct.pack("<H", pad) + b"Z" * pad
    with archive.open(record, "w", force_zip64=zip64) as target:
        for chunk in chunks:
            target.write(chunk)


def _record_chunks(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> Iterator[bytes]:
    with archive.open(info) as source:
        while chunk := source.read(_CHUNK):
            yield chunk


def _write_zip(torch_file: TorchFile, data: bytes, created: list[tuple[StorageRef, bytes]], dest: Path) -> None:
    with zipfile.ZipFile(torch_file.path) as source, zipfile.ZipFile(dest, "w", allowZip64=True) as target:
        last_storage = max(
            (i for i, info in enumerate(torch_file.records) if info.filename.startswith(f"{torch_file.prefix}data/")),
            default=len(torch_file.records) - 1,
        )
        for index, info in enumerate(torch_file.records):
            if info.filename == f"{torch_file.prefix}data.pkl":
                _write_record(target, info, len(data), iter([data]))
            else:
                _write_record(target, info, info.file_size, _record_chunks(source, info))
            if index == last_storage:
                for ref, payload in created:
                    template = zipfile.ZipInfo(f"{torch_file.prefix}data/{ref.key}", date_time=info.date_time)
                    template.external_attr = info.external_attr
                    _write_record(target, template, len(payload), iter([payload]))


def _write_legacy(torch_file: TorchFile, data: bytes, created: list[tuple[StorageRef, bytes]], dest: Path) -> None:
    keys = torch_file.legacy_keys + [ref.key for ref, _ in created]
    with torch_file.path.open("rb") as source, dest.open("wb") as target:
        _copy_range(source, target, 0, torch_file.legacy_main_start)
        target.write(data)
        target.write(pickle.dumps(keys, protocol=2))
        _copy_range(
            source,
            target,
            torch_file.legacy_storage_start,
            torch_file.legacy_storage_end - torch_file.legacy_storage_start,
        )
        for ref, payload in created:
            target.write(struct.pack("<q", ref.numel))
            target.write(payload)


def write_torch_file(src: Path, source: str, additions: Sequence[Addition], dest: Path) -> None:
    """Write ``src`` with ``additions`` applied to ``dest``: every other byte of meaning unchanged."""
    torch_file = open_torch_file(src, source)
    created = _apply(torch_file, additions)
    data = dump_graph(torch_file.graph.root, torch_file.graph.protocol)
    # An OSError (a full disk, ...) is the writer's to report: it names --out, not the temporary file.
    try:
        if torch_file.kind == "torch-zip":
            _write_zip(torch_file, data, created, dest)
        else:
            _write_legacy(torch_file, data, created, dest)
    except ZIP_ERRORS as exc:
        raise InputError(f"{source}: damaged zip archive ({exc})") from None
