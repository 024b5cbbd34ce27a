"""The ``.metadata`` writer on its own (``formats.dcp.metadata_writer``): its opcodes against ``pickletools``, and
what ``pickle.load`` builds from them against torch's own metadata classes."""

from __future__ import annotations

import io
import pickle
import pickletools
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from optim_repair.formats.dcp import plan_dcp, read_dcp, read_metadata
from optim_repair.formats.dcp.metadata_memo import memo_objects
from optim_repair.formats.dcp.metadata_writer import Place, extended_metadata, rebuilt_metadata
from optim_repair.records.repair_plan import Addition, FreshTensor, ParamChange
from tests.factories import dcp as dk

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _loaded(data: bytes) -> Metadata:
    pickletools.dis(data, out=io.StringIO())  # a well-formed opcode stream, to its STOP
    metadata = pickle.loads(data)
    assert isinstance(metadata, Metadata)
    return metadata


def _placed(keys: list[str]) -> dict[str, Place]:
    return {key: Place("__new.distcp", 1000 * index, 100 + index) for index, key in enumerate(keys)}


def test_extended_metadata_is_the_original_followed_by_the_new_entries(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    meta = read_metadata(built.path)
    assert meta.pickle is not None
    additions = dk.additions_for(read_dcp(built.path, ""), {"optim": "adamw"})
    planned = plan_dcp(meta, "in", additions)
    placed = _placed([entry.key for entry in planned.entries])
    data = extended_metadata(meta.pickle, planned.entries, placed)
    assert data.startswith(meta.pickle.data[: meta.pickle.end - 1])  # every original byte kept, but its STOP
    original, copy = pickle.loads(meta.pickle.data), _loaded(data)
    assert set(copy.state_dict_metadata) == set(original.state_dict_metadata) | {e.key for e in planned.entries}
    for entry in planned.entries:
        described = copy.state_dict_metadata[entry.key]
        if isinstance(entry.value, FreshTensor):
            assert isinstance(described, TensorStorageMetadata)
            assert tuple(described.size) == entry.value.shape and len(described.chunks) == 1
            index = MetadataIndex(entry.key, tuple(0 for _ in entry.value.shape))
        else:
            assert isinstance(described, BytesStorageMetadata)
            index = MetadataIndex(entry.key)
        info = copy.storage_data[index]
        assert (info.relative_path, info.offset, info.length) == tuple(placed[entry.key])
        assert copy.planner_data[entry.key] == entry.path
    for key, value in original.state_dict_metadata.items():
        assert copy.state_dict_metadata[key] == value


def test_rebuilt_metadata_renames_drops_and_adds_from_the_originals_own_objects(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    meta = read_metadata(built.path)
    assert meta.pickle is not None
    inventory = read_dcp(built.path, "")
    optimizer = dk.only(inventory)
    names = [str(param) for group in optimizer.groups for param in group.params]
    renamed, dropped = names[0], names[1]
    changes = [
        ParamChange("", "optim", ("optim",), renamed, f"renamed.{renamed}"),
        ParamChange("", "optim", ("optim",), dropped, None),
    ]
    groups = {optimizer.address: [group.params for group in optimizer.groups]}
    additions = dk.additions_for(inventory, {"optim": "adamw"})
    planned = plan_dcp(meta, "in", additions, changes, groups)
    rekeyed = planned.rekeyed
    placed = _placed([entry.key for entry in planned.entries] + list(rekeyed.params))
    data = rebuilt_metadata(meta.pickle, memo_objects(meta.pickle, "in"), rekeyed, planned.entries, placed)
    original, copy = pickle.loads(meta.pickle.data), _loaded(data)
    for key, value in original.state_dict_metadata.items():
        new = rekeyed.new_key(key)
        if new is None:
            assert key not in copy.state_dict_metadata and dropped in key
        else:
            assert copy.state_dict_metadata[new] == value
            assert copy.planner_data[new] == (rekeyed.paths[new] if new != key else original.planner_data[key])
    assert any(f"renamed.{renamed}" in key for key in copy.state_dict_metadata)
    for index, info in original.storage_data.items():
        new = rekeyed.new_key(index.fqn)
        if new is None or index.fqn in rekeyed.params:
            continue
        assert copy.storage_data[MetadataIndex(new, index.offset, index.index)] == info
    for key in rekeyed.params:  # the params lists, rewritten into the new shard
        info = copy.storage_data[MetadataIndex(key)]
        assert (info.relative_path, info.offset, info.length) == tuple(placed[key])


def test_more_entries_than_a_batch_are_set_in_batches_as_the_pickler_writes_them(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    meta = read_metadata(built.path)
    assert meta.pickle is not None
    fresh = FreshTensor("float32", (2,))
    additions = [Addition("", "optim", ("optim",), f"extra.{i}.weight", (("exp_avg", fresh),)) for i in range(1500)]
    planned = plan_dcp(meta, "in", additions)
    data = extended_metadata(meta.pickle, planned.entries, _placed([entry.key for entry in planned.entries]))
    assert data.count(pickle.SETITEMS) >= data.count(pickle.SETITEMS, 0, meta.pickle.end) + 3 * 2
    copy = _loaded(data)
    assert all(f"optim.state.extra.{i}.weight.exp_avg" in copy.state_dict_metadata for i in range(1500))
