"""A ``.metadata`` read summarized gives the answer of reading it whole, in memory that does not grow with chunks.

``read_summary`` (what ``inspect`` reads) summarizes the records torch's pickler writes for each chunk as it
walks the pickle; ``read_metadata`` (what ``fix`` reads) unpickles all of it. Here both read real checkpoints,
saved by ``dcp.save`` and by the frontier-scale builder, and pickles made to trip the walk, and must agree.
"""

from __future__ import annotations

import functools
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from typer.testing import Result

from optim_repair.checkpoint.discovery import discover
from optim_repair.checkpoint.reading import DiskListing, read_parsed
from optim_repair.errors import InputError, UnsafeInputError
from optim_repair.formats.dcp import METADATA_FILE, DcpMetadata, DcpTensor, read_metadata
from optim_repair.formats.dcp.metadata_reader import read_summary
from optim_repair.formats.dcp.metadata_records import NotSummarized
from optim_repair.formats.dcp.metadata_summary import summarize
from optim_repair.formats.dcp.storage import LocalShards, check_ranges
from tests.factories import dcp
from tests.factories.chunked import build_chunked, chunk_count


def _chunked(root: Path) -> Path:
    build_chunked(root / "chunked", 8, 40)
    return root / "chunked"


def _sharded(root: Path) -> Path:
    return dcp.sharded_dcp(root).path


def _flattened_sharded(root: Path) -> Path:
    return dcp.sharded_dcp(root, flatten=True).path


def _single_process(root: Path) -> Path:
    return dcp.unirl_dcp(root).path


def _torchtitan(root: Path) -> Path:
    return dcp.torchtitan_dcp(root).path


CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    "chunked": _chunked,
    "sharded": _sharded,
    "flattened-sharded": _flattened_sharded,
    "single-process": _single_process,
    "torchtitan": _torchtitan,
}


def _assert_same(whole: DcpMetadata, summary: DcpMetadata) -> None:
    """``summary`` says what ``whole`` says, less the chunks and storage entries it summarized."""
    assert summary.planner_data == whole.planner_data
    assert summary.items.keys() == whole.items.keys()
    for key, item in whole.items.items():
        got = summary.items[key]
        if isinstance(item, DcpTensor):
            assert isinstance(got, DcpTensor)
            assert (got.dtype, got.size, got.strides) == (item.dtype, item.size, item.strides)
            assert set(got.chunks) <= set(item.chunks)
        else:
            assert got == item
    assert all(whole.storage[index] == info for index, info in summary.storage.items())
    furthest: dict[str, int] = {}
    for index, info in whole.storage.items():
        if index not in summary.storage:
            furthest[info.relative_path] = max(furthest.get(info.relative_path, 0), info.offset + info.length)
    assert {shard: end for shard, (end, _) in summary.summarized.items()} == furthest
    for shard, (end, key) in summary.summarized.items():
        assert any(
            index[0] == key and info.relative_path == shard and info.offset + info.length == end
            for index, info in whole.storage.items()
        )


@pytest.mark.parametrize("build", sorted(CHECKPOINTS))
def test_a_summary_says_what_the_whole_metadata_says(build: str, root: Path) -> None:
    path = CHECKPOINTS[build](root)
    whole, summary = read_metadata(path), read_summary(path)
    _assert_same(whole, summary)
    chunks = sum(len(item.chunks) for item in whole.items.values() if isinstance(item, DcpTensor))
    listed = sum(len(item.chunks) for item in summary.items.values() if isinstance(item, DcpTensor))
    assert summary.summarized and listed < chunks  # what one process saves too: a list of one chunk is a run
    if build == "chunked":  # one chunk per rank: all but a few summarized
        assert chunks == chunk_count(8, 40) and listed <= chunks // 20
    if build in ("sharded", "flattened-sharded"):  # two ranks: the first record of each kind is read whole
        assert listed <= chunks // 4


@pytest.mark.parametrize("build", sorted(CHECKPOINTS))
def test_inspect_reports_what_a_whole_read_reports(build: str, root: Path) -> None:
    path = CHECKPOINTS[build](root)
    found = discover(path)
    summarized, _ = read_parsed(DiskListing(found), keep=False)
    whole, _ = read_parsed(DiskListing(found), keep=True)
    assert summarized == whole


def test_the_stand_in_cannot_be_named_by_a_file(root: Path) -> None:
    path = _chunked(root)
    summary = summarize((path / METADATA_FILE).read_bytes())
    again = summarize((path / METADATA_FILE).read_bytes())
    assert summary.name != again.name  # drawn afresh for every walk
    forged = b"\x80\x04\x8c\x17optim_repair.summarized\x94\x8c" + bytes([len(summary.name)]) + summary.name.encode()
    (path / METADATA_FILE).write_bytes(forged + b"\x94\x93\x94K\x00K\x00\x86R.")
    with pytest.raises(UnsafeInputError, match=re.escape("refuses to load global optim_repair.summarized")):
        read_summary(path)


def _repickled(path: Path, edit: Callable[[Metadata], None], protocol: int = pickle.DEFAULT_PROTOCOL) -> None:
    metadata = FileSystemReader(path).read_metadata()
    edit(metadata)
    (path / METADATA_FILE).write_bytes(pickle.dumps(metadata, protocol=protocol))


def _same_answer(path: Path) -> None:
    """Both reads give one answer: the same metadata, or the same refusal."""
    try:
        whole = read_metadata(path)
    except InputError as exc:
        with pytest.raises(type(exc)) as summarized:
            read_summary(path)
        assert str(summarized.value) == str(exc)
    else:
        assert read_summary(path) == whole


def test_a_pickle_of_another_protocol_is_read_whole(root: Path) -> None:
    path = _chunked(root)
    _repickled(path, lambda metadata: None, protocol=2)
    with pytest.raises(NotSummarized):
        summarize((path / METADATA_FILE).read_bytes())
    assert read_summary(path) == read_metadata(path)


def test_a_reference_into_a_summarized_record_is_read_whole(root: Path) -> None:
    path = _chunked(root)

    def share(metadata: Metadata) -> None:  # each storage key's offsets: the very torch.Size its chunk holds
        chunks = {
            (key, chunk.offsets): chunk.offsets
            for key, item in metadata.state_dict_metadata.items()
            for chunk in getattr(item, "chunks", ())
        }
        metadata.storage_data = {
            MetadataIndex(index.fqn, None, index.index) if index.offset is None else _sharing(index, chunks): info
            for index, info in metadata.storage_data.items()
        }

    _repickled(path, share)
    with pytest.raises(NotSummarized):
        summarize((path / METADATA_FILE).read_bytes())
    assert read_summary(path) == read_metadata(path)


def _sharing(index: MetadataIndex, chunks: dict[tuple[str, object], object]) -> MetadataIndex:
    shared = MetadataIndex(index.fqn, None, index.index)
    object.__setattr__(shared, "offset", chunks.get((index.fqn, index.offset), index.offset))
    return shared


def _first_sharded(metadata: Metadata) -> str:
    return next(key for key, item in metadata.state_dict_metadata.items() if len(getattr(item, "chunks", ())) > 4)


def _chunk_outside(metadata: Metadata) -> None:
    chunks = metadata.state_dict_metadata[_first_sharded(metadata)].chunks
    chunks[5].sizes = type(chunks[5].sizes)([4, chunks[5].sizes[1]])  # rows 5 to 8 of 8


def _chunk_missing(metadata: Metadata) -> None:
    del metadata.state_dict_metadata[_first_sharded(metadata)].chunks[6]


def _chunk_negative(metadata: Metadata) -> None:
    chunks = metadata.state_dict_metadata[_first_sharded(metadata)].chunks
    chunks[3].offsets = type(chunks[3].offsets)([-1, 0])


def _shard_escapes(metadata: Metadata) -> None:
    info = next(info for index, info in metadata.storage_data.items() if index.offset is not None and index.index == 4)
    info.relative_path = "../outside.distcp"


def _key_unlisted(metadata: Metadata) -> None:
    index, info = next((index, info) for index, info in metadata.storage_data.items() if index.index == 5)
    del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex("model.nowhere", index.offset, index.index)] = info


@pytest.mark.parametrize(
    "edit", [_chunk_outside, _chunk_missing, _chunk_negative, _shard_escapes, _key_unlisted], ids=lambda e: e.__name__
)
def test_a_damaged_record_in_a_run_gets_the_whole_reads_answer(edit: Callable[[Metadata], None], root: Path) -> None:
    path = _chunked(root)
    _repickled(path, edit)
    with pytest.raises(InputError):
        read_metadata(path)
    _same_answer(path)


def test_a_shard_shorter_than_a_summarized_chunk_needs_is_truncated(root: Path, cli: Callable[..., Result]) -> None:
    path = _chunked(root)
    shard = path / "__3_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # half its entries lie past its end: the first met is named
    result = cli(["inspect", path], code=4)
    with pytest.raises(InputError) as whole:
        check_ranges(LocalShards(path), read_metadata(path), "")
    assert "__3_0.distcp: truncated; " in str(whole.value)
    assert result.stderr == f"optim-repair: error: {whole.value}\n"  # the entry the whole read meets first


_PEAK = """
import sys
from optim_repair.api import inspect
inspect(sys.argv[1])
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))
"""


def _peak_kib(path: Path) -> int:
    """The peak resident memory of a fresh process that inspects ``path`` (its own, counted from its start)."""
    done = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_memory_does_not_grow_with_chunks(root: Path) -> None:
    """Ten times the ranks, so ten times the chunks of the same tensors: the peak stays where it was. (Read whole,
    the 190,000-chunk checkpoint peaks at about 750 MiB, against 80 MiB for 19,000.)"""
    few, many = root / "few", root / "many"
    build_chunked(few, 32, 200)
    build_chunked(many, 320, 200)
    assert chunk_count(320, 200) > 180_000
    assert _peak_kib(many) <= _peak_kib(few) + 8 * 1024


def _laughs(depth: int) -> tuple[object, ...]:
    value: tuple[object, ...] = ("lol",)
    for _ in range(depth):
        value = (value, value)  # pickled once, then fetched from the memo: 2**depth leaves
    return value


@pytest.mark.parametrize(
    ("planned", "reason"),
    [(_laughs(64), "billion-laughs"), (functools.reduce(lambda inner, _: (inner,), range(150), ()), "deep")],
    ids=["billion-laughs", "deep"],
)
def test_what_the_pre_scan_refuses_beside_summarized_records_is_still_refused(
    planned: object, reason: str, root: Path
) -> None:
    """The walk bounds fix's whole read in place of the pre-scan: beside records it summarizes, a structure that
    the pre-scan refuses is refused all the same, by both reads, before anything is unpickled."""
    path = _chunked(root)
    _repickled(path, lambda metadata: metadata.planner_data.__setitem__("model.extra", planned))
    summarize((path / METADATA_FILE).read_bytes())  # the walk follows it: it is the pre-scan that refuses it
    with pytest.raises(InputError, match=reason):
        read_metadata(path)
    _same_answer(path)
