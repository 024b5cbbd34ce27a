"""DCP checkpoints as other torch versions and libraries write them: torch 2.15's six-field ``TensorProperties``,
and torchao's tensor-subclass state, stored in fewer bytes than the tensor it stands for.

torch 2.15's ``.metadata`` is made by ``tests.factories.dcp_versions`` with the installed torch's classes and
2.15's ``__getstate__`` (the real 2.15 writes it on a torch that has ``strides``); ``scripts/torch_versions.py``
runs the same repair and resume under a real torch 2.15.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from optim_repair.errors import InputError
from optim_repair.formats.dcp import DcpTensor, read_dcp, read_metadata
from optim_repair.formats.dcp.metadata import MetadataPickle
from optim_repair.formats.dcp.metadata_older import without_strides
from optim_repair.records.dtypes import contiguous_strides
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import dcp_versions as dv
from tests.factories.dcp import by_name, only

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_torch_215_metadata_is_read_with_its_strides(tmp_path: Path) -> None:
    five = dk.unirl_dcp(tmp_path / "five").path
    six = dv.as_torch_215(dk.unirl_dcp(tmp_path / "six").path)
    assert {len(state) for state in dv.property_states(six).values()} == {6}
    meta = read_metadata(six)
    assert meta.pickle is not None and meta.pickle.property_fields == 6
    tensors = {key: item for key, item in meta.items.items() if isinstance(item, DcpTensor)}
    assert tensors and all(item.strides == contiguous_strides(item.size) for item in tensors.values())
    assert by_name(only(read_dcp(six, ""))) == by_name(only(read_dcp(five, "")))


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_a_torch_215_checkpoint_is_fixed_with_six_fields_and_resumes_bit_identically(
    tmp_path: Path, flatten: bool
) -> None:
    built = dk.unirl_dcp(tmp_path / "in", flatten=flatten)
    dv.as_torch_215(built.path)
    out = tmp_path / "fixed"
    fixed = json.loads(run_cli(["fix", built.path, "--out", out, "--for-torch", "2.15", "--json"]).stdout)
    assert sorted(a["param"] for a in fixed["added"]) == sorted(built.all_missing)
    states = dv.property_states(out)
    new = [key for key in states if any(f".{param}." in key for param in built.all_missing)]
    assert new and {len(state) for state in states.values()} == {6}
    meta = read_metadata(out)
    for key in new:
        item = meta.items[key]
        assert isinstance(item, DcpTensor) and states[key][5] == contiguous_strides(item.size)
    with dv.torch_215_properties():  # torch 2.15 reads the copy: stock dcp.load + set_optimizer_state_dict
        resumed = dk.resume(out, "adamw", "optim", flatten)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_a_torch_215_checkpoint_fixed_for_an_older_torch_loads_there_and_resumes_bit_identically(
    tmp_path: Path, flatten: bool
) -> None:
    """For a torch before 2.15 the copy's ``TensorProperties`` have five fields, its old and new entries alike, and
    the original's pickle is kept but for one POP a state: stock ``dcp.load`` of this torch resumes from it."""
    built = dk.unirl_dcp(tmp_path / "in", flatten=flatten)
    dv.as_torch_215(built.path)
    original = (built.path / ".metadata").read_bytes()
    out = tmp_path / "fixed"
    fixed = json.loads(run_cli(["fix", built.path, "--out", out, "--for-torch", "2.13", "--json"]).stdout)
    assert fixed["older_forms"] == [""] and sorted(a["param"] for a in fixed["added"]) == sorted(built.all_missing)
    states = dv.property_states(out)
    assert len(states) == len(dv.property_states(built.path)) + sum(len(a["keys"]) for a in fixed["added"])
    assert {len(state) for state in states.values()} == {5}
    meta = read_metadata(out)
    assert all(item.strides is None for item in meta.items.values() if isinstance(item, DcpTensor))
    copied = (out / ".metadata").read_bytes()
    assert copied.count(pickle.POP) - original.count(pickle.POP) >= len(dv.property_states(built.path))
    if dv.HAS_STRIDES:
        pytest.skip("this torch reads either form: the older torch's read is scripts/torch_versions.py's")
    resumed = dk.resume(out, "adamw", "optim", flatten)  # the installed torch, as it is
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def test_strides_dropped_across_frames_leave_every_frame_whole_and_every_reference_right() -> None:
    """A pickle of many frames, with states the memo shares: each frame grows by the POPs it holds, and every
    later reference (to a state, or to an object after it) still fetches what it fetched."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    properties = []
    for index in range(3000):
        made = TensorProperties(dtype=torch.float32 if index % 2 else torch.bfloat16)
        made.strides = (index + 1, 1)  # type: ignore[attr-defined]
        properties.append(made)
    padding = ["x" * 50 for _ in range(2000)]
    with dv.torch_215_properties():
        data = pickle.dumps({"first": properties, "again": properties[::7], "padding": padding}, protocol=4)
    assert data.count(pickle.FRAME) > 2
    older = without_strides(MetadataPickle(data, len(data), (0, 0, 0), 6), "test")
    assert older.property_fields == 5 and len(older.data) == len(data) + len(properties)
    loaded = pickle.loads(older.data)
    assert [made.dtype for made in loaded["first"]] == [made.dtype for made in properties]
    assert all(again is loaded["first"][index * 7] for index, again in enumerate(loaded["again"]))
    assert loaded["padding"] == padding
    assert all(getattr(made, "strides", None) is None for made in loaded["first"])


def test_a_healthy_torch_215_checkpoint_is_repairable_for_an_older_torch(tmp_path: Path) -> None:
    """A checkpoint with every entry is repairable for a torch that cannot read its ``.metadata``, healthy for one
    that can; its fix changes the form alone."""
    built = dk.unirl_dcp(tmp_path / "in")
    dv.as_torch_215(built.path)
    whole = tmp_path / "whole"
    run_cli(["fix", built.path, "--out", whole, "--for-torch", "2.15"])
    assert json.loads(run_cli(["inspect", whole, "--for-torch", "2.15", "--json"]).stdout)["verdict"] == "healthy"
    older = json.loads(run_cli(["inspect", whole, "--for-torch", "2.13", "--json"], code=1).stdout)
    assert older["verdict"] == "repairable" and older["optimizers"][0]["missing"] == []
    out = tmp_path / "older"
    result = run_cli(["fix", whole, "--out", out, "--for-torch", "2.13"])
    assert "the only changes are the 0 added entries and 1 DCP .metadata files in an older torch's form" in " ".join(
        result.stdout.split()
    )
    assert {len(state) for state in dv.property_states(out).values()} == {5}
    assert json.loads(run_cli(["inspect", out, "--for-torch", "2.13", "--json"]).stdout)["verdict"] == "healthy"
    assert dk.files(out).keys() == dk.files(whole).keys()  # no new shard: nothing was added


def test_a_fix_of_a_five_field_checkpoint_writes_five(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    if dv.HAS_STRIDES:
        pytest.skip("this torch writes six fields")
    run_cli(["fix", built.path, "--out", tmp_path / "fixed"])
    assert {len(state) for state in dv.property_states(tmp_path / "fixed").values()} == {5}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("mixed", r"its tensor properties have 5 fields \('.+'\) and 6 \('.+'\)"),
        ("wrong-length", r"model\.blocks\.0\.attn\.to_q\.weight of size \(4, 4\) has the strides \(1,\)"),
        ("not-integers", r"the strides of model\.blocks\.0\.attn\.to_q\.weight is \['a', 'b'\]"),
    ],
)
def test_malformed_strides_are_refused(tmp_path: Path, edit: str, message: str) -> None:
    path = dv.as_torch_215(dk.unirl_dcp(tmp_path).path)
    with dv.torch_215_properties(), (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    item = metadata.state_dict_metadata["model.blocks.0.attn.to_q.weight"]
    if edit == "mixed":
        if dv.HAS_STRIDES:
            pytest.skip("this torch's TensorProperties always pickles six fields")
        del item.properties.strides
    else:
        item.properties.strides = (1,) if edit == "wrong-length" else ["a", "b"]
    with dv.torch_215_properties(), (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    with pytest.raises(InputError, match=message):
        read_metadata(path)


def test_torchao_tensor_subclass_state_is_inspected_and_its_repair_refused(tmp_path: Path) -> None:
    pytest.importorskip("torchao.optim", exc_type=ImportError)
    built = dv.torchao_dcp(tmp_path / "in")
    meta = read_metadata(built.path)
    compact = {key for key, item in meta.items.items() if isinstance(item, DcpTensor) and item.compact}
    assert compact == {"optim.state.body.weight.exp_avg", "optim.state.body.weight.exp_avg_sq"}
    opt = only(read_dcp(built.path, ""))
    assert dk.missing_params(opt) == ("head.weight", "head.bias")
    body = opt.entry("body.weight")
    assert body is not None and body.get("exp_avg") is not None
    assert (body.get("exp_avg").dtype, body.get("exp_avg").shape) == ("float32", (128, 64))  # type: ignore[union-attr]
    report = json.loads(run_cli(["inspect", built.path, "--json"], code=1).stdout)
    assert report["optimizers"][0]["missing"] == ["head.weight", "head.bias"]
    out = tmp_path / "fixed"
    unidentified = run_cli(["fix", built.path, "--out", out], code=3)  # torchao's AdamW8bit is not torch's AdamW
    assert "cannot identify the optimizer" in unidentified.stderr
    refused = run_cli(["fix", built.path, "--out", out, "--fill", "fresh", "--optimizer", "adamw"], code=3)
    assert "optim.state.body.weight.exp_avg is stored in fewer bytes than its elements take" in refused.stderr
    assert "adding state to a checkpoint that holds one is not supported" in refused.stderr
    assert not out.exists()


def test_a_torch_215_metadata_is_said_to_be_unreadable_by_an_older_torch(tmp_path: Path) -> None:
    """The torch that loads it (installed, or ``--for-torch``) is told when it cannot read the ``.metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    six = dv.as_torch_215(dk.unirl_dcp(tmp_path).path)
    document = json.loads(run_cli(["inspect", six, "--for-torch", "2.13", "--json"], code=1).stdout)
    (notice,) = [notice for notice in document["notices"] if notice["code"] == "newer-torch-metadata"]
    assert "torch 2.13 cannot read this DCP .metadata, which torch 2.15 or later wrote" in notice["detail"]
    later = json.loads(run_cli(["inspect", six, "--for-torch", "2.15", "--json"], code=1).stdout)
    assert [notice for notice in later["notices"] if notice["code"] == "newer-torch-metadata"] == []
    if not dv.HAS_STRIDES:  # what the notice says, measured on the installed torch
        with pytest.raises(ValueError, match="too many values to unpack"):
            FileSystemReader(six).read_metadata()
