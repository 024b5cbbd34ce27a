"""Repair plans with --fill fresh: where parameter shapes come from, which optimizer, and refusals."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import optim_repair
from optim_repair.decisions.diagnose import diagnose
from optim_repair.decisions.repair import plan_repair
from optim_repair.errors import RepairRefused, UsageError
from optim_repair.records.repair_plan import FreshTensor
from tests.factories import models, trainers
from tests.factories.built import Built
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
    with pytest.raises(UsageError, match="fill must be 'auto', 'empty' or 'fresh'"):
        optim_repair.fix(built.path, tmp_path / "fixed", fill=fill)  # type: ignore[arg-type]
    assert not (tmp_path / "fixed").exists()


def test_a_directory_with_dcp_and_torch_files_gets_fresh_state_in_both_by_default(root: Path, tmp_path: Path) -> None:
    from tests.factories import dcp as dk

    built = trainers.unirl_torch(root)
    dk.unirl_dcp(built.path / "dcp")
    result = optim_repair.fix(built.path, tmp_path / "fixed")
    assert result.plan.fill == "fresh" and result.plan.fill_notes == ()
    by_file = {(a.file, bool(a.state)) for a in result.plan.additions}
    assert by_file == {("checkpoint.pt", True), ("dcp/checkpoint-3", True)}


def test_an_index_keyed_file_beside_a_dcp_checkpoint_gets_empty_entries_and_a_note(root: Path, tmp_path: Path) -> None:
    """Index keys name no parameters, so the default gives their file {} (which optimizer.load_state_dict resumes
    exactly) and says so; the DCP checkpoint beside it gets fresh state: the plan's fill is mixed."""
    from tests.factories import dcp as dk

    built = trainers.hf_trainer(root)
    dk.unirl_dcp(built.path / "dcp")
    result = optim_repair.fix(built.path, tmp_path / "fixed")
    assert result.plan.fill == "mixed"
    by_file = {(a.file, bool(a.state)) for a in result.plan.additions}
    assert by_file == {("optimizer.pt", False), ("dcp/checkpoint-3", True)}
    (note,) = result.plan.fill_notes
    assert note.startswith("optimizer.pt:<root>: {} for 2 parameter(s): index keys name no parameters")
    assert "optimizer.load_state_dict, the loader of index keys, keeps {} entries lazy and resumes exactly" in note


def test_name_keyed_state_without_model_weights_gets_empty_entries_and_says_where_they_resume(tmp_path: Path) -> None:
    """No file gives the shapes of the parameters without state: the default gives them {} and says why, and
    which loaders resume {} exactly (not torch's full-state loader); asking for fresh state is refused instead."""
    from tests.conftest import run_cli

    model = models.TwoHeadNet()
    opt = models.make_optimizer(model)
    models.train(model, opt, 2)
    path = tmp_path / "optimizer.pt"
    torch.save({"optimizer": get_optimizer_state_dict(model, opt)}, path)
    result = run_cli(["fix", path, "--out", tmp_path / "fixed.pt", "--json"], code=0)
    document = json.loads(result.stdout)
    assert document["fill"] == "empty"
    (note,) = document["fill_notes"]
    assert note.startswith(f"{path}:optimizer: {{}} for 2 parameter(s), as fresh state cannot be built (no ")
    assert "through optimizer.load_state_dict and set_optimizer_state_dict(full_state_dict=False)" in note
    assert "not through full_state_dict=True, which gives those parameters a phantom step=1" in note
    state = torch.load(tmp_path / "fixed.pt", weights_only=True)["optimizer"]["state"]
    assert state["head_unused.weight"] == {} and state["head_unused.bias"] == {}
    summary = run_cli(["fix", path, "--out", tmp_path / "again.pt"], code=0).stdout
    assert "as fresh state cannot be built" in summary
    run_cli(["fix", path, "--out", tmp_path / "fresh.pt", "--fill", "fresh"], code=3)


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_the_weights_saved_beside_the_optimizer_give_fresh_state_its_shapes(tmp_path: Path, layout: str) -> None:
    """accelerate's FSDP layouts: the model beside the optimizer in a file or DCP checkpoint of its own
    (``pytorch_model_fsdp.bin`` beside ``optimizer.bin``, ``pytorch_model_fsdp_0/`` beside ``optimizer_0/``)."""
    import torch.distributed.checkpoint as dcp

    model = models.TwoHeadNet()
    opt = models.make_optimizer(model)
    models.train(model, opt, 2)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    if layout == "full":
        torch.save(get_optimizer_state_dict(model, opt), checkpoint / "optimizer.bin")
        torch.save(model.state_dict(), checkpoint / "pytorch_model_fsdp.bin")
    else:
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=checkpoint / "optimizer_0")
        dcp.save({"model": model.state_dict()}, checkpoint_id=checkpoint / "pytorch_model_fsdp_0")
    result = optim_repair.fix(checkpoint, tmp_path / "fixed")
    assert result.plan.fill == "fresh" and result.plan.fill_notes == ()
    assert {(a.param, bool(a.state)) for a in result.plan.additions} == {
        ("head_unused.weight", True),
        ("head_unused.bias", True),
    }


def test_fresh_moments_take_the_dtype_the_optimizer_keeps_its_moments_in(tmp_path: Path) -> None:
    """torchtitan keeps Adam's moments in bf16 on fp32 parameters: the fresh moments are bf16 too, not the
    parameters' fp32, while a model whose moments follow its parameters gets its parameters' dtype."""
    model = models.TwoHeadNet()
    opt = models.make_optimizer(model)
    models.train(model, opt, 2)
    state_dict = copy.deepcopy(get_optimizer_state_dict(model, opt))  # its entries are the live optimizer's
    for entry in state_dict["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = entry[key].to(torch.bfloat16)
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": state_dict}, path)
    optim_repair.fix(path, tmp_path / "fixed.pt")
    added = torch.load(tmp_path / "fixed.pt", weights_only=True)["optimizer"]["state"]["head_unused.weight"]
    assert added["exp_avg"].dtype == added["exp_avg_sq"].dtype == torch.bfloat16
    assert added["step"].dtype == state_dict["state"]["trunk.weight"]["step"].dtype
    assert model.head_unused.weight.dtype == torch.float32 and added["exp_avg"].shape == (2, 8)
    torch.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}, path)
    optim_repair.fix(path, tmp_path / "follows.pt")
    added = torch.load(tmp_path / "follows.pt", weights_only=True)["optimizer"]["state"]["head_unused.weight"]
    assert added["exp_avg"].dtype == torch.float32


_EMPTY_RESUMES = (
    "{} resumes exactly through optimizer.load_state_dict and set_optimizer_state_dict(full_state_dict=False), not "
    "through full_state_dict=True, which gives those parameters a phantom step=1"
)


def _edited_state(built: Built, edit: Callable[[list[dict[str, Any]]], None]) -> None:
    """A real run's UniRL checkpoint, its optimizer's existing entries (in state order) edited in place by ``edit``."""
    path = built.path / "checkpoint.pt"
    original = torch.load(path, weights_only=True)
    edit(list(original["optimizer_state_dict"]["state"].values()))
    torch.save(original, path)


def _uint8_moments(entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = entry[key].to(torch.uint8)


def test_moments_no_torch_optimizer_keeps_get_empty_entries_saying_why(root: Path, tmp_path: Path) -> None:
    """AdamW's option keys with uint8 moments: no torch optimizer keeps integer moments (they are another library's
    quantized state), so the default gives {} saying why, in the summary and the JSON, and fresh state is refused,
    for the optimizer its keys name too."""
    from tests.conftest import run_cli
    from tests.faces.test_cli import fix_cli, one_error_line

    built = trainers.unirl_torch(root)
    _edited_state(built, _uint8_moments)
    reason = (
        "cannot identify the optimizer that wrote checkpoint.pt:optimizer_state_dict exactly, so fresh state is not "
        "given: the state of 'trunk.weight' keeps exp_avg as uint8, and no torch optimizer keeps a tensor that is "
        "not floating point"
    )
    note = f"checkpoint.pt:optimizer_state_dict: {{}} for 2 parameter(s), as fresh state cannot be built ({reason}); "
    document = json.loads(fix_cli(built.path, tmp_path / "fixed", "--json", code=0).stdout)
    assert document["fill"] == "empty" and document["fill_notes"] == [note + _EMPTY_RESUMES]
    assert [(a["param"], a["keys"], a["dtypes"]) for a in document["added"]] == [
        ("head_unused.weight", [], {}),
        ("head_unused.bias", [], {}),
    ]
    summary = run_cli(["fix", built.path, "--out", tmp_path / "again"], code=0).stdout
    assert note + _EMPTY_RESUMES in summary.splitlines()
    refused = fix_cli(built.path, tmp_path / "fresh", "--fill", "fresh", code=3)
    assert one_error_line(refused) == f"optim-repair: error: {reason}; pass --fill empty"
    named = fix_cli(built.path, tmp_path / "named", "--optimizer", "adamw", code=3)
    assert one_error_line(named) == (
        "optim-repair: error: checkpoint.pt:optimizer_state_dict: its state is not torch's AdamW's, so fresh state "
        "is not given: the state of 'trunk.weight' keeps exp_avg as uint8, and no torch optimizer keeps a tensor "
        "that is not floating point; pass --fill empty instead of naming the optimizer"
    )
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "named").exists()


def _python_float(step: torch.Tensor) -> object:
    return float(step)


def _float32(step: torch.Tensor) -> object:
    return step.float()


@pytest.mark.parametrize(
    ("second", "found"),
    [
        (_python_float, "a float64 tensor in 'trunk.weight', a Python float in 'trunk.bias', a float32 tensor in "
         "'head_used.weight'"),
        (_float32, "a float64 tensor in 'trunk.weight', a float32 tensor in 'trunk.bias'"),
    ],
    ids=["python-float", "float32-tensor"],
)  # fmt: skip
def test_steps_of_disagreeing_dtypes_give_no_fresh_state(
    root: Path, tmp_path: Path, second: Callable[[torch.Tensor], object], found: str
) -> None:
    """A float64 step in the first entry and a Python float (or a float32 tensor) in the second, float32 in the rest:
    the step of fresh state would be whichever comes first. The default gives {} saying why; fresh is refused."""
    from tests.faces.test_cli import fix_cli, one_error_line

    def edit(entries: list[dict[str, Any]]) -> None:
        entries[0]["step"] = entries[0]["step"].double()
        entries[1]["step"] = second(entries[1]["step"])

    built = trainers.unirl_torch(root)
    _edited_state(built, edit)
    reason = (
        f"checkpoint.pt:optimizer_state_dict: the existing entries' steps disagree ({found}), so fresh state has no "
        "one dtype for its step: torch keeps every step in one scalar dtype"
    )
    document = json.loads(fix_cli(built.path, tmp_path / "fixed", "--json", code=0).stdout)
    assert document["fill"] == "empty"
    assert document["fill_notes"] == [
        f"checkpoint.pt:optimizer_state_dict: {{}} for 2 parameter(s), as fresh state cannot be built "
        f"({reason.removeprefix('checkpoint.pt:optimizer_state_dict: ')}); {_EMPTY_RESUMES}"
    ]
    refused = fix_cli(built.path, tmp_path / "fresh", "--fill", "fresh", code=3)
    assert one_error_line(refused) == f"optim-repair: error: {reason}; pass --fill empty"
    assert not (tmp_path / "fresh").exists()


def test_a_fused_groups_float32_steps_do_not_set_the_scalar_dtype(tmp_path: Path) -> None:
    """A run in float64 with a fused AdamW group: fused Adam keeps a float32 step whatever the scalar dtype, the
    other groups float64. The entries of the fused group, first in the state, say nothing of the scalar dtype: the
    fresh step of a parameter of the other group is float64, as its own first step would make it."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = models.TwoHeadNet()
        rest = [*model.head_used.parameters(), *model.head_unused.parameters()]
        opt = torch.optim.AdamW([{"params": list(model.trunk.parameters()), "fused": True}, {"params": rest}], lr=1e-2)
        models.train(model, opt, 2)
        probe = torch.nn.Parameter(torch.zeros(2))
        probe.grad = torch.zeros(2)
        first = torch.optim.AdamW([probe], lr=1e-2)
        first.step()  # what a parameter's first step creates in this run
    finally:
        torch.set_default_dtype(default)
    state = get_optimizer_state_dict(model, opt)
    assert [entry["step"].dtype for entry in state["state"].values()] == [torch.float32] * 2 + [torch.float64] * 2
    path = tmp_path / "checkpoint.pt"
    torch.save({"policy_state_dict": model.state_dict(), "optimizer_state_dict": state}, path)
    result = optim_repair.fix(path, tmp_path / "fixed.pt")
    assert result.plan.fill == "fresh"
    added = torch.load(tmp_path / "fixed.pt", weights_only=True)["optimizer_state_dict"]["state"]["head_unused.weight"]
    assert added["step"].dtype == first.state[probe]["step"].dtype == torch.float64


@pytest.mark.parametrize("defect", ["uint8-moments", "disagreeing-steps"])
def test_where_fresh_state_is_not_given_a_dcp_checkpoint_is_refused_by_default(tmp_path: Path, defect: str) -> None:
    """DCP cannot store {}: where fresh state is not given (moments no torch optimizer keeps, steps that disagree)
    the default fill is refused, exit 3, with the reason and without naming --fill empty, which DCP refuses too."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from tests.faces.test_cli import fix_cli, one_error_line
    from tests.factories import dcp as dk

    run = dk.trained()
    optim = copy.deepcopy(get_optimizer_state_dict(run.model, run.optimizer))
    entries, names = list(optim["state"].values()), list(optim["state"])
    if defect == "uint8-moments":
        _uint8_moments(entries)
        reason = (
            f"cannot identify the optimizer that wrote {tmp_path / 'checkpoint'}:optim exactly, so fresh state is not "
            f"given: the state of {names[0]!r} keeps exp_avg as uint8, and no torch optimizer keeps a tensor that is "
            "not floating point"
        )
    else:
        entries[0]["step"] = entries[0]["step"].double()
        reason = (
            f"{tmp_path / 'checkpoint'}:optim: the existing entries' steps disagree (a float64 tensor in {names[0]!r}, "
            f"a float32 tensor in {names[1]!r}), so fresh state has no one dtype for its step: torch keeps every step "
            "in one scalar dtype"
        )
    save({"model": get_model_state_dict(run.model), "optim": optim}, checkpoint_id=tmp_path / "checkpoint")
    refused = fix_cli(tmp_path / "checkpoint", tmp_path / "fixed", code=3)
    assert one_error_line(refused) == f"optim-repair: error: {reason}"
    assert not (tmp_path / "fixed").exists()
