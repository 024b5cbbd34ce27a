"""The Python API (``optim_repair.api``): inspect, plan (a dry run) and fix, and the types they return."""

from __future__ import annotations

from pathlib import Path

import optim_repair
from tests.factories.built import Built
from tests.factories.support import assert_nothing_written, untouched


def test_every_exported_name_resolves() -> None:
    for name in optim_repair.__all__:
        assert getattr(optim_repair, name) is not None, name


def test_plan_is_a_dry_run_of_fix(unirl_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "fixed"
    with untouched(unirl_checkpoint.path):
        planned = optim_repair.plan(unirl_checkpoint.path, fill="fresh")
    assert isinstance(planned, optim_repair.RepairPlan)
    assert [a.param for a in planned.additions] == list(unirl_checkpoint.all_missing)
    assert all(isinstance(value, optim_repair.FreshTensor) for a in planned.additions for _, value in a.state[1:])
    assert_nothing_written(out)
    result = optim_repair.fix(unirl_checkpoint.path, out, fill="fresh")
    assert result.plan == planned


def test_fix_takes_the_diagnosis_inspect_returned(unirl_checkpoint: Built, tmp_path: Path) -> None:
    diagnosis = optim_repair.inspect(unirl_checkpoint.path)
    assert isinstance(diagnosis, optim_repair.Diagnosis)
    assert all(isinstance(opt, optim_repair.OptimizerDiagnosis) for opt in diagnosis.optimizers)
    assert optim_repair.plan(diagnosis) == optim_repair.plan(unirl_checkpoint.path)
    result = optim_repair.fix(diagnosis, tmp_path / "fixed")
    assert result.diagnosis is diagnosis
    assert isinstance(result.verification, optim_repair.Verification) and result.verification.tensors > 0
    assert optim_repair.inspect(tmp_path / "fixed").verdict == "healthy"


def test_the_public_names_are_the_ones_listed() -> None:
    assert sorted(optim_repair.__all__) == sorted(optim_repair._HOMES)


def test_dir_shows_the_public_names_before_they_load() -> None:
    """``dir(optim_repair)`` (and an editor's completion) lists what ``__all__`` names, loaded on first use."""
    assert set(optim_repair.__all__) <= set(dir(optim_repair))
