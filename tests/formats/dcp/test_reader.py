"""DCP directories read safely from ``.metadata`` and bytes entries (``optim_repair.formats.dcp`` reader side).

Checkpoints are real ``dcp.save`` outputs (``tests.factories.dcp``); nothing is mocked.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from optim_repair.errors import InputError, UnsafeInputError
from optim_repair.formats.dcp import DcpChunk, DcpTensor, is_dcp_directory, read_dcp, read_metadata
from optim_repair.formats.dcp.metadata_reader import read_summary
from optim_repair.records.inventory import TensorMeta
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories.built import Site
from tests.factories.dcp import by_name, only, write_dcp
from tests.factories.dcp_versions import HAS_STRIDES

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

UNSAFE_OPEN = r"refuses to load global io\.open"


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
    assert [w.source for w in inventory.weights] == [".:<top level>"], "torchtitan's weights sit at the top level"
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
    strides = (4, 1) if HAS_STRIDES else None  # torch 2.15 records each rank's tensor's strides
    assert exp_avg == DcpTensor("float32", (4, 4), (DcpChunk((0, 0), (2, 4)), DcpChunk((2, 0), (2, 4))), strides)
    assert by_name(only(sharded)) == by_name(only(whole))
    assert sharded.weights == whole.weights


def test_reading_does_not_import_torch(tmp_path: Path) -> None:
    built = dk.torchtitan_dcp(tmp_path)
    script = (
        "import sys\nfrom pathlib import Path\nfrom optim_repair.formats.dcp import read_dcp\n"
        f"inventory = read_dcp(Path({os.fspath(built.path)!r}), '')\n"
        "assert inventory.optimizers and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[3])


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


def test_refuses_a_metadata_pickle_that_runs_code(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = dk.unsafe_metadata(tmp_path / "in", marker)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(UnsafeInputError, match=UNSAFE_OPEN) as caught:
        read_dcp(path, "")
    assert caught.value.exit_code == 4
    with pytest.raises(UnsafeInputError, match=UNSAFE_OPEN):
        write_dcp(path, [], dest)
    assert not marker.exists()
    assert list(dest.iterdir()) == []
    with (path / ".metadata").open("rb") as stream:
        pickle.load(stream)  # what torch's FileSystemReader does: the payload is live
    assert marker.exists()


def test_refuses_a_metadata_whose_key_torch_cannot_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk (a dataclass torch leaves unhashable) as a dict's key: torch's reader fails on it, so does this one
    (the fuzzer's seed 3801, case 10140, made a field's name a chunk by one byte)."""
    path = dk.unirl_dcp(tmp_path / "in").path
    with (path / ".metadata").open("rb") as stream:
        meta: Any = pickle.load(stream)  # the test's own checkpoint, written by torch just before
    with monkeypatch.context() as hashing:  # hashable only while the hostile file is pickled
        hashing.setattr(ChunkStorageMetadata, "__hash__", object.__hash__)
        chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))
        next(iter(meta.storage_data)).__dict__[chunk] = 1  # a storage entry's field named by a chunk
        (path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(TypeError, match="unhashable type: 'ChunkStorageMetadata'"):
        FileSystemReader(path).read_metadata()
    for read in (read_metadata, read_summary):
        with pytest.raises(InputError, match="unhashable type: 'ChunkStorageMetadata'"):
            read(path, "")


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


def test_an_empty_key_path_is_no_weight(tmp_path: Path) -> None:
    """planner_data may map a key to an empty path (a damaged or hand-made .metadata): no name, no weight."""
    built = dk.unirl_dcp(tmp_path / "in")
    with (built.path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    metadata.planner_data["model.blocks.0.attn.to_q.weight"] = ()
    with (built.path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    inventory = read_dcp(built.path, "")
    assert "blocks.0.attn.to_q.weight" not in inventory.weights[0].lookup()


def _rewrite_entry(path: Path, key: str, edit: Callable[[str, bytes], bytes]) -> None:
    """The bytes entry ``key`` of the DCP checkpoint at ``path`` written again, each record of its archive through
    ``edit`` (by its name inside ``archive/``), appended to its shard and pointed at by the metadata."""
    with (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    info = metadata.storage_data[MetadataIndex(key)]
    shard = path / info.relative_path
    with zipfile.ZipFile(io.BytesIO(shard.read_bytes()[info.offset : info.offset + info.length])) as archive:
        records = [(record, archive.read(record)) for record in archive.infolist()]
    damaged = io.BytesIO()
    with zipfile.ZipFile(damaged, "w") as archive:
        for record, data in records:
            archive.writestr(record, edit(record.filename.rpartition("/")[2], data))
    with shard.open("ab") as stream:
        info.offset, info.length = stream.tell(), stream.write(damaged.getvalue())
    with (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)


def test_a_bytes_entry_torch_would_refuse_is_refused(tmp_path: Path) -> None:
    """``dcp.load`` ``torch.load``s every bytes entry: each is read as a torch file is, its framing included."""
    path = dk.unirl_dcp(tmp_path).path
    _rewrite_entry(path, "optim.param_groups.0.lr", lambda name, data: b"middle" if name == "byteorder" else data)
    with pytest.raises(CheckpointException, match="Unknown endianness type: middle"):
        load({"optim": {"param_groups": [{"lr": 0.0}]}}, checkpoint_id=path)
    result = run_cli(["inspect", path], code=4)
    assert "optim.param_groups.0.lr: torch will refuse this file: its byteorder record says b'middle'" in result.stderr


def test_a_damaged_bytes_entry_outside_the_optimizers_is_refused(tmp_path: Path) -> None:
    """A scheduler's bytes entry stored at the wrong offset: dcp.load fails on it, so the checkpoint cannot be
    resumed; its pickle is not read (dcp.load unpickles it with weights_only=False), its archive is checked."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    built = dk.torchtitan_dcp(tmp_path)
    metadata = FileSystemReader(built.path).read_metadata()
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == "lr_scheduler.last_epoch")
    shard = built.path / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset : info.offset + 2] = b"XX"  # no longer a zip archive
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointException):
        _load_state_dict({}, FileSystemReader(built.path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    result = run_cli(["inspect", built.path], code=4)
    assert "lr_scheduler.last_epoch: not a torch.save archive" in result.stderr


def test_a_bytes_entry_outside_the_optimizers_whose_pickle_torch_cannot_unpickle_is_refused(tmp_path: Path) -> None:
    """The scheduler's ``_is_initial`` pickled with a TUPLE1 where its NEWFALSE was (the fuzzer's seed 41, case
    2230), in an archive otherwise whole: torch's unpickler underflows its stack, so dcp.load fails; optim-repair
    checks the pickle's opcodes, executing nothing."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = dk.torchtitan_dcp(tmp_path).path
    underflows = pickle.NEWFALSE + pickle.STOP, pickle.TUPLE1 + pickle.STOP
    _rewrite_entry(
        path, "lr_scheduler._is_initial", lambda name, data: data.replace(*underflows) if name == "data.pkl" else data
    )
    with pytest.raises(CheckpointException, match="unpickling stack underflow"):
        _load_state_dict({}, FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    result = run_cli(["inspect", path], code=4)
    assert "lr_scheduler._is_initial: not a readable pickle (its stack underflows)" in result.stderr


def test_a_bytes_entry_whose_length_runs_past_its_archive(tmp_path: Path) -> None:
    """dcp.save gives each bytes entry its archive's length: a longer one reads into what follows (found by the
    fuzzer, where torch's loader then refused the archive)."""
    from torch.distributed.checkpoint import FileSystemReader

    built = dk.unirl_dcp(tmp_path)
    metadata = FileSystemReader(built.path).read_metadata()
    index = next(index for index in metadata.storage_data if index.fqn == "optim.param_groups.0.eps")
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)(info.relative_path, info.offset, info.length + 64, None)
    with open(built.path / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)
    result = run_cli(["inspect", built.path], code=4)
    assert "optim.param_groups.0.eps: its length runs 64 bytes past its archive" in result.stderr


def test_a_bytes_entry_of_several_disks_is_one_line() -> None:
    """Its zip64 locator counting two disks: zipfile raised where the entry's length was checked (found by the
    fuzzer)."""
    import struct

    import torch

    from optim_repair.formats.dcp.storage import read_saved_object

    buffer = io.BytesIO()
    torch.save(1e-8, buffer)
    data = bytearray(buffer.getvalue())
    locator = data.rindex(b"PK\x06\x07")
    data[locator + 16 : locator + 20] = struct.pack("<I", 2)
    with pytest.raises(InputError, match=r"damaged zip archive \(zipfiles that span multiple disks"):
        read_saved_object(bytes(data), "entry")


def _restored(path: Path, edit: Callable[[Any], None]) -> None:
    """Edit the ``.metadata`` of the DCP checkpoint ``path`` as torch reads it (this test's own file, just written
    by ``dcp.save``), and write it back."""
    meta = pickle.loads((path / ".metadata").read_bytes())
    edit(meta)
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def _drop_a_moments_storage(meta: Any) -> None:
    key = next(key for key in meta.state_dict_metadata if key.endswith("exp_avg"))
    del meta.storage_data[next(index for index in meta.storage_data if index.fqn == key)]


def _bytes_entry_made_a_tensor(meta: Any) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    key = next(key for key, item in meta.state_dict_metadata.items() if key.endswith(".lr") or "param_groups" in key)
    tensor = next(item for item in meta.state_dict_metadata.values() if isinstance(item, TensorStorageMetadata))
    meta.state_dict_metadata[key] = tensor


@pytest.mark.parametrize("edit", [_drop_a_moments_storage, _bytes_entry_made_a_tensor], ids=lambda edit: edit.__name__)
def test_an_entry_dcp_load_finds_no_storage_for_is_refused(tmp_path: Path, edit: Callable[[Any], None]) -> None:
    """Found by the s3 fuzzer's diff check: a chunk or bytes entry without its storage entry, which ``dcp.load``
    fails on (a KeyError in its reader), was inspected as healthy. Both reads refuse it: the summary and the whole."""
    built = dk.unirl_dcp(tmp_path)
    _restored(built.path, edit)
    for read in (read_summary, read_metadata):
        with pytest.raises(InputError, match=r"stored nowhere|stores .* as a|storage entries of them"):
            read(built.path)
    result = run_cli(["inspect", built.path], code=4)
    assert re.search(r"stored nowhere|state_dict_metadata lists|storage entries of them", result.stderr)
