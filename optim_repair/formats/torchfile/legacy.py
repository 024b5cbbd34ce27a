"""The legacy format of ``torch.save`` (``_use_new_zipfile_serialization=False``): pickles, then raw storages.

The file is five pickles (magic number, protocol version, system info, the object graph, the list
of storage keys) followed, for each key in that list, by an 8-byte element count and the bytes.

Nothing tells where a pickle ends but its ``STOP``, so each is read through the file up to it, by its opcodes'
lengths (``pickle_reading``), and then checked and unpickled from those bytes: the storages after the
last are never read, and memory grows with the pickles alone (a pickle that never stops is read to the file's
end, which bounds it). The file is never mapped: another process cutting it short meanwhile made a mapped read
end with SIGBUS; read, it is exit 4, "changed while being read", as is a file written to while it was parsed.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar, Literal

from optim_repair.errors import InputError, NotATorchFile, TorchRefuses, UnsafeInputError, shown
from optim_repair.formats.pickle_opcodes import PICKLE, WEIGHTS_ONLY, OpcodeSet
from optim_repair.formats.pickle_reading import read_pickle
from optim_repair.formats.pickled import PickleGraph, load_graph
from optim_repair.storage.answers import CHANGED
from optim_repair.storage.disk import check_same, read_within, status_of

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
"""The one protocol version torch's legacy loader reads (``torch.serialization.PROTOCOL_VERSION``)."""
MAGIC_BYTES = 1 << 12
"""The most the pickle of the magic number may take (torch's takes a dozen bytes): a file whose first pickle does
not end within it is no legacy torch file, and no more of it is read."""


@dataclass(frozen=True)
class LegacyTorchFile:
    """A parsed legacy-format torch file: its object graph and where each storage's bytes lie."""

    kind: ClassVar[Literal["torch-legacy"]] = "torch-legacy"
    path: Path
    graph: PickleGraph
    offsets: Mapping[str, int]
    """Where each storage's bytes start in the file, by storage key."""
    main_start: int
    """Where the object graph's pickle starts: everything before it is the header."""
    storage_start: int
    """Where the storage records start, after the pickled list of storage keys."""
    storage_end: int
    keys: tuple[str, ...]
    """The storage keys in the order their records follow."""

    def storage_range(self, key: str) -> tuple[int, int]:
        """Byte offset and length of a storage's bytes in the file."""
        return self.offsets[key], self.graph.storages[key].nbytes


_MAGIC_PICKLES = tuple(pickle.dumps(LEGACY_MAGIC, protocol=protocol) for protocol in range(pickle.HIGHEST_PROTOCOL + 1))
"""The legacy format's magic number as ``torch.save`` pickles it first, in each protocol it may be given."""


def has_legacy_magic(stream: BinaryIO) -> bool:
    """Whether ``stream`` (at the start of a file that is no zip archive) begins with the pickled magic number of
    torch's legacy format: its bytes compared, nothing unpickled (a store's object is not mapped, so its pickle
    is not read)."""
    head = stream.read(max(len(magic) for magic in _MAGIC_PICKLES))
    return any(head.startswith(magic) for magic in _MAGIC_PICKLES)


def _next_graph(
    stream: BinaryIO,
    source: str,
    size: int,
    *,
    ours: bool = False,
    legacy: bool = False,
    allowed: OpcodeSet = WEIGHTS_ONLY,
) -> PickleGraph:
    """The pickle at the position of ``stream`` (in a file of ``size`` bytes) parsed, of the opcodes ``allowed``;
    the stream left past it."""
    start = stream.tell()
    graph = load_graph(read_pickle(stream, source, size), source, ours=ours, legacy=legacy, allowed=allowed)
    stream.seek(start + graph.end)
    return graph


def open_legacy(stream: BinaryIO, path: Path, source: str, *, ours: bool = False) -> LegacyTorchFile:
    """Parse a legacy-format torch file from its open ``stream``: its pickles and the element count
    before each storage."""
    opened = status_of(stream)
    size = opened[0]
    if size == 0:
        raise InputError("empty file", path=source)
    start = stream.tell()
    try:
        magic = _next_graph(stream, source, min(size, MAGIC_BYTES), allowed=PICKLE).root  # whichever opcodes
    except UnsafeInputError:
        raise
    except InputError as exc:
        if exc.reason == CHANGED:
            raise
        magic = None
    if magic != LEGACY_MAGIC:
        raise NotATorchFile("not a torch file (no zip archive, no legacy magic number)", path=source)
    stream.seek(start)
    _next_graph(stream, source, min(size, MAGIC_BYTES))  # then as torch reads it: of its weights-only unpickler's
    protocol = _next_graph(stream, source, size).root
    if protocol != LEGACY_PROTOCOL:
        raise TorchRefuses(f"its protocol version is {shown(protocol)}, not {LEGACY_PROTOCOL}", path=source)
    _next_graph(stream, source, size)  # the system it was saved on, which torch reads and ignores
    main_start = stream.tell()
    graph = _next_graph(stream, source, size, ours=ours, legacy=True)
    keys = _next_graph(stream, source, size).root
    storage_start = stream.tell()
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise InputError("damaged legacy torch file (bad storage key list)", path=source)
    offsets = {}
    for key in keys:
        ref = graph.storages.get(key)
        header = read_within(stream, 8, size, source)
        if ref is None or len(header) != 8:
            raise InputError(f"damaged legacy torch file (storage {shown(key)})", path=source)
        numel = struct.unpack("<q", header)[0]
        offsets[key] = stream.tell()
        end = offsets[key] + ref.nbytes
        if numel != ref.numel or end > size:
            raise InputError(f"truncated legacy torch file (storage {shown(key)})", path=source)
        stream.seek(end)
    missing = set(graph.storages) - set(keys)
    if missing:
        raise InputError(f"damaged legacy torch file (no bytes for storage {shown(min(missing))})", path=source)
    check_same(stream, opened, source)
    return LegacyTorchFile(path, graph, offsets, main_start, storage_start, stream.tell(), tuple(keys))
