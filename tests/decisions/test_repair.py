"""Repair plans with --fill fresh: where parameter shapes come from, which optimizer, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import optim_repair
from optim_repair.decisions.diagnose import diagnose
from optim_repair.decisions.repair import plan_repair
from optim_repair.errors import RepairRefused, UsageError
from optim_repair.records.repair_plan import FreshTensor
from tests.factories import models, trainers
from tests.factories.support import read_checkpoint


def _optimizer_only(root: Path, optimizer: str = "adamw") -> tuple[Path, models.Run]:
    """A name-keyed optimizer saved alone, with no model weights in the file."""
    r = models.run(optimizer=optimizer)
    path = root / "optimizer.pt"
    torch.save({"optimizer": get_optimizer_state_dict(r.model, r.optimizer)}, path)
    return path, r


def test_fresh_takes_shapes_from_the_model_weights_in_the_same_file(root: Path, tmp_path: Path) -> None:
    built = trainers.unirl_torch(root)
    result = optim_repair.fix(built.path, tmp_path / "fixed", fill="fresh")
    state = torch.load(tmp_path / "fixed" / "checkpoint.pt", weights_only=True)["optimizer_state_dict"]["state"]
    weights = torch.load(built.path / "checkpoint.pt", weights_only=True)["policy_state_dict"]
    assert [a.param for a in result.plan.additions] == list(built.all_missing)
    for name in built.all_missing:
        entry = state[name]
        assert list(entry) == ["step", "exp_avg", "exp_avg_sq"]
        assert entry["step"].dtype == torch.float32 and entry["step"].shape == () and entry["step"].item() == 0
        for key in ("exp_avg", "exp_avg_sq"):
            assert entry[key].shape == weights[name].shape and entry[key].dtype == weights[name].dtype
            assert not entry[key].any()
    assert result.plan.optimizers == (("checkpoint.pt", "optimizer_state_dict", "adamw"),)


def test_fresh_without_shapes_is_refused_and_says_how_to_provide_them(root: Path, tmp_path: Path) -> None:
    path, _ = _optimizer_only(root)
    with pytest.raises(RepairRefused, match=r"pass model=PATH with the model's weights"):
        optim_repair.fix(path, tmp_path / "fixed.pt", fill="fresh")
    assert not (tmp_path / "fixed.pt").exists()


@pytest.mark.parametrize("source", ["safetensors", "torch"])
def test_fresh_takes_shapes_from_model(root: Path, tmp_path: Path, source: str) -> None:
    path, r = _optimizer_only(root)
    model = tmp_path / ("model.safetensors" if source == "safetensors" else "weights.pt")
    if source == "safetensors":
        trainers.save_safetensors(r.model.state_dict(), model)
    else:
        torch.save({"state_dict": r.model.state_dict()}, model)
    optim_repair.fix(path, tmp_path / "fixed.pt", fill="fresh", model=model)
    state = torch.load(tmp_path / "fixed.pt", weights_only=True)["optimizer"]["state"]
    assert state["head_unused.weight"]["exp_avg"].shape == r.model.head_unused.weight.shape


def test_fresh_reads_a_model_safetensors_beside_a_file_argument(root: Path, tmp_path: Path) -> None:
    path, r = _optimizer_only(root)
    trainers.save_safetensors(r.model.state_dict(), root / "model.safetensors")
    optim_repair.fix(path, tmp_path / "fixed.pt", fill="fresh")
    state = torch.load(tmp_path / "fixed.pt", weights_only=True)["optimizer"]["state"]
    assert state["head_unused.bias"]["exp_avg_sq"].shape == r.model.head_unused.bias.shape


def test_fresh_on_index_keys_is_refused_naming_the_reason_and_the_alternative(root: Path, tmp_path: Path) -> None:
    built = trainers.hf_trainer(root)
    with pytest.raises(RepairRefused, match=r"index-keyed.*pass fill='empty'"):
        optim_repair.fix(built.path, tmp_path / "fixed", fill="fresh")


@pytest.mark.parametrize(
    ("optimizer", "keys"),
    [
        ("nadam", ["step", "mu_product", "exp_avg", "exp_avg_sq"]),
        ("rprop", ["step", "prev", "step_size"]),
        ("asgd", ["step", "eta", "mu", "ax"]),
        ("sgd_momentum", ["momentum_buffer"]),
    ],
)
def test_fresh_state_is_identified_from_the_checkpoint(root: Path, optimizer: str, keys: list[str]) -> None:
    built = trainers.unirl_torch(root, optimizer=optimizer)
    plan = plan_repair(diagnose(read_checkpoint(built.path)), "fresh")
    assert {tuple(key for key, _ in a.state) for a in plan.additions} == {tuple(keys)}


def test_rprop_step_size_comes_from_the_params_group(root: Path) -> None:
    built = trainers.unirl_torch(root, optimizer="rprop", groups=2)
    diagnosis = diagnose(read_checkpoint(built.path))
    plan = plan_repair(diagnosis, "fresh")
    groups = diagnosis.optimizers[0].optimizer.groups
    for addition in plan.additions:
        step_size = dict(addition.state)["step_size"]
        group = next(g for g in groups if addition.param in g.params)
        assert isinstance(step_size, FreshTensor) and step_size.fill == group.option("lr")


def test_unknown_optimizer_is_refused_listing_the_choices(root: Path, tmp_path: Path) -> None:
    model = models.TwoHeadNet()
    optimizer = torch.optim.Adagrad(model.parameters())
    models.train(model, optimizer, 2)
    state = get_optimizer_state_dict(model, optimizer)
    del state["state"]["head_unused.weight"]  # Adagrad creates state eagerly: remove one entry
    path = root / "adagrad.pt"
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    with pytest.raises(RepairRefused, match=r"pass optimizer=NAME.*adamw"):
        optim_repair.fix(path, tmp_path / "fixed.pt", fill="fresh")
    with pytest.raises(UsageError, match=r"optimizer 'lion' is not one of: adam, adamw"):
        optim_repair.fix(path, tmp_path / "fixed.pt", fill="fresh", optimizer="lion")


def test_optimizer_override_is_used(root: Path) -> None:
    built = trainers.unirl_torch(root, optimizer="adam")
    plan = plan_repair(diagnose(read_checkpoint(built.path)), "fresh", optimizer="nadam")
    assert plan.optimizers[0][2] == "nadam"
    assert "mu_product" in dict(plan.additions[0].state)


def test_optimizer_without_fresh_is_a_usage_error(root: Path) -> None:
    built = trainers.unirl_torch(root)
    with pytest.raises(UsageError):
        plan_repair(diagnose(read_checkpoint(built.path)), "empty", optimizer="adamw")


def test_fresh_scalar_dtype_follows_the_existing_steps(root: Path, tmp_path: Path) -> None:
    built = trainers.unirl_torch(root)
    original = torch.load(built.path / "checkpoint.pt", weights_only=True)
    for entry in original["optimizer_state_dict"]["state"].values():
        entry["step"] = entry["step"].double()
    torch.save(original, built.path / "checkpoint.pt")
    optim_repair.fix(built.path, tmp_path / "fixed", fill="fresh")
    state = torch.load(tmp_path / "fixed" / "checkpoint.pt", weights_only=True)["optimizer_state_dict"]["state"]
    assert state["head_unused.weight"]["step"].dtype == torch.float64


@pytest.mark.parametrize("fill", ["bogus", "EMPTY"])
def test_the_api_refuses_an_unknown_fill(root: Path, tmp_path: Path, fill: str) -> None:
    built = trainers.unirl_torch(root)
    with pytest.raises(UsageError, match="fill must be 'empty' or 'fresh'"):
        optim_repair.fix(built.path, tmp_path / "fixed", fill=fill)  # type: ignore[arg-type]
    assert not (tmp_path / "fixed").exists()


def test_a_directory_with_dcp_and_torch_files_gets_each_formats_default(root: Path, tmp_path: Path) -> None:
    from tests.factories import dcp as dk

    built = trainers.unirl_torch(root)
    dk.unirl_dcp(built.path / "dcp")
    result = optim_repair.fix(built.path, tmp_path / "fixed")
    assert result.plan.fill == "mixed"
    by_file = {(a.file, bool(a.state)) for a in result.plan.additions}
    assert by_file == {("checkpoint.pt", False), ("dcp/checkpoint-3", True)}
