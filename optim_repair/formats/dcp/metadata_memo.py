"""Where the unpickler's memo holds a ``.metadata``'s objects: for a writer that rebuilds its tables.

A rename or a drop rebuilds ``state_dict_metadata``, ``planner_data`` and ``storage_data`` from references to
the objects the original pickled, so that every object kept is the original's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from optim_repair.errors import InputError
from optim_repair.formats.dcp.metadata import MetadataPickle
from optim_repair.formats.dcp.metadata_reader import int_tuple, unpickler


class StorageMemo(NamedTuple):
    """One storage entry of a ``.metadata``: its key's fields, and where the memo holds its two objects."""

    fqn: str
    offsets: tuple[int, ...] | None
    """The chunk's offsets, from its ``MetadataIndex``."""
    chunk_index: Any
    """The ``MetadataIndex``'s ``index`` field."""
    index_memo: int
    """The memo index of the ``MetadataIndex``."""
    info_memo: int
    """The memo index of the ``_StorageInfo``."""


@dataclass(frozen=True)
class MemoObjects:
    """Where the unpickler's memo holds a ``.metadata``'s objects: the ``Metadata`` itself, each entry's
    description, each key path, and each storage entry's ``MetadataIndex`` (with its fields) and ``_StorageInfo``,
    in the pickle's order, for a writer that rebuilds the tables from references to them."""

    root: int
    items: dict[str, int]
    paths: dict[str, int]
    storage: list[StorageMemo]


def memo_objects(pickled: MetadataPickle, source: str) -> MemoObjects:
    """The memo indices of ``pickled``'s objects, from unpickling it again (it was checked when it was read)."""
    reading = unpickler(pickled.data, source)
    root = reading.load_safely("DCP metadata pickle", ours=True)
    where = {id(value): index for index, value in reading.memo.copy().items()}
    fields = root.state

    def index_of(value: Any) -> int:
        if id(value) not in where:
            raise InputError("its pickle does not keep every metadata object in its memo", path=source)
        return where[id(value)]

    storage = []
    for key_record, info in fields["storage_data"].items():
        state = key_record.state or {}
        offset = state.get("offset")
        offsets = None if offset is None else int_tuple(offset, "a chunk offset", source)
        storage.append(
            StorageMemo(str(state.get("fqn")), offsets, state.get("index"), index_of(key_record), index_of(info))
        )
    return MemoObjects(
        index_of(root),
        {key: index_of(value) for key, value in fields["state_dict_metadata"].items()},
        {key: index_of(value) for key, value in fields["planner_data"].items()},
        storage,
    )
