"""A DCP checkpoint whose param groups lack an option the loading torch asks for: torch before 2.8 wrote no
``decoupled_weight_decay`` for Adam and AdamW, and 2.8 onwards their ``dcp.load`` asks for it (mosaicml/composer#3850).
The checkpoint is repairable; ``fix`` adds the option with the value the loading torch gives a group without it, and
the copy resumes exactly."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_saver import save

from optim_repair.decisions.diagnose import missing_options
from optim_repair.formats.dcp import read_dcp
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories.dcp_versions import HAS_STRIDES
from tests.factories.models import make_optimizer, train

ASKED = "optim.param_groups.0.decoupled_weight_decay"


def _as_before_2_8(root: Path, optimizer: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A DCP checkpoint of ``dk.DeepNet`` trained with every parameter (no state is missing), as torch 2.4 to 2.7
    wrote it: no ``decoupled_weight_decay`` in its groups; and the parameters the uninterrupted run ends with."""
    model = dk.DeepNet()
    opt = make_optimizer(model, optimizer)
    train(model, opt, dk.PRE_STEPS, use_all=True, seed=0)
    state = {"model": get_model_state_dict(model), "optim": copy.deepcopy(get_optimizer_state_dict(model, opt))}
    for group in state["optim"]["param_groups"]:
        del group["decoupled_weight_decay"]
    path = root / f"checkpoint-{dk.PRE_STEPS}"
    save(state, checkpoint_id=path)
    train(model, opt, dk.POST_STEPS, use_all=True, seed=1)
    return path, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_an_option_the_loading_torch_asks_for_is_added_with_the_value_it_assumes(
    tmp_path: Path, optimizer: str
) -> None:
    path, expected = _as_before_2_8(tmp_path / "in", optimizer)
    with pytest.raises(CheckpointException, match=f"Missing key in checkpoint state_dict: {ASKED}"):
        dk.resume(path, optimizer, "optim", False)
    document = json.loads(run_cli(["inspect", path, "--json"], code=1).stdout)
    (found,) = document["optimizers"]
    assert document["verdict"] == "repairable" and found["missing_options"] == [
        {"group": 0, "key": "decoupled_weight_decay"}
    ]
    (notice,) = [notice for notice in found["notices"] if notice["code"] == "dcp-missing-option"]
    assert f'Missing key in checkpoint state_dict: {ASKED}"' in notice["detail"]
    fixed = json.loads(run_cli(["fix", path, "--out", tmp_path / "fixed", "--json"], code=0).stdout)
    assert fixed["added_options"] == [
        {"file": "", "location": "optim", "group": 0, "key": "decoupled_weight_decay", "value": False}
    ]
    resumed = dk.resume(tmp_path / "fixed", optimizer, "optim", False)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected), "resumes exactly"
    summary = run_cli(["fix", path, "--out", tmp_path / "again"], code=0).stdout
    assert f"added the param-group option {ASKED} = False" in summary
    assert "the only changes are the 0 added entries and 1 added param-group options" in summary
    assert json.loads(run_cli(["inspect", tmp_path / "fixed", "--strict", "--json"], code=0).stdout)["verdict"] == (
        "healthy"
    )


def test_only_dcp_load_of_a_release_that_writes_the_option_asks_for_it(tmp_path: Path) -> None:
    """torch 2.7 wrote no such option and asks for none; a torch file's loaders give an absent option its value."""
    path, _ = _as_before_2_8(tmp_path, "adamw")
    (optimizer,) = read_dcp(path, "").optimizers
    assert missing_options(optimizer, "dcp.load", (2, 13)) == ((0, "decoupled_weight_decay"),)
    assert missing_options(optimizer, "dcp.load", (2, 7)) == ()
    assert missing_options(optimizer, "set_optimizer_state_dict", (2, 13)) == ()


def test_for_torch_names_the_release_that_will_load_it(tmp_path: Path) -> None:
    """``--for-torch`` judges for another torch than the installed one: 2.7's dcp.load asks for no such option (a
    checkpoint this torch wrote, if it is 2.15 or later, is still in a form 2.7 cannot read: repairable for that)."""
    path, _ = _as_before_2_8(tmp_path, "adamw")
    older = json.loads(run_cli(["inspect", path, "--for-torch", "2.7", "--json"], code=None).stdout)
    assert older["optimizers"][0]["missing_options"] == []
    assert older["verdict"] == ("repairable" if HAS_STRIDES else "healthy")
    document = json.loads(run_cli(["inspect", path, "--for-torch", "2.13.0+cu121", "--json"], code=1).stdout)
    assert document["optimizers"][0]["missing_options"] == [{"group": 0, "key": "decoupled_weight_decay"}]
    planned = json.loads(
        run_cli(["fix", path, "--out", tmp_path / "x", "--for-torch", "2.7", "--dry-run", "--json"], code=0).stdout
    )
    assert planned["added_options"] == [] and not (tmp_path / "x").exists()
    refused = run_cli(["inspect", path, "--for-torch", "latest"], code=2).stderr
    assert refused.count("\n") == 1 and "--for-torch takes a torch release such as 2.13, not 'latest'" in refused
