"""``fix --reset-phantom-step``: entries with ``step`` 1 and all-zero moments turned back into absent state.

UniRL before its PR #440 exported a cold AdamW through ``get_optimizer_state_dict``, whose initializing fake step
gave every parameter ``step=1`` and zero moments; parameters never updated afterwards keep that phantom state in
every later checkpoint. Here the run is reproduced for real, and the reset copy is proven against the same state
repaired by hand with torch.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import optim_repair
from tests.conftest import run_cli
from tests.factories.models import TwoHeadNet, make_optimizer, train
from tests.factories.support import assert_nothing_written, untouched

UNUSED = ("head_unused.weight", "head_unused.bias")


def _phantom_checkpoint(path: Path) -> None:
    """A cold AdamW exported through get_optimizer_state_dict (the fake step), then trained without the unused
    head, then saved as UniRL saves: the unused head keeps step=1 and zero moments."""
    model = TwoHeadNet()
    opt = make_optimizer(model, "adamw")
    get_optimizer_state_dict(model, opt)  # UniRL's cold export: steps the live optimizer with zero gradients
    train(model, opt, 3, use_all=False)
    torch.save({"policy_state_dict": get_model_state_dict(model),
                "optimizer_state_dict": get_optimizer_state_dict(model, opt), "step": 3}, path)  # fmt: skip


def _continue(saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    model = TwoHeadNet(seed=5)
    opt = make_optimizer(model, "adamw")
    set_model_state_dict(model, saved["policy_state_dict"])
    set_optimizer_state_dict(model, opt, saved["optimizer_state_dict"])
    train(model, opt, 3, use_all=True, seed=1)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_phantom_entries_are_found_and_reset_to_fresh_state(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    _phantom_checkpoint(path)
    diagnosis = optim_repair.inspect(path)
    (opt,) = diagnosis.optimizers
    assert opt.phantom == UNUSED and opt.missing == ()
    assert [n.code for n in opt.notices] == ["phantom-step-entries"]
    out = tmp_path / "fixed.pt"
    with untouched(path):
        result = run_cli(["fix", path, "--out", out, "--reset-phantom-step", "--fill", "fresh", "--json"])
    document = json.loads(result.stdout)
    assert [(a["param"], a["keys"], a["replaced"]) for a in document["added"]] == [
        (name, ["step", "exp_avg", "exp_avg_sq"], True) for name in UNUSED
    ]
    fixed = torch.load(out, weights_only=True)
    # the same repair by hand: torch's own objects, fresh AdamW state for the never-updated head
    expected = torch.load(path, weights_only=True)
    for name in UNUSED:
        moment = expected["optimizer_state_dict"]["state"][name]["exp_avg"]
        expected["optimizer_state_dict"]["state"][name] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(moment),
            "exp_avg_sq": torch.zeros_like(moment),
        }
    for name in UNUSED:
        assert {k: v.tolist() for k, v in fixed["optimizer_state_dict"]["state"][name].items()} == {
            k: v.tolist() for k, v in expected["optimizer_state_dict"]["state"][name].items()
        }
    resumed, reference = _continue(copy.deepcopy(fixed)), _continue(expected)
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    phantom = _continue(torch.load(path, weights_only=True))
    assert not torch.equal(phantom["head_unused.weight"], reference["head_unused.weight"]), "the reset matters"
    assert optim_repair.inspect(out).optimizers[0].phantom == ()


def test_the_empty_fill_resets_to_lazy_state(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    _phantom_checkpoint(path)
    out = tmp_path / "fixed.pt"
    report = run_cli(["fix", path, "--out", out, "--reset-phantom-step", "--fill", "empty"]).stdout
    assert "in place of phantom step=1 entries: {} for head_unused.weight, head_unused.bias" in report
    assert "the 2 replaced phantom-step entries" in report
    state = torch.load(out, weights_only=True)["optimizer_state_dict"]["state"]
    assert [state[name] for name in UNUSED] == [{}, {}]
    assert set(state) == set(torch.load(path, weights_only=True)["optimizer_state_dict"]["state"])


def test_a_moment_that_is_not_all_zero_is_never_reset(tmp_path: Path) -> None:
    """inspect reads only a moment's first 4 KiB; the writer reads all of it before it replaces anything."""
    big = torch.zeros(4096)
    big[-1] = 1e-3  # beyond the head inspect reads
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True}  # fmt: skip
    state = {"state": {"big": {"step": torch.tensor(1.0), "exp_avg": big, "exp_avg_sq": torch.zeros(4096)},
                       "small": {"step": torch.tensor(4.0), "exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}},
             "param_groups": [{**hyper, "params": ["big", "small"]}]}  # fmt: skip
    path = tmp_path / "optimizer.pt"
    torch.save(state, path)
    assert optim_repair.inspect(path).optimizers[0].phantom == ("big",)
    out = tmp_path / "fixed.pt"
    refused = run_cli(["fix", path, "--out", out, "--reset-phantom-step"], code=3)
    assert "'big' at the top level has a moment that is not all zero" in refused.stderr
    assert_nothing_written(out)


def test_without_phantom_entries_the_flag_is_refused(tmp_path: Path) -> None:
    model = TwoHeadNet()
    opt = make_optimizer(model, "adamw")
    train(model, opt, 2, use_all=True)
    path = tmp_path / "checkpoint.pt"
    torch.save({"optimizer_state_dict": get_optimizer_state_dict(model, opt)}, path)
    with pytest.raises(optim_repair.RepairRefused, match="there is no phantom step to reset"):
        optim_repair.fix(path, tmp_path / "out.pt", reset_phantom_step=True)
    assert_nothing_written(tmp_path / "out.pt")
