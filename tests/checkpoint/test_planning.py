"""The whole plan is finished before anything is written (``checkpoint.planning``): a dry run, ``optim_repair.plan``
and ``fix`` refuse the same things, DCP's key plan and the torch file's checks included."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import optim_repair
from optim_repair.errors import ExitCode, InputError, RepairRefused
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import trainers
from tests.factories.support import assert_nothing_written, untouched

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _memoless_dcp(root: Path) -> Path:
    """A DCP checkpoint whose ``.metadata`` was pickled without a memo: readable, but no repair can extend it."""
    built = dk.unirl_dcp(root)
    with (built.path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    with (built.path / ".metadata").open("wb") as stream:
        pickler = pickle.Pickler(stream)
        pickler.fast = True
        pickler.dump(metadata)
    return built.path


def test_a_dcp_refusal_comes_from_the_dry_run_and_the_plan_as_from_fix(tmp_path: Path) -> None:
    path = _memoless_dcp(tmp_path / "in")
    out = tmp_path / "fixed"
    lines = []
    with untouched(path):
        for extra in (["--dry-run"], []):
            result = run_cli(["fix", path, "--out", out, *extra], code=ExitCode.INPUT)
            lines.append(result.stderr.strip().splitlines()[-1])
            assert_nothing_written(out)
        with pytest.raises(InputError, match="does not keep the metadata tables"):
            optim_repair.plan(path)
        with pytest.raises(InputError, match="does not keep the metadata tables"):
            optim_repair.plan(optim_repair.inspect(path))
    assert lines[0] == lines[1] and "does not keep the metadata tables" in lines[0]


def test_a_torch_file_refusal_comes_from_the_dry_run_as_from_fix(tmp_path: Path) -> None:
    """Resetting a phantom step drops storages, which a legacy-format file cannot: refused before writing."""
    built = trainers.legacy_format(tmp_path)
    out = tmp_path / "fixed.pt"
    path = built.path
    with untouched(path):
        with pytest.raises(RepairRefused, match="legacy-format"):
            optim_repair.plan(path, operations=optim_repair.model_changes(drop=["^head_used\\."]))
        for extra in (["--dry-run"], []):
            result = run_cli(["fix", path, "--out", out, "--drop", "^head_used\\.", *extra], code=ExitCode.MALFORMED)
            assert "a legacy-format file must all keep" in result.stderr
            assert_nothing_written(out)
        with pytest.raises(RepairRefused, match="legacy-format"):
            optim_repair.dry_run(path, out, operations=optim_repair.model_changes(drop=["^head_used\\."]))
