"""``inspect --model``: each optimizer compared with a model, built from real runs whose names or shapes drifted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import optim_repair
from tests.conftest import run_cli
from tests.factories import trainers
from tests.factories.built import Built
from tests.factories.models import TwoHeadNet, make_optimizer, train


def named_state_dict(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by the names ``module.named_parameters()`` gives, as trainers that key
    their state by name do; for a ``torch.compile``d module every name has ``_orig_mod.``."""
    names = [name for name, _ in module.named_parameters()]
    saved = opt.state_dict()
    return {"state": {names[index]: entry for index, entry in saved["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in saved["param_groups"]]}  # fmt: skip


def _compiled_checkpoint(path: Path) -> TwoHeadNet:
    """A ``torch.compile``d model's run, its optimizer keyed by the compiled module's names (``_orig_mod.``)."""
    model = TwoHeadNet()
    compiled = torch.compile(model, backend="eager")
    opt = make_optimizer(compiled, "adamw")
    train(compiled, opt, 2, use_all=True)  # type: ignore[arg-type]
    optimizer = named_state_dict(compiled, opt)
    assert all(str(name).startswith("_orig_mod.") for name in optimizer["state"])
    torch.save({"optimizer_state_dict": optimizer}, path)
    return model


def test_a_compiled_models_names_are_explained_by_a_rename(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    model = _compiled_checkpoint(path)
    weights = tmp_path / "model.safetensors"
    trainers.save_safetensors(get_model_state_dict(model), weights)
    document = json.loads(run_cli(["inspect", path, "--model", weights, "--json"], code=1).stdout)
    (opt,) = document["optimizers"]
    found = opt["model"]
    assert found["not_in_model"] == [f"_orig_mod.{name}" for name, _ in model.named_parameters()]
    assert sorted(found["not_in_optimizer"]) == sorted(name for name, _ in model.named_parameters())
    assert found["rename"] == "^_orig_mod\\.=" and found["shape_mismatches"] == []
    assert (found["optimizer_params"], found["model_params"], found["by_index"]) == (6, 6, False)
    report = run_cli(["inspect", path, "--model", weights], code=1).stdout
    assert report.splitlines()[-1].endswith(f"--model {weights} --rename '^_orig_mod\\.='"), "the fix to run"
    compared = optim_repair.compare(path, weights).optimizers[0].model
    assert compared == optim_repair.inspect(path, model=weights).optimizers[0].model


def test_frozen_layers_are_listed_and_change_nothing(tmp_path: Path) -> None:
    model = TwoHeadNet()
    model.head_unused.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    train(model, opt, 2, use_all=True)
    path = tmp_path / "checkpoint.pt"
    torch.save({"policy_state_dict": get_model_state_dict(model),
                "optimizer_state_dict": get_optimizer_state_dict(model, opt)}, path)  # fmt: skip
    diagnosis = optim_repair.inspect(path)  # the weights beside the optimizer are its model
    (opt_diagnosis,) = diagnosis.optimizers
    assert opt_diagnosis.model is not None
    assert opt_diagnosis.model.not_in_optimizer == ("head_unused.weight", "head_unused.bias")
    assert opt_diagnosis.model.matches and diagnosis.verdict == "healthy"


def test_a_shape_that_disagrees_with_the_model_is_a_finding(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    model = _compiled_checkpoint(path)
    wider = {name: torch.zeros(3, *p.shape[1:]) if name == "trunk.weight" else p.detach()
             for name, p in model.named_parameters()}  # fmt: skip
    renamed = {f"_orig_mod.{name}": value for name, value in wider.items()}
    weights = tmp_path / "other.safetensors"
    trainers.save_safetensors(renamed, weights)
    document = json.loads(run_cli(["inspect", path, "--model", weights, "--json"], code=3).stdout)
    assert document["verdict"] == "malformed"
    mismatches = document["optimizers"][0]["model"]["shape_mismatches"]
    assert [(m["param"], m["key"], m["model_shape"]) for m in mismatches] == [
        ("_orig_mod.trunk.weight", "exp_avg", [3, 4]),
        ("_orig_mod.trunk.weight", "exp_avg_sq", [3, 4]),
    ]


def test_index_keys_are_compared_by_counts(hf_checkpoint: Built, tmp_path: Path) -> None:
    small = tmp_path / "small.safetensors"
    trainers.save_safetensors({"only.weight": torch.zeros(2)}, small)
    found = optim_repair.inspect(hf_checkpoint.path, model=small).optimizers[0].model
    assert found is not None and found.by_index and not found.matches
    assert (found.optimizer_params, found.model_params) == (6, 1)
    beside = optim_repair.inspect(hf_checkpoint.path).optimizers[0].model  # model.safetensors beside it
    assert beside is not None and beside.matches


def test_a_clean_comparison_changes_nothing(unirl_checkpoint: Built) -> None:
    diagnosis = optim_repair.inspect(unirl_checkpoint.path)
    (opt,) = diagnosis.optimizers
    assert opt.model is not None and opt.model.matches and opt.model.not_in_optimizer == ()
    assert diagnosis.verdict == "repairable", "the absent entries, as before"
