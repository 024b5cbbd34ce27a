"""DCP directories: reading optimizers from ``.metadata`` safely, writing repaired copies, verifying them.

Checkpoints are real ``dcp.save`` outputs (``tests.dcp_checkpoints``); a repaired copy is proven by
stock ``dcp.load`` + ``set_optimizer_state_dict`` and a continuation that is bit-identical to a run
that never stopped.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from optim_repair.errors import InputError, OutputError, RepairRefused, UnsafeInputError, VerificationError
from optim_repair.formats.dcp import (
    DcpBytes,
    DcpChunk,
    DcpTensor,
    is_dcp_directory,
    read_dcp,
    read_metadata,
    verify_dcp,
    write_dcp,
)
from optim_repair.fresh import FreshTensor
from optim_repair.inventory import FileInventory, OptimizerInventory, TensorMeta
from optim_repair.repair import Addition
from tests import dcp_checkpoints as dk
from tests.checkpoints import Built, Site

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

UNSAFE_OPEN = r"refuses to load global io\.open"


def files(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` by relative name, with its bytes."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def repaired(built: Built, kinds: dict[str, str], dest: Path, *, link: bool = False) -> tuple[Addition, ...]:
    """Write ``built`` repaired with hand-written fresh state into ``dest``; returns the additions."""
    additions = dk.additions_for(read_dcp(built.path, ""), kinds)
    dest.mkdir()
    write_dcp(built.path, additions, dest, link=link)
    return additions


def by_name(opt: OptimizerInventory) -> dict[object, dict[str, object]]:
    return {entry.param: dict(entry.values or ()) for entry in opt.entries}


def only(inventory: FileInventory) -> OptimizerInventory:
    (opt,) = inventory.optimizers
    return opt


# --------------------------------------------------------------------------- reading


def test_is_dcp_directory(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path)
    assert is_dcp_directory(built.path)
    assert not is_dcp_directory(built.path / "metadata.pt")
    assert not is_dcp_directory(tmp_path)


def test_reads_nested_unirl_layout(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path)
    inventory = read_dcp(built.path, "checkpoint-3")
    assert (inventory.file, inventory.format) == ("checkpoint-3", "dcp")
    opt = only(inventory)
    assert (opt.file, opt.location, opt.address, opt.key_style) == ("checkpoint-3", "optim", ("optim",), "name")
    (weights,) = inventory.weights
    assert weights.source == "checkpoint-3:model"
    shapes = weights.lookup()
    assert opt.params == tuple(name for name, _ in dk.DeepNet().named_parameters()) == tuple(shapes)
    assert dk.missing_params(opt) == built.missing[Site("", ("optim",))] == dk.HEAD
    assert len(opt.entries) == len(shapes) - 2
    for entry in opt.entries:
        assert entry.keys == ("step", "exp_avg", "exp_avg_sq")
        step, exp_avg = entry.get("step"), entry.get("exp_avg")
        assert isinstance(step, TensorMeta) and (step.dtype, step.shape) == ("float32", ())
        assert exp_avg == TensorMeta(
            dtype="float32",
            shape=shapes[str(entry.param)].shape,
            stride=shapes[str(entry.param)].stride,
            storage=f"optim.state.{entry.param}.exp_avg",
            storage_offset=0,
            storage_nbytes=4 * shapes[str(entry.param)].numel,
        )
    (group,) = opt.groups
    assert group.option("lr") == 1e-2
    assert group.option("betas") == (0.9, 0.999)
    assert group.option("weight_decay") == 0.01
    assert "params" not in group.option_keys


def test_reads_flattened_torchtitan_layout(tmp_path: Path) -> None:
    built = dk.torchtitan_dcp(tmp_path)
    inventory = read_dcp(built.path, "")
    opt = only(inventory)  # lr_scheduler, dataloader and train_state are no optimizers
    assert (opt.location, opt.address, opt.key_style) == ("optimizer", ("optimizer",), "name")
    assert opt.params == tuple(inventory.weights[0].lookup())
    assert dk.missing_params(opt) == built.missing[Site("", ("optimizer",))]
    assert {"lr", "betas", "initial_lr", "amsgrad"} <= opt.groups[0].option_keys
    assert all(entry.keys == ("step", "exp_avg", "exp_avg_sq") for entry in opt.entries)


def test_both_layouts_read_alike(tmp_path: Path) -> None:
    nested = only(read_dcp(dk.unirl_dcp(tmp_path / "n").path, ""))
    flat = only(read_dcp(dk.unirl_dcp(tmp_path / "f", flatten=True).path, ""))
    assert [(g.params, g.options) for g in flat.groups] == [(g.params, g.options) for g in nested.groups]
    assert by_name(flat) == by_name(nested)


def test_flattened_names_resolve_without_model_weights(tmp_path: Path) -> None:
    inventory = read_dcp(dk.flattened_without_model(tmp_path).path, "")
    assert inventory.weights == ()
    opt = only(inventory)
    assert opt.params == tuple(name for name, _ in dk.DeepNet().named_parameters())
    assert dk.missing_params(opt) == dk.HEAD
    assert {entry.param for entry in opt.entries} == set(opt.params) - set(dk.HEAD)


def test_reads_several_optimizers(tmp_path: Path) -> None:
    built = dk.two_optimizers_dcp(tmp_path)
    inventory = read_dcp(built.path, "")
    assert [opt.location for opt in inventory.optimizers] == ["optim_g", "optim_d"]
    for opt in inventory.optimizers:
        assert dk.missing_params(opt) == built.missing[Site("", opt.address)]
    generator, discriminator = inventory.optimizers
    assert all(entry.keys == ("step", "mu_product", "exp_avg", "exp_avg_sq") for entry in discriminator.entries)
    assert set(generator.params).isdisjoint(discriminator.params)


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_reads_tensors_chunked_by_two_ranks(tmp_path: Path, flatten: bool) -> None:
    path = dk.sharded_dcp(tmp_path / "s", flatten=flatten).path
    sharded = read_dcp(path, "")
    whole = read_dcp(dk.unirl_dcp(tmp_path / "w", flatten=flatten).path, "")
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    meta = read_metadata(path)
    exp_avg = meta.items["optim.state.blocks.0.attn.to_q.weight.exp_avg"]
    assert exp_avg == DcpTensor("float32", (4, 4), (DcpChunk((0, 0), (2, 4)), DcpChunk((2, 0), (2, 4))))
    assert by_name(only(sharded)) == by_name(only(whole))
    assert sharded.weights == whole.weights


def test_reading_does_not_import_torch(tmp_path: Path) -> None:
    built = dk.torchtitan_dcp(tmp_path)
    script = (
        "import sys\nfrom pathlib import Path\nfrom optim_repair.formats.dcp import read_dcp\n"
        f"inventory = read_dcp(Path({os.fspath(built.path)!r}), '')\n"
        "assert inventory.optimizers and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[1])


def test_reading_ignores_tensor_bytes(tmp_path: Path) -> None:
    path = dk.sharded_dcp(tmp_path).path
    before = read_dcp(path, "")
    meta = read_metadata(path)
    for (key, _), info in meta.storage.items():
        if isinstance(meta.items[key], DcpTensor):
            with (path / info.relative_path).open("r+b") as stream:
                stream.seek(info.offset)
                stream.write(b"\xa5" * info.length)
    assert read_dcp(path, "") == before


# --------------------------------------------------------------------------- repairing


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
    dk.resume(dest, "adamw", "optimizer", True)
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
        assert new.items[key] == DcpTensor(value.dtype, value.shape, (DcpChunk(offsets, value.shape),))
        assert new.storage[(key, offsets)].relative_path == "__optim_repair_0.distcp"
        name, state_key = key.removeprefix("optim.state.").rsplit(".", 1)
        path = ("optim", f"state.{name}.{state_key}") if flatten else ("optim", "state", name, state_key)
        assert new.planner_data[key] == path


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
    assert not os.path.samefile(built.path / "metadata.pt", dest / "metadata.pt")


def test_verify_detects_a_changed_original_entry(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    additions = repaired(built, {"optim": "adamw"}, dest)
    info = read_metadata(dest).storage[("optim.state.blocks.1.attn.to_out.weight.exp_avg", (0, 0))]
    with (dest / info.relative_path).open("r+b") as stream:
        stream.seek(info.offset + info.length - 20)
        byte = stream.read(1)
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte[0] ^ 1]))
    with pytest.raises(VerificationError, match=r"optim\.state\.blocks\.1\.attn\.to_out\.weight\.exp_avg"):
        verify_dcp(built.path, dest, additions)


def test_verify_detects_a_wrong_addition(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    additions = repaired(built, {"optim": "adamw"}, dest)
    ones = tuple(
        (key, FreshTensor(value.dtype, value.shape, 1.0) if isinstance(value, FreshTensor) else value)
        for key, value in additions[0].state
    )
    wrong = (Addition("", "optim", ("optim",), additions[0].param, ones), *additions[1:])
    with pytest.raises(VerificationError, match=r"does not hold 1\.0"):
        verify_dcp(built.path, dest, wrong)
    with pytest.raises(VerificationError, match="keys differ"):
        verify_dcp(built.path, dest, additions[1:])


def test_verify_detects_a_changed_neighbour(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    additions = repaired(built, {"optim": "adamw"}, dest)
    (dest / "metadata.pt").write_bytes(b"changed")
    with pytest.raises(VerificationError, match=r"metadata\.pt"):
        verify_dcp(built.path, dest, additions)


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
            write_dcp(built.path, [addition], dest, link=False)
        assert list(dest.iterdir()) == []
    (dest / "stray").write_text("")
    with pytest.raises(OutputError, match="existing empty directory"):
        write_dcp(built.path, [], dest, link=False)


def test_no_additions_copy_everything_as_is(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    dest.mkdir()
    write_dcp(built.path, [], dest, link=False)
    assert files(dest) == files(built.path)
    assert verify_dcp(built.path, dest, []).bytes > 0


# --------------------------------------------------------------------------- unsafe and malformed inputs


def test_refuses_a_metadata_pickle_that_runs_code(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = dk.unsafe_metadata(tmp_path / "in", marker)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(UnsafeInputError, match=UNSAFE_OPEN) as caught:
        read_dcp(path, "")
    assert caught.value.exit_code == 4
    with pytest.raises(UnsafeInputError, match=UNSAFE_OPEN):
        write_dcp(path, [], dest, link=False)
    assert not marker.exists()
    assert list(dest.iterdir()) == []
    with (path / ".metadata").open("rb") as stream:
        pickle.load(stream)  # what torch's FileSystemReader does: the payload is live
    assert marker.exists()


def test_refuses_a_bytes_entry_that_runs_code(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = dk.unsafe_bytes_entry(tmp_path / "in", marker)
    with pytest.raises(UnsafeInputError, match=UNSAFE_OPEN):
        read_dcp(path, "")
    assert not marker.exists()
    template: dict[str, Any] = {"optim": {"param_groups": [{"lr": None, "params": []}]}}
    load(template, checkpoint_id=path)  # stock DCP torch.loads it: the payload is live
    assert marker.exists()


def test_zstd_bytes_entries_need_a_zstd_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("zstandard", "compression", "compression.zstd"):
        monkeypatch.setitem(sys.modules, name, None)  # as on a machine without any zstd module
    path = dk.unirl_dcp(tmp_path).path
    dk.with_transform(path, "optim.param_groups.0.lr", "stream.zstd/1")
    with pytest.raises(InputError, match=r"zstd-compressed \(stream.zstd/1\); install the 'zstandard' package"):
        read_dcp(path, "")


def test_zstd_bytes_entries_are_read(tmp_path: Path) -> None:
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    run = dk.trained()
    state = {"optim": get_optimizer_state_dict(run.model, run.optimizer)}
    save(state, storage_writer=FileSystemWriter(tmp_path / "z", _extensions=[ZStandard()]))
    save(state, checkpoint_id=tmp_path / "plain")
    assert only(read_dcp(tmp_path / "z", "")).groups == only(read_dcp(tmp_path / "plain", "")).groups


def test_refuses_unknown_stream_transforms(tmp_path: Path) -> None:
    path = dk.unirl_dcp(tmp_path).path
    dk.with_transform(path, "optim.param_groups.0.lr", "stream.rot13/1")
    with pytest.raises(InputError, match=r"unknown stream transform 'stream\.rot13/1'"):
        read_dcp(path, "")


def rewrite_metadata(path: Path, edit: str) -> None:
    with (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    if edit == "escape":
        metadata.storage_data[MetadataIndex("optim.param_groups.0.lr")].relative_path = "../../etc/passwd"
    else:
        metadata.planner_data = None
    with (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("escape", "points outside the checkpoint directory"),
        ("no-planner-data", "records no planner_data"),
        ("truncated", "not a readable DCP metadata pickle"),
        ("garbage-entry", r"__0_0\.distcp:optim\.param_groups\.0\.lr: not a torch\.save archive"),
    ],
)
def test_refuses_malformed_metadata(tmp_path: Path, edit: str, message: str) -> None:
    path = dk.unirl_dcp(tmp_path).path
    if edit == "truncated":
        (path / ".metadata").write_bytes((path / ".metadata").read_bytes()[:100])
    elif edit == "garbage-entry":
        info = read_metadata(path).storage[("optim.param_groups.0.lr", None)]
        with (path / info.relative_path).open("r+b") as stream:
            stream.seek(info.offset)
            stream.write(b"\x00" * info.length)
    else:
        rewrite_metadata(path, edit)
    with pytest.raises(InputError, match=message) as caught:
        read_dcp(path, "")
    assert not isinstance(caught.value, UnsafeInputError)
