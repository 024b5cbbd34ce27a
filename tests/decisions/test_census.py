"""The step census: a real AdamW run in which one branch gets a gradient on every step, an expert on some steps
only, and a head on none, saved as UniRL saves it (``get_optimizer_state_dict``, ``torch.save``). inspect names the
expert as lagging, with the head at step 0; in JSON every parameter's step, on an 80-column terminal the worst few."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from optim_repair.decisions.census import step_census
from optim_repair.formats.dcp import read_dcp
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories.terminal import run_in_terminal

STEPS = 6
EXPERT_EVERY = 3
"""The expert gets a gradient on every third step: two of six."""


def _saved(root: Path) -> Path:
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "expert": nn.Linear(4, 4), "head": nn.Linear(4, 2)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        hidden = torch.tanh(model["body"](x))
        if step % EXPERT_EVERY == 0:
            hidden = model["expert"](hidden)
        hidden.pow(2).mean().backward()
        optimizer.step()
    root.mkdir()
    path = root / "checkpoint.pt"
    torch.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}, path)
    return path


def test_every_parameters_step_is_in_json_and_the_laggards_are_named(tmp_path: Path) -> None:
    path = _saved(tmp_path / "run")
    document = json.loads(run_cli(["inspect", path, "--json"], code=1).stdout)
    (optimizer,) = document["optimizers"]
    census = optimizer["census"]
    steps = {entry["param"]: entry["step"] for entry in census["steps"]}
    assert steps == {
        "body.weight": STEPS, "body.bias": STEPS, "expert.weight": 2, "expert.bias": 2, "head.weight": 0,
        "head.bias": 0,
    }  # fmt: skip
    assert census["largest"] == STEPS and census["distribution"] == [[STEPS, 2], [2, 2], [0, 2]]
    assert [entry["param"] for entry in census["lagging"]] == [
        "head.weight",
        "head.bias",
        "expert.weight",
        "expert.bias",
    ]
    (notice,) = [notice for notice in optimizer["notices"] if notice["code"] == "lagging-steps"]
    assert notice["severity"] == "info"
    assert "4 of 6 parameters lag behind the optimizer's largest step (6): head.weight (0), head.bias (0), "
    assert "expert.weight (2), expert.bias (2)" in notice["detail"]


def test_no_census_where_no_step_is_read(tmp_path: Path) -> None:
    """DCP: inspect never reads its tensors, so no step value is known, and no census is made up."""
    built = dk.unirl_dcp(tmp_path)
    (optimizer,) = read_dcp(built.path, "").optimizers
    assert step_census(optimizer, ()) is None
    document = json.loads(run_cli(["inspect", built.path, "--json"], code=1).stdout)
    assert document["optimizers"][0]["census"] is None


def test_on_an_80_column_terminal_the_laggards_are_named_within_the_width(tmp_path: Path) -> None:
    _saved(tmp_path / "run")  # named from where it is run: the fix command at the end fits too
    code, lines = run_in_terminal(["inspect", "run/checkpoint.pt", "--color", "never"], cwd=tmp_path)
    assert code == 1
    assert all(len(line) <= 80 for line in lines), lines
    text = " ".join(" ".join(lines).split())
    assert "lagging-steps" in text and "expert.weight (2)" in text and "head.weight (0)" in text
