"""What a DCP checkpoint's ``.metadata`` says, as plain data: its entries, their key paths and where each lies.

A DCP directory holds a pickled ``.metadata`` and ``*.distcp`` shard files. The metadata maps every
flattened state-dict key to a tensor (dtype, global size, the chunks each rank wrote) or to a bytes
entry (a ``torch.save``'d object), says where each chunk or entry lies in which shard, and records in
``planner_data`` the original path of keys behind each flattened key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from optim_repair.errors import InputError, shown
from optim_repair.formats.dcp.metadata_records import StorageRun
from optim_repair.records.dtypes import contiguous_strides, itemsize, numel
from optim_repair.records.inventory import ParamKey, TensorMeta

METADATA_FILE = ".metadata"
SHARD_SUFFIX = ".distcp"
REPAIR_SHARD_PREFIX = "__optim_repair_"
"""How the shard a repair adds to a DCP checkpoint is named: no name torch's writer gives a rank's shards."""
_RANK_METADATA = re.compile(r"__([0-9]+)\.metadata")


def is_rank_metadata(name: str) -> bool:
    """Whether a file by this name is one rank's ``.metadata`` of a DCP checkpoint saved without collectives
    (``dcp.save(..., use_collectives=False)``: ``__<rank>.metadata``, that rank's own view, no global one)."""
    return _RANK_METADATA.fullmatch(name.rpartition("/")[2]) is not None


def metadata_names(names: Iterable[str]) -> tuple[str, ...]:
    """The metadata files of a DCP checkpoint directory that holds the files ``names``: its global ``.metadata``
    (what ``dcp.load`` reads first), else each rank's ``__<rank>.metadata`` in rank order; () for neither."""
    listed = set(names)
    if METADATA_FILE in listed:
        return (METADATA_FILE,)
    ranks = [(int(found[1]), name) for name in listed if (found := _RANK_METADATA.fullmatch(name))]
    return tuple(name for _, name in sorted(ranks))


KeyPath = tuple[ParamKey, ...]
StorageIndex = tuple[str, tuple[int, ...] | None]
"""A storage entry's identity, as DCP's ``MetadataIndex``: the key, and a tensor chunk's offsets."""


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
    strides: tuple[int, ...] | None = None
    """The strides of the tensor that was saved, which torch records from 2.15 on (``TensorProperties.strides``)."""
    compact: bool = False
    """Whether a chunk is stored in fewer bytes than its elements take: a tensor subclass that saves itself in
    its own encoding (torchao's quantized optimizer state), whose size no stored bytes back."""

    def meta(self, key: str) -> TensorMeta:
        """The entry as the inventory describes a tensor: contiguous, its storage named by its key."""
        return TensorMeta(
            dtype=self.dtype,
            shape=self.size,
            stride=contiguous_strides(self.size),
            storage=key,
            storage_offset=0,
            storage_nbytes=numel(self.size) * itemsize(self.dtype),
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
class MetadataPickle:
    """A ``.metadata`` pickle as it was read, already checked: what a repair extends."""

    data: bytes = field(repr=False)
    end: int
    """Where the pickle ends: just past its STOP."""
    tables: tuple[int, int, int]
    """Where the unpickler's memo holds ``state_dict_metadata``, ``planner_data`` and ``storage_data``."""
    property_fields: int = 5
    """How many fields its ``TensorProperties`` pickle: 5 before torch 2.15, 6 from it (``strides``); a repair
    writes new ones alike."""


@dataclass(frozen=True)
class DcpMetadata:
    """A checkpoint's ``.metadata``, read without torch."""

    items: Mapping[str, DcpItem]
    planner_data: Mapping[str, KeyPath]
    """Each key's original path of keys (``("optim", "state", "blocks.0.w", "exp_avg")``)."""
    storage: Mapping[StorageIndex, DcpStorage]
    summarized: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    """For a summary read (``read_summary``), which lists neither the chunks nor the storage entries it summarized:
    the furthest byte of each shard they reach, and the key stored there."""
    pickle: MetadataPickle | None = field(default=None, repr=False, compare=False)
    """The pickle these were read from: the writer extends these very bytes, so that a file changed
    in between is never taken as the original."""

    def path_of(self, key: str) -> KeyPath:
        return self.planner_data.get(key, (key,))


def is_dcp_directory(path: Path) -> bool:
    """Whether ``path`` is a DCP checkpoint directory: it holds a ``.metadata`` file, or ranks' own."""
    try:
        return any((path / name).is_file() for name in metadata_names(os.listdir(path)))
    except OSError:
        return False


def view_key(rel: str, name: str) -> str:
    """Where the metadata file ``name`` of the DCP checkpoint ``rel`` is kept once read: under ``rel`` for its
    global ``.metadata``, under ``rel/__<rank>.metadata`` for a rank's own."""
    return rel if name == METADATA_FILE else display_path(rel, name)


def display_path(rel: str, name: str) -> str:
    """``name`` inside the directory ``rel`` of the user's argument, for messages."""
    return f"{rel}/{name}" if rel else name


def check_stored(
    items: Mapping[str, DcpItem],
    storage: Mapping[StorageIndex, DcpStorage],
    runs: set[StorageRun],
    summarized: int,
    source: str,
) -> None:
    """Every entry is stored where ``dcp.load`` looks for it: a bytes entry under its key, as many storage entries of
    tensor chunks as there are chunks, none stored as the other kind (a summary that counts otherwise: read whole)."""
    for key, offsets in (*storage, *((key, ()) for run in runs for key in run.keys)):
        if (offsets is None) != isinstance(items[key], DcpBytes):
            kind, listed = ("bytes", "tensor") if offsets is None else ("tensor", "bytes")
            raise InputError(f"stores {shown(key)} as a {kind} entry; its state_dict_metadata lists a {listed} entry",
                             path=source)  # fmt: skip
    for key, item in items.items():
        if isinstance(item, DcpBytes) and (key, None) not in storage:
            raise InputError(f"{shown(key)} is listed but stored nowhere", path=source)
    # A tensor's chunks, against its storage entries: counted, as a summary (which keeps no chunk's offsets) can
    # count them too, so that the summary and the whole read answer alike; a chunk listed twice is stored once.
    tensors = [(key, item) for key, item in items.items() if isinstance(item, DcpTensor)]
    stored = sum(run.count for run in runs) + sum(offsets is not None for _, offsets in storage)
    chunks = summarized + sum(len(item.chunks) for _, item in tensors)
    if chunks != stored:
        chunks = summarized + len({(key, chunk.offsets) for key, item in tensors for chunk in item.chunks})
    if chunks != stored:
        raise InputError(f"lists {chunks} chunks of tensors and {stored} storage entries of them", path=source)
