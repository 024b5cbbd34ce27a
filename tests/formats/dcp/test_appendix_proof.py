"""A DCP copy whose ``.metadata`` is the original's with entries appended is proven from its appendix alone
(``formats.dcp.appendix_proof``): what it proves must be what a whole read finds, and an appendix that does more
than add entries must be refused."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import pytest

from optim_repair.errors import VerificationError
from optim_repair.formats.dcp import read_metadata
from optim_repair.formats.dcp.appendix_proof import appended_metadata
from optim_repair.formats.dcp.metadata import METADATA_FILE
from optim_repair.formats.dcp.planning import plan_dcp
from tests.factories import dcp as dk
from tests.factories.built import Built
from tests.factories.dcp import repaired, verify_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def copied(tmp_path: Path) -> tuple[Built, Path, tuple[object, ...]]:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    return built, dest, repaired(built, {"optim": "adamw"}, dest)


Copied = tuple[Built, Path, tuple[object, ...]]


def test_the_appendix_proves_what_a_whole_read_of_the_copy_finds(copied: Copied) -> None:
    built, dest, additions = copied
    original = (built.path / METADATA_FILE).read_bytes()
    assert (dest / METADATA_FILE).read_bytes().startswith(original[:-1])
    planned = plan_dcp(read_metadata(built.path, str(built.path)), METADATA_FILE, additions)  # type: ignore[arg-type]
    proven = appended_metadata(dest, planned)
    whole = read_metadata(dest, str(dest), ours=True)
    assert proven is not None and len(proven.items) > len(planned.original.items)
    assert (proven.items, proven.planner_data, proven.storage) == (whole.items, whole.planner_data, whole.storage)


def _appended(dest: Path, ops: bytes) -> None:
    """The copy's ``.metadata`` with ``ops`` run at the end of its appendix, before its POP_MARK."""
    data = (dest / METADATA_FILE).read_bytes()
    (dest / METADATA_FILE).write_bytes(data[:-2] + ops + pickle.POP_MARK + pickle.STOP)


def _text(value: str) -> bytes:
    return pickle.BINUNICODE + struct.pack("<I", len(value)) + value.encode()


def test_an_appendix_that_sets_an_original_entry_again_is_refused(
    copied: tuple[Built, Path, tuple[object, ...]],
) -> None:
    built, dest, additions = copied
    original = read_metadata(built.path, str(built.path))
    assert original.pickle is not None
    planner = original.pickle.tables[1]
    key = next(iter(original.planner_data))
    again = pickle.LONG_BINGET + struct.pack("<I", planner) + pickle.MARK + _text(key) + _text("elsewhere")
    _appended(dest, again + pickle.TUPLE1 + pickle.SETITEMS)
    with pytest.raises(VerificationError, match="again, which the original holds"):
        verify_dcp(built.path, dest, additions)  # type: ignore[arg-type]


def test_an_appendix_that_reaches_another_object_is_refused(copied: tuple[Built, Path, tuple[object, ...]]) -> None:
    built, dest, additions = copied
    original = read_metadata(built.path, str(built.path))
    assert original.pickle is not None
    other = next(index for index in range(10) if index not in original.pickle.tables)
    _appended(dest, pickle.LONG_BINGET + struct.pack("<I", other))
    with pytest.raises(VerificationError, match="cannot be read back"):
        verify_dcp(built.path, dest, additions)  # type: ignore[arg-type]
