"""Flattened optimizer state dicts in torch files (``flatten_optimizer_state_dict=True``, then ``torch.save``).

Keys like ``state.blocks.0.attn.to_q.weight.exp_avg`` and ``param_groups.head.proj.bias.lr`` (pytorch#192224,
verl#7283): read, diagnosed and repaired like the nested form, resumed through torch's own loader.
"""

from __future__ import annotations

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
from tests.factories import dcp as dk
from tests.factories import trainers
from tests.factories.models import make_optimizer, train
from tests.factories.support import assert_nothing_written, untouched
from tests.factories.versions import TORCH

FLATTENED_REFUSAL = (TypeError, "float") if TORCH >= (2, 10) else (KeyError, r"^'state\.head\.proj\.")
"""What torch's flattened loader raises on absent entries: from torch 2.10 it rebuilds each as ``{}`` and
fails to make a float of it; before, it looks up the flattened key, ``state.<name>.<state key>``, and fails."""


def _save_flattened(path: Path, *, with_model: bool) -> None:
    """verl-style ``{"model", "optimizer"}``, or the flattened optimizer state dict alone."""
    run = dk.trained("adamw")
    optimizer = get_optimizer_state_dict(run.model, run.optimizer, options=dk.options(True))
    torch.save({"model": get_model_state_dict(run.model), "optimizer": optimizer} if with_model else optimizer, path)


def _resume(path: Path, address: tuple[str, ...], weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Stock torch: load the file, then ``set_optimizer_state_dict(flatten_optimizer_state_dict=True)``."""
    model = dk.DeepNet(seed=7)
    opt = make_optimizer(model, "adamw")
    saved = torch.load(path, weights_only=True)
    for key in address:
        saved = saved[key]
    set_model_state_dict(model, weights)
    set_optimizer_state_dict(model, opt, saved, options=dk.options(True))
    train(model, opt, dk.POST_STEPS, use_all=True, seed=1)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_flattened_torch_file_is_read_like_the_nested_form(tmp_path: Path) -> None:
    flat, nested = tmp_path / "flat.pt", tmp_path / "nested.pt"
    _save_flattened(flat, with_model=True)
    run = dk.trained("adamw")
    torch.save({"model": get_model_state_dict(run.model),
                "optimizer": get_optimizer_state_dict(run.model, run.optimizer)}, nested)  # fmt: skip
    diagnosis = optim_repair.inspect(flat)
    (opt,) = diagnosis.optimizers
    (reference,) = optim_repair.inspect(nested).optimizers
    assert (opt.location, opt.key_style, opt.layout, opt.loader) == (
        "optimizer",
        "name",
        "flattened",
        "set_optimizer_state_dict",
    )
    assert opt.missing == dk.HEAD and diagnosis.verdict == "repairable"
    assert [n.code for n in opt.notices] == ["flattened-missing-state"]
    assert [(g.params, g.options) for g in opt.optimizer.groups] == [
        (g.params, g.options) for g in reference.optimizer.groups
    ]
    assert opt.optimizer.entries == reference.optimizer.entries


def test_the_notice_names_what_torch_raises_on_either_side_of_2_10(tmp_path: Path) -> None:
    """It said TypeError alone, which torch before 2.10 does not raise (it raises a KeyError)."""
    path = tmp_path / "checkpoint.pt"
    _save_flattened(path, with_model=True)
    (opt,) = optim_repair.inspect(path).optimizers
    (detail,) = [n.detail for n in opt.notices if n.code == "flattened-missing-state"]
    assert 'fails on the 2 absent entries ("TypeError: float() argument must be a string or a real number' in detail
    assert "not 'dict'\" from torch 2.10, a KeyError of the absent flattened key before)" in detail
    error, match = FLATTENED_REFUSAL
    with pytest.raises(error, match=match):  # what the notice says, on the installed torch
        _resume(path, ("optimizer",), torch.load(path, weights_only=True)["model"])


def test_torch_refuses_it_and_a_fix_resumes_bit_identically(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    _save_flattened(path, with_model=True)
    weights = torch.load(path, weights_only=True)["model"]
    error, match = FLATTENED_REFUSAL
    with pytest.raises(error, match=match):
        _resume(path, ("optimizer",), weights)
    out = tmp_path / "fixed.pt"
    with untouched(path):
        document = json.loads(run_cli(["fix", path, "--out", out, "--json"]).stdout)
    assert document["fill"] == "fresh", "a flattened dict cannot hold {}: fresh state is its default"
    assert sorted(a["param"] for a in document["added"]) == sorted(dk.HEAD)
    resumed = _resume(out, ("optimizer",), weights)
    expected = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
    (fixed,) = optim_repair.inspect(out).optimizers
    assert fixed.missing == () and fixed.layout == "flattened"
    saved = torch.load(out, weights_only=True)["optimizer"]
    assert [key for key in saved if key.startswith("state.head.proj.bias.")] == [
        "state.head.proj.bias.step",
        "state.head.proj.bias.exp_avg",
        "state.head.proj.bias.exp_avg_sq",
    ]


def test_the_empty_fill_is_refused_and_shapes_come_from_a_model(tmp_path: Path) -> None:
    alone = tmp_path / "optimizer.pt"
    _save_flattened(alone, with_model=False)
    out = tmp_path / "fixed.pt"
    refused = run_cli(["fix", alone, "--out", out, "--fill", "empty"], code=3)
    assert "cannot be stored in a flattened optimizer state dict" in refused.stderr
    assert_nothing_written(out)
    no_shapes = run_cli(["fix", alone, "--out", out], code=3)
    assert "the checkpoint holds no model weights; pass --model PATH" in no_shapes.stderr
    model = tmp_path / "model.safetensors"
    trainers.save_safetensors(get_model_state_dict(dk.trained("adamw").model), model)
    run_cli(["fix", alone, "--out", out, "--model", model])
    resumed = _resume(out, (), get_model_state_dict(dk.trained("adamw").model))
    expected = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
