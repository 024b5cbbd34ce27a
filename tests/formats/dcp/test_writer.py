"""Repaired DCP copies (``optim_repair.formats.dcp.writer``), proven by stock ``dcp.load`` and a continuation.

A repaired copy is proven by stock ``dcp.load`` + ``set_optimizer_state_dict`` and a continuation that is
bit-identical to a run that never stopped.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from optim_repair.checkpoint.discovery import discover
from optim_repair.checkpoint.planning import finish_plan
from optim_repair.checkpoint.writing import write_copy
from optim_repair.errors import InputError, RepairRefused
from optim_repair.formats.dcp import DcpBytes, DcpChunk, DcpTensor, read_dcp, read_metadata
from optim_repair.records.dtypes import contiguous_strides
from optim_repair.records.repair_plan import Addition, FreshTensor, RepairPlan
from tests.factories import dcp as dk
from tests.factories.dcp import by_name, files, only, repaired, verify_dcp, write_dcp
from tests.factories.dcp_versions import HAS_STRIDES
from tests.factories.support import read_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.mark.parametrize("optimizer", ["adamw", "adam_amsgrad", "nadam"])
@pytest.mark.parametrize(
    ("layout", "flatten"),
    [("unirl", False), ("unirl", True), ("sharded", False), ("sharded", True)],
    ids=["nested", "flattened", "sharded-nested", "sharded-flattened"],
)
def test_repaired_copy_resumes_bit_identically(tmp_path: Path, optimizer: str, layout: str, flatten: bool) -> None:
    factory = dk.unirl_dcp if layout == "unirl" else dk.sharded_dcp
    built = factory(tmp_path / "in", optimizer, flatten=flatten)
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.state\.head"):
        dk.resume(built.path, optimizer, "optim", flatten)
    dest = tmp_path / "out"
    additions = repaired(built, {"optim": optimizer}, dest)
    assert {a.param for a in additions} == set(dk.HEAD)
    verification = verify_dcp(built.path, dest, additions)
    assert verification.tensors == sum(isinstance(i, DcpTensor) for i in read_metadata(built.path).items.values())
    resumed = dk.resume(dest, optimizer, "optim", flatten)
    expected = dk.uninterrupted(optimizer)
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
    assert dk.missing_params(only(read_dcp(dest, ""))) == ()


def test_plain_values_become_bytes_entries(tmp_path: Path) -> None:
    """SGD with dampening stores ``momentum_buffer = None`` until the first update; zeros would differ."""
    built = dk.unirl_dcp(tmp_path / "in", "sgd_dampening")
    dest = tmp_path / "out"
    additions = repaired(built, {"optim": "sgd_dampening"}, dest)
    verify_dcp(built.path, dest, additions)
    assert read_metadata(dest).items["optim.state.head.proj.weight.momentum_buffer"] == DcpBytes()
    assert by_name(only(read_dcp(dest, "")))["head.proj.bias"] == {"momentum_buffer": None}
    resumed = dk.resume(dest, "sgd_dampening", "optim", False)
    expected = dk.uninterrupted("sgd_dampening")
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


def test_torchtitan_copy_loads_with_stock_dcp(tmp_path: Path) -> None:
    built = dk.torchtitan_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    additions = repaired(built, {"optimizer": "adamw"}, dest)
    verify_dcp(built.path, dest, additions)
    dk.resume(dest, "adamw", "optimizer", True, top_level=True)
    assert [dk.missing_params(opt) for opt in read_dcp(dest, "").optimizers] == [()]


def test_several_optimizers_repaired_in_one_shard(tmp_path: Path) -> None:
    built = dk.two_optimizers_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    additions = repaired(built, {"optim_g": "adamw", "optim_d": "nadam"}, dest)
    verify_dcp(built.path, dest, additions)
    assert [dk.missing_params(opt) for opt in read_dcp(dest, "").optimizers] == [(), ()]
    assert sorted(set(files(dest)) - set(files(built.path))) == ["__optim_repair_0.distcp"]


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_new_metadata_describes_old_and_new_entries(tmp_path: Path, flatten: bool) -> None:
    built = dk.unirl_dcp(tmp_path / "in", flatten=flatten)
    dest = tmp_path / "out"
    additions = repaired(built, {"optim": "adamw"}, dest)
    old, new = read_metadata(built.path), read_metadata(dest)
    added = {f"optim.state.{a.param}.{key}": value for a in additions for key, value in a.state}
    assert list(new.items) == [*old.items, *added]
    assert all(new.items[key] == item for key, item in old.items.items())
    assert all(new.storage[index] == info for index, info in old.storage.items())
    assert all(new.planner_data[key] == path for key, path in old.planner_data.items())
    for key, value in added.items():
        assert isinstance(value, FreshTensor)
        offsets = tuple(0 for _ in value.shape)
        strides = contiguous_strides(value.shape) if HAS_STRIDES else None  # torch 2.15 records them
        assert new.items[key] == DcpTensor(value.dtype, value.shape, (DcpChunk(offsets, value.shape),), strides)
        assert new.storage[(key, offsets)].relative_path == "__optim_repair_0.distcp"
        name, state_key = key.removeprefix("optim.state.").rsplit(".", 1)
        path = ("optim", f"state.{name}.{state_key}") if flatten else ("optim", "state", name, state_key)
        assert new.planner_data[key] == path


def test_new_metadata_is_what_torch_would_write(tmp_path: Path) -> None:
    """The original pickle is kept byte for byte (its STOP became a MARK), and stock ``pickle.load`` builds
    from the extension the very objects torch's classes would have pickled."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    tensors = repaired(built, {"optim": "adamw"}, dest)  # adds fresh moments
    plain = dk.unirl_dcp(tmp_path / "plain", "sgd_dampening")
    plain_dest = tmp_path / "plain-out"
    repaired(plain, {"optim": "sgd_dampening"}, plain_dest)  # adds momentum_buffer = None
    before = (built.path / ".metadata").read_bytes()
    after = (dest / ".metadata").read_bytes()
    assert after[: len(before) - 1] == before[:-1] and after[len(before) - 1 : len(before)] == b"("
    with (dest / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    shard = "__optim_repair_0.distcp"
    position = 0
    for addition in tensors:
        for state_key, value in addition.state:
            key = f"optim.state.{addition.param}.{state_key}"
            zeros = torch.Size([0] * len(value.shape))
            size = torch.Size(value.shape)
            strides = {"strides": contiguous_strides(value.shape)} if HAS_STRIDES else {}
            assert metadata.state_dict_metadata[key] == TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, value.dtype), **strides),
                size,
                [ChunkStorageMetadata(zeros, size)],
            )
            index = MetadataIndex(key, zeros, 0)
            info = metadata.storage_data[index]
            assert next(k for k in metadata.storage_data if k == index).index == 0
            assert (info.relative_path, info.offset) == (shard, position) and info.length > value.nbytes
            assert type(info) is _StorageInfo and info.transform_descriptors is None
            assert metadata.planner_data[key] == ("optim", "state", addition.param, state_key)
            position += info.length
    assert position == (dest / shard).stat().st_size
    with (plain_dest / ".metadata").open("rb") as stream:
        plain_metadata = pickle.load(stream)
    key = "optim.state.head.proj.weight.momentum_buffer"
    assert plain_metadata.state_dict_metadata[key] == BytesStorageMetadata()
    assert plain_metadata.storage_data[MetadataIndex(key)].relative_path == shard
    dcp_to_torch_save(dest, tmp_path / "whole.pt")  # torch's own converter reads the copy
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    for addition in tensors:
        saved = whole["optim"]["state"][addition.param]
        assert saved.keys() == dict(addition.state).keys()
        shape = dict(addition.state)["exp_avg"].shape
        assert all(torch.equal(saved[moment], torch.zeros(shape)) for moment in ("exp_avg", "exp_avg_sq"))


def test_fix_of_a_dcp_checkpoint_never_imports_torch(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    script = (
        "import sys, optim_repair\n"
        f"result = optim_repair.fix({str(built.path)!r}, {str(tmp_path / 'out')!r}, fill='fresh')\n"
        "assert result.verification.tensors > 0\n"
        "print(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_refuses_a_metadata_without_memoized_tables(tmp_path: Path) -> None:
    """A ``.metadata`` pickled without a memo (a pickler in fast mode) is read, but cannot be extended."""
    built = dk.unirl_dcp(tmp_path / "in")
    with (built.path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    with (built.path / ".metadata").open("wb") as stream:
        pickler = pickle.Pickler(stream)
        pickler.fast = True
        pickler.dump(metadata)
    assert dk.missing_params(only(read_dcp(built.path, ""))) == dk.HEAD
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InputError, match="does not keep the metadata tables where a repair can extend them"):
        write_dcp(built.path, dk.additions_for(read_dcp(built.path, ""), {"optim": "adamw"}), dest)
    assert list(dest.iterdir()) == []


@pytest.mark.parametrize("link", [False, True], ids=["copy", "link"])
def test_copy_keeps_every_file(tmp_path: Path, link: bool) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    (built.path / "extra").mkdir()
    (built.path / "extra" / "notes.json").write_text('{"step": 3}\n')
    original = files(built.path)
    dest = tmp_path / "out"
    repaired(built, {"optim": "adamw"}, dest, link=link)
    assert files(built.path) == original
    copy = files(dest)
    assert set(copy) == {*original, "__optim_repair_0.distcp"}
    assert all(copy[name] == data for name, data in original.items() if name != ".metadata")
    assert copy[".metadata"] != original[".metadata"]
    shard = os.stat(built.path / "__0_0.distcp")
    assert os.path.samefile(built.path / "__0_0.distcp", dest / "__0_0.distcp") is link
    assert shard.st_nlink == (2 if link else 1)
    assert os.path.samefile(built.path / "metadata.pt", dest / "metadata.pt") is link  # every unchanged file


def test_refuses_additions_it_cannot_write(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    dest.mkdir()
    zeros = (("step", FreshTensor("float32", (), 0.0)),)
    cases = {
        "already exists": Addition("", "optim", ("optim",), "blocks.0.attn.to_q.bias", zeros),
        "no empty mappings": Addition("", "optim", ("optim",), "head.proj.bias", ()),
        "no optimizer at 'optimizer'": Addition("", "optimizer", ("optimizer",), "head.proj.bias", zeros),
    }
    for message, addition in cases.items():
        with pytest.raises(RepairRefused, match=message):
            write_dcp(built.path, [addition], dest)
        assert list(dest.iterdir()) == []


def test_no_additions_copy_everything_as_is(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    found = discover(built.path)
    write_copy(found, finish_plan(found.target, read_checkpoint(built.path), RepairPlan("fresh", ())), dest)
    assert files(dest) == files(built.path)
    assert verify_dcp(built.path, dest, []).bytes > 0
