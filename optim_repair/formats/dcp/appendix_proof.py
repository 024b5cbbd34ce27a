"""Proving a DCP copy whose ``.metadata`` was extended: the original's bytes kept by position, the appendix read alone.

A plan that only adds entries writes the original ``.metadata`` with its final ``STOP`` turned into a ``MARK``, then
opcodes that set the new entries in its three tables, then ``POP_MARK`` and ``STOP`` (``metadata_writer``). The
copy must begin with every byte of the original before its ``STOP``; what follows the ``MARK`` is unpickled on its
own, after a prelude that stores an empty stand-in for each table in the memo entry where the original holds it
(found by reading the original, never from the writer) and leaves a stand-in for the ``Metadata`` on the stack. The
root's stand-in must come back untouched, and the tables' stand-ins must hold only keys the original's tables do
not: so the copy's tables are the original's, and those new entries, which are parsed and checked as a whole read's
would be, and merged with the original's for the verifier's other checks.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

from optim_repair.errors import VerificationError
from optim_repair.formats.dcp.metadata import METADATA_FILE, DcpMetadata, display_path
from optim_repair.formats.dcp.metadata_reader import parse_tables, unpickler
from optim_repair.formats.dcp.planning import PlannedEntries
from optim_repair.formats.unpickling import collection_paused
from optim_repair.storage.disk import open_regular

_TABLES = ("state_dict_metadata", "planner_data", "storage_data")
_PUT = pickle.LONG_BINPUT


def appended_metadata(dest: Path, planned: PlannedEntries, name: str = METADATA_FILE) -> DcpMetadata | None:
    """The copy's metadata proven to be the original's with new entries, merged; None where its ``.metadata`` does
    not begin with the original's bytes (rebuilt tables, or strides dropped). Raises VerificationError for an
    appendix that does more than add entries."""
    original = planned.original.pickle
    if original is None or planned.rekeyed.rebuilds_tables or planned.without_strides:
        return None
    source = display_path(str(dest), name)
    with open_regular(dest / name, source) as stream:
        data = stream.read()
    kept = original.end - 1
    if data[kept : kept + 1] != pickle.MARK or not data.endswith(pickle.POP_MARK + pickle.STOP):
        return None
    if not data.startswith(original.data[:kept]):
        return None
    stands = b"".join(pickle.EMPTY_DICT + _PUT + struct.pack("<I", i) + pickle.POP for i in original.tables)
    reading = unpickler(stands + pickle.EMPTY_DICT + data[kept:], source)
    root = reading.load_safely("DCP metadata appendix", ours=True)
    memo = reading.memo.copy()
    if type(root) is not dict or root or len(memo) != len(original.tables):
        raise VerificationError("the copy's metadata appendix touches more than the metadata's tables", path=source)
    with collection_paused():
        tables = {table: memo[index] for table, index in zip(_TABLES, original.tables, strict=True)}
        new = parse_tables(tables, source, name != METADATA_FILE)
    before = planned.original
    overwritten = (
        (new.items.keys() & before.items.keys())
        | (new.planner_data.keys() & before.planner_data.keys())
        | {key for key, _ in new.storage.keys() & before.storage.keys()}
    )
    if overwritten:
        raise VerificationError(
            f"the copy's metadata appendix sets {sorted(overwritten)[:3]} again, which the original holds", path=source
        )
    return DcpMetadata(
        {**before.items, **new.items},
        {**before.planner_data, **new.planner_data},
        {**before.storage, **new.storage},
    )
