"""The proof is independent of the writer: a writer that makes a wrong edit is caught, exit 5, nothing left.

Each test plants one wrong edit in the real writer (it writes another plan than the one ``fix`` made, or
changes a byte after writing) and runs ``optim-repair fix`` in-process: the verifier, which derives what
it expects from the original and the plan alone, must refuse the copy and remove it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from optim_repair.errors import ExitCode
from optim_repair.formats.dcp import adapter as dcp_adapter
from optim_repair.formats.dcp import plan_dcp
from optim_repair.formats.dcp.planning import PlannedEntries
from optim_repair.formats.torchfile import adapter as torch_adapter
from optim_repair.formats.torchfile import open_torch_file
from optim_repair.records.repair_plan import Addition, FreshTensor, ParamChange
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories.models import TwoHeadNet, make_optimizer, train
from tests.factories.support import assert_nothing_written, flip_byte, untouched

Plan = tuple[tuple[Addition, ...], tuple[ParamChange, ...]]


def _unfrozen_head(tmp_path: Path) -> Path:
    """A name-keyed checkpoint whose ``head_unused`` was frozen (in no group, no state): the model has it."""
    model = TwoHeadNet()
    model.head_unused.requires_grad_(False)
    opt = make_optimizer(model, "adamw")
    train(model, opt, 3, use_all=True)
    path = tmp_path / "checkpoint.pt"
    torch.save({"policy_state_dict": get_model_state_dict(model),
                "optimizer_state_dict": get_optimizer_state_dict(model, opt)}, path)  # fmt: skip
    return path


def _plant(monkeypatch: pytest.MonkeyPatch, wrong: Callable[[Plan], Plan]) -> None:
    """Make the torch-file writer write ``wrong(plan)`` instead of the plan ``fix`` made and verifies."""
    real = torch_adapter.write_torch_file

    def planted(src: Path, source: str, additions: Sequence[Addition], dest: Path, **options: Any) -> None:
        planted_additions, planted_changes = wrong((tuple(additions), tuple(options.pop("changes", ()))))
        real(src, source, planted_additions, dest, changes=planted_changes, **options)

    monkeypatch.setattr(torch_adapter, "write_torch_file", planted)


def _refused(path: Path, out: Path, *extra: str) -> str:
    with untouched(path):
        result = run_cli(["fix", path, "--out", out, *extra], code=ExitCode.OUTPUT)
    assert_nothing_written(out)
    return result.stderr


def _extra_entry(plan: Plan) -> Plan:
    additions, changes = plan
    return (*additions, dataclasses.replace(additions[0], param="planted.weight", state=())), changes


def _wrong_group(plan: Plan) -> Plan:
    additions, changes = plan
    return tuple(dataclasses.replace(a, group=None) for a in additions), changes


def _lost_storage(plan: Plan) -> Plan:
    additions, changes = plan
    first = additions[0]
    return additions, (*changes, ParamChange(first.file, first.location, first.address, "trunk.weight", None))


def _wrong_rename(plan: Plan) -> Plan:
    additions, changes = plan
    return additions, tuple(dataclasses.replace(c, new="planted.weight") for c in changes)


def _wrong_values(plan: Plan) -> Plan:
    additions, changes = plan
    ones = tuple(
        (key, FreshTensor(value.dtype, value.shape, 1.0) if isinstance(value, FreshTensor) else value)
        for key, value in additions[0].state
    )
    return (dataclasses.replace(additions[0], state=ones), *additions[1:]), changes


@pytest.mark.parametrize(
    ("wrong", "extra", "message"),
    [
        (_extra_entry, ["--add-from-model"], "keys"),
        (_wrong_group, ["--add-from-model"], "params"),
        (_lost_storage, ["--add-from-model"], "trunk.weight"),
        (_wrong_rename, ["--rename", "^trunk\\.=body."], "keys"),
        (_wrong_values, ["--add-from-model", "--fill", "fresh"], "does not hold the planned values"),
    ],
    ids=["extra-entry", "wrong-group", "lost-storage", "wrong-rename", "wrong-values"],
)
def test_a_torch_file_writer_that_makes_a_wrong_edit_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: Callable[[Plan], Plan], extra: list[str], message: str
) -> None:
    path = _unfrozen_head(tmp_path)
    _plant(monkeypatch, wrong)
    stderr = _refused(path, tmp_path / "fixed.pt", *extra)
    assert "the copy was removed" in stderr and message in stderr


def test_a_changed_byte_in_a_torch_file_copy_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _unfrozen_head(tmp_path)
    real = torch_adapter.write_torch_file

    def flipping(src: Path, source: str, additions: Sequence[Addition], dest: Path, **options: Any) -> None:
        real(src, source, additions, dest, **options)
        copy = open_torch_file(dest, "copy")
        offset, _ = copy.storage_range(next(iter(copy.graph.storages)))
        flip_byte(dest, offset)

    monkeypatch.setattr(torch_adapter, "write_torch_file", flipping)
    stderr = _refused(path, tmp_path / "fixed.pt", "--add-from-model")
    assert "the bytes of storage" in stderr


def test_the_writer_leaves_the_parsed_original_as_it_was(tmp_path: Path) -> None:
    """The verifier compares the copy with the original as reading parsed it: the writer must never edit it."""
    from optim_repair.formats.torchfile import write_torch_file
    from optim_repair.formats.torchfile.verifier import verify_torch_file

    path = _unfrozen_head(tmp_path)
    parsed = open_torch_file(path, "in")
    fresh = FreshTensor("float32", (2, 8))
    address = ("optimizer_state_dict",)
    additions = [Addition("", "optimizer_state_dict", address, "head_unused.weight", (("exp_avg", fresh),), group=0)]
    changes = [ParamChange("", "optimizer_state_dict", address, "trunk.bias", "body.bias")]
    write_torch_file(path, "in", additions, tmp_path / "out.pt", changes=changes, parsed=parsed)
    verify_torch_file(path, tmp_path / "out.pt", "in", additions, changes=changes, parsed=open_torch_file(path, "in"))
    verify_torch_file(path, tmp_path / "out.pt", "in", additions, changes=changes, parsed=parsed)


def _frozen_head_dcp(tmp_path: Path) -> Path:
    model = dk.DeepNet()
    model.head.requires_grad_(False)
    opt = make_optimizer(model, "adamw")
    train(model, opt, dk.PRE_STEPS, use_all=True)
    path = tmp_path / "checkpoint"
    save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return path


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize(
    ("wrong", "message"),
    [(_extra_entry, "keys differ"), (_wrong_group, "does not hold"), (_wrong_values, "does not hold 0.0 everywhere")],
    ids=["extra-entry", "wrong-group", "wrong-values"],
)
def test_a_dcp_writer_that_makes_a_wrong_edit_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: Callable[[Plan], Plan], message: str
) -> None:
    path = _frozen_head_dcp(tmp_path)
    real = dcp_adapter.write_planned_dcp

    def planted(src: Path, planned: PlannedEntries, dest: Path, **options: Any) -> None:
        additions, changes = wrong((tuple(_additions_of(planned)), ()))
        for addition in additions:
            if not addition.state:  # DCP stores no empty entry: the planted one gets a value
                additions = tuple(a if a is not addition else dataclasses.replace(a, state=(("step", 0.0),))
                                  for a in additions)  # fmt: skip
        groups = {("optim",): [[*planned.rekeyed.params.get("optim.param_groups.0.params", [])]]}
        real(src, plan_dcp(planned.original, "planted", additions, changes, groups), dest, **options)

    monkeypatch.setattr(dcp_adapter, "write_planned_dcp", planted)
    stderr = _refused(path, tmp_path / "fixed", "--add-from-model")
    assert message in stderr


def _additions_of(planned: PlannedEntries) -> list[Addition]:
    """The additions a DCP plan holds, one per parameter, in group 0 (as ``--add-from-model`` planned them)."""
    by_param: dict[object, list[tuple[str, Any]]] = {}
    for entry in planned.entries:
        *_, param, key = entry.path
        by_param.setdefault(param, []).append((str(key), entry.value))
    return [Addition("", "optim", ("optim",), param, tuple(state), group=0) for param, state in by_param.items()]
