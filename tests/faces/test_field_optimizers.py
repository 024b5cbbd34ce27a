"""Optimizers met in the field, end to end through the ``optim-repair`` command.

Real optimizers train a real model, the checkpoint is saved the way trainers save it, and the command
must judge it rightly: torch's factored Adafactor and those of transformers and pytorch-optimizer are
healthy at the end of a run; fresh state is given for torch's Muon and Adafactor, and the copy resumes
through torch's stock loader exactly as the run that never stopped; it is refused, in one line, for an
optimizer that only looks like one of torch's, unless the user names it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from tests.conftest import run_cli
from tests.faces.test_cli import fix_cli, one_error_line
from tests.factories.models import BranchNet, MatrixMuon, TorchAdafactor, branch_inputs, train_branches

Make = Callable[[Any], torch.optim.Optimizer]


def _transformers_adafactor(params: Any) -> torch.optim.Optimizer:
    adafactor = pytest.importorskip("transformers.optimization").Adafactor
    opt: torch.optim.Optimizer = adafactor(params, lr=1e-2, relative_step=False, scale_parameter=False)
    return opt


def _came(params: Any) -> torch.optim.Optimizer:
    opt: torch.optim.Optimizer = pytest.importorskip("pytorch_optimizer").CAME(params)
    return opt


def _lars(params: Any) -> torch.optim.Optimizer:
    opt: torch.optim.Optimizer = pytest.importorskip("pytorch_optimizer").LARS(params, lr=0.1)
    return opt


def _adamw8bit(params: Any) -> torch.optim.Optimizer:
    opt: torch.optim.Optimizer = pytest.importorskip("torchao.optim").AdamW8bit(params, lr=1e-2)
    return opt


FACTORED: dict[str, Make] = {
    "torch-adafactor": lambda params: TorchAdafactor(params, lr=1e-2),
    "transformers-adafactor": _transformers_adafactor,
    "pytorch-optimizer-came": _came,
}
LOOKALIKES: dict[str, tuple[Make, str]] = {
    "torchao-adamw8bit": (_adamw8bit, "lacks capturable, differentiable, foreach, fused, maximize"),
    "pytorch-optimizer-lars": (_lars, "has step, trust_coefficient"),
}
FRESH: dict[str, Make] = {
    "adafactor": lambda params: TorchAdafactor(params, lr=1e-2),
    "muon": lambda params: MatrixMuon(params, lr=1e-2),
}


def trained(make: Make, *, use_extra: bool, steps: int = 3) -> tuple[BranchNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = BranchNet()
    opt = make(model.parameters())
    train_branches(model, opt, branch_inputs(steps, seed=1), use_extra=use_extra)
    return model, opt


def save_by_name(path: Path, model: BranchNet, opt: torch.optim.Optimizer) -> Path:
    """What UniRL saves: the model and ``get_optimizer_state_dict`` (parameter names) in one torch file."""
    full = StateDictOptions(full_state_dict=True)
    torch.save(
        {
            "policy_state_dict": model.state_dict(),
            "optimizer_state_dict": get_optimizer_state_dict(model, opt, options=full),
        },
        path,
    )
    return path


def inspect(path: Path, code: int) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(run_cli(["inspect", "--json", path], code=code).stdout)
    return document


@pytest.mark.parametrize("optimizer", sorted(FACTORED))
@pytest.mark.parametrize("keys", ["index", "name"])
def test_a_factored_optimizer_at_the_end_of_a_run_is_healthy(tmp_path: Path, optimizer: str, keys: str) -> None:
    model, opt = trained(FACTORED[optimizer], use_extra=True)
    if keys == "index":  # HF Trainer's optimizer.pt
        path = tmp_path / "optimizer.pt"
        torch.save(opt.state_dict(), path)
    else:
        path = save_by_name(tmp_path / "checkpoint.pt", model, opt)
    document = inspect(path, code=0)
    assert document["verdict"] == "healthy"
    (found,) = document["optimizers"]
    assert found["malformed"] == [] and found["missing"] == []


@pytest.mark.parametrize("optimizer", sorted(LOOKALIKES))
def test_fresh_state_is_refused_for_a_lookalike_unless_it_is_named(tmp_path: Path, optimizer: str) -> None:
    make, reason = LOOKALIKES[optimizer]
    path = save_by_name(tmp_path / "checkpoint.pt", *trained(make, use_extra=False))
    assert inspect(path, code=1)["verdict"] == "repairable"
    result = fix_cli(path, tmp_path / "fixed.pt", "--fill", "fresh", code=3)
    one_error_line(
        result,
        "cannot identify the optimizer that wrote",
        "exactly, so fresh state is not given",
        reason,
        "pass --optimizer NAME",
    )
    assert not (tmp_path / "fixed.pt").exists()
    fix_cli(
        path,
        tmp_path / "fixed.pt",
        "--fill",
        "fresh",
        "--optimizer",
        "adamw" if "adamw" in optimizer else "sgd",
        code=0,
    )
    fixed = torch.load(tmp_path / "fixed.pt", weights_only=True)["optimizer_state_dict"]
    assert {"extra.weight", "extra.bias"} <= set(fixed["state"])


@pytest.mark.parametrize("optimizer", sorted(FRESH))
def test_a_fresh_fill_resumes_through_the_stock_loader_exactly(tmp_path: Path, optimizer: str) -> None:
    make = FRESH[optimizer]
    reference, ref_opt = trained(make, use_extra=False)
    path = save_by_name(tmp_path / "checkpoint.pt", reference, ref_opt)
    fix_cli(path, tmp_path / "fixed.pt", "--fill", "fresh", code=0)
    train_branches(reference, ref_opt, branch_inputs(3, seed=2), use_extra=True)

    payload = torch.load(tmp_path / "fixed.pt", weights_only=True)
    resumed = BranchNet()
    resumed.load_state_dict(payload["policy_state_dict"])
    opt = make(resumed.parameters())
    set_optimizer_state_dict(
        resumed, opt, payload["optimizer_state_dict"], options=StateDictOptions(full_state_dict=True)
    )
    train_branches(resumed, opt, branch_inputs(3, seed=2), use_extra=True)

    for (name, expected), actual in zip(reference.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(actual, expected), name
    expected_state = copy.deepcopy(ref_opt.state_dict()["state"])
    actual_state = opt.state_dict()["state"]
    assert list(actual_state) == list(expected_state)
    for index, entry in expected_state.items():
        assert list(actual_state[index]) == list(entry)
        for key, value in entry.items():
            assert torch.equal(actual_state[index][key], value), (index, key)


def test_lbfgs_state_is_not_per_parameter(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = BranchNet()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x = branch_inputs(1, seed=1)[0]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x, True).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    path = save_by_name(tmp_path / "checkpoint.pt", model, opt)
    document = inspect(path, code=0)
    (found,) = document["optimizers"]
    assert found["missing"] == [] and found["states"] == 1 and found["params"] == 6
    (notice,) = [n for n in found["notices"] if n["code"] == "whole-optimizer-state"]
    assert notice["severity"] == "info"
    assert (
        "under its first parameter (trunk.weight)" in notice["detail"]
        and "the other 5 parameter(s)" in notice["detail"]
    )
    assert "--optimizer" not in json.dumps(document)
    (warning,) = [n for n in found["notices"] if n["code"] == "lbfgs-loader"]
    assert warning["severity"] == "warning"
    assert "torch's set_optimizer_state_dict cannot load LBFGS state, complete as it is" in warning["detail"]
    saved = torch.load(path, weights_only=True)["optimizer_state_dict"]
    for full in (True, False):  # what the notice says, measured on the installed torch
        fresh_model = BranchNet()
        fresh = torch.optim.LBFGS(fresh_model.parameters(), max_iter=2)
        with pytest.raises((TypeError, RuntimeError)):
            set_optimizer_state_dict(fresh_model, fresh, saved, options=StateDictOptions(full_state_dict=full))
    fresh = torch.optim.LBFGS(BranchNet().parameters(), max_iter=2)
    fresh.load_state_dict(opt.state_dict())  # its state under index keys loads
