"""Telling optimizers apart (``optim_repair.decisions.identify``) on the state dicts real torch optimizers write."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from optim_repair.decisions.identify import (
    Identification,
    guess_optimizer,
    identify_optimizer,
    keeps_whole_optimizer_state,
)
from optim_repair.decisions.optimizers import OPTIMIZERS, SPECS, ParamSpec, fresh_state
from optim_repair.errors import RepairRefused
from optim_repair.records.inventory import ParamGroup, StateEntry, TensorMeta
from tests.factories.models import VARIANTS, BranchNet, branch_inputs, train_branches
from tests.factories.support import group_of


def inventory(sd: dict[str, Any]) -> tuple[list[ParamGroup], list[StateEntry]]:
    """A minimal stand-in for a reader: groups with options, entries with their keys."""

    def meta(value: object) -> Any:
        if isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            return TensorMeta(str(value.dtype)[6:], shape, tuple(value.stride()), "0", 0, 0)
        return value

    groups = [group_of(group) for group in sd["param_groups"]]
    entries = [
        StateEntry(param=key, values=tuple((k, meta(v)) for k, v in entry.items()))
        for key, entry in sd["state"].items()
    ]
    return groups, entries


def state_dicts(variant: str, steps: int) -> Iterator[dict[str, Any]]:
    _, cls, kwargs = VARIANTS[variant]
    torch.manual_seed(0)
    model = BranchNet()
    opt = cls(model.parameters(), **kwargs)
    train_branches(model, opt, branch_inputs(steps, seed=1), use_extra=False)
    yield copy.deepcopy(opt.state_dict())


EXPECTED_NAME = {variant: spec for variant, (spec, _, _) in VARIANTS.items()}


def trained(opt_cls: Any, steps: int = 2, **kwargs: Any) -> dict[str, Any]:
    """``optimizer.state_dict()`` of a real optimizer from another library after ``steps`` steps on ``BranchNet``."""
    torch.manual_seed(0)
    model = BranchNet()
    opt = opt_cls(model.parameters(), **kwargs)
    train_branches(model, opt, branch_inputs(steps, seed=1), use_extra=False)
    return copy.deepcopy(opt.state_dict())


def refusal(sd: dict[str, Any]) -> str:
    with pytest.raises(RepairRefused) as raised:
        identify_optimizer(*inventory(sd), where="optimizer.pt")
    message = str(raised.value)
    assert message.startswith("cannot identify the optimizer that wrote optimizer.pt exactly, so fresh state is not")
    assert message.endswith(f"; pass optimizer=NAME (one of: {', '.join(OPTIMIZERS)})")
    return message


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_identify_optimizer_on_a_trained_state_dict(variant: str) -> None:
    for sd in state_dicts(variant, steps=2):
        groups, entries = inventory(sd)
        assert identify_optimizer(groups, entries) == Identification(EXPECTED_NAME[variant], EXPECTED_NAME[variant])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_identify_optimizer_on_a_cold_state_dict(variant: str) -> None:
    for sd in state_dicts(variant, steps=0):
        assert sd["state"] == {}
        groups, entries = inventory(sd)
        assert identify_optimizer(groups, entries).name == EXPECTED_NAME[variant]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_registry_holds_the_option_keys_the_installed_torch_writes(variant: str) -> None:
    name = VARIANTS[variant][0]
    (sd,) = state_dicts(variant, steps=0)
    assert {frozenset(group) - {"params"} for group in sd["param_groups"]} <= OPTIMIZERS[name].option_sets


def test_only_adam_and_adamw_share_option_keys() -> None:
    shared = {(a.name, b.name) for a in SPECS for b in SPECS if a.name < b.name and a.option_sets & b.option_sets}
    assert shared == {("adam", "adamw")}


def test_adam_and_adamw_are_told_apart_only_by_decoupled_weight_decay() -> None:
    (sd,) = state_dicts("adamw", steps=1)  # weight_decay=0.1
    assert identify_optimizer(*inventory(sd)) == Identification("adamw", "adamw")
    for group in sd["param_groups"]:
        group["decoupled_weight_decay"] = False
    assert identify_optimizer(*inventory(sd)) == Identification("adam", "adam")
    for group in sd["param_groups"]:
        del group["decoupled_weight_decay"]  # what torch before 2.8 wrote, for Adam and AdamW alike
    old = identify_optimizer(*inventory(sd))
    assert old.kind == "adam or adamw"
    groups, _ = inventory(sd)
    probe = ParamSpec("float32", (2,))
    assert fresh_state(old.name, groups[0], probe) == fresh_state("adam", groups[0], probe)


def test_identify_optimizer_sets_aside_the_keys_lr_schedulers_add() -> None:
    torch.manual_seed(0)
    model = BranchNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    train_branches(model, opt, branch_inputs(1, seed=1), use_extra=False)
    scheduler.step()
    sd = copy.deepcopy(opt.state_dict())
    assert {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"} <= set(sd["param_groups"][0])
    assert identify_optimizer(*inventory(sd)).name == "sgd"


def test_a_key_no_torch_optimizer_writes_is_not_guessed_past() -> None:
    (sd,) = state_dicts("nadam", steps=1)
    for group in sd["param_groups"]:
        group["name"] = "decay"  # a trainer's own label
    assert "of param group 0 (" in refusal(sd)
    assert "are not the ones torch's NAdam writes: it has name;" in refusal(sd)


def test_groups_without_options_are_not_identified_from_state_keys_alone() -> None:
    (sd,) = state_dicts("adamax", steps=1)
    for group in sd["param_groups"]:
        for key in [k for k in group if k != "params"]:
            del group[key]
    assert "param group 0 records no options;" in refusal(sd)


def test_torchao_adamw8bit_is_not_taken_for_adam() -> None:
    """torchao's AdamW8bit writes five of Adam's option keys, and its own state (``OptimState8bit`` for
    parameters of 4096 elements or more; BranchNet's are smaller, so its entries look like Adam's)."""
    torchao_optim = pytest.importorskip("torchao.optim")
    sd = trained(torchao_optim.AdamW8bit, lr=1e-2)
    assert set(sd["param_groups"][0]) - {"params"} == {"lr", "betas", "eps", "weight_decay", "amsgrad"}
    assert "torch's Adam writes: it lacks capturable, differentiable, foreach, fused, maximize;" in refusal(sd)


def test_pytorch_optimizer_lars_is_not_taken_for_sgd() -> None:
    lars = pytest.importorskip("pytorch_optimizer").LARS
    sd = trained(lars, lr=0.1)
    assert (
        "not the ones torch's SGD writes: it lacks differentiable, fused, maximize and has step, trust_coefficient;"
        in (refusal(sd))
    )


@pytest.mark.parametrize("library", ["transformers", "pytorch_optimizer"])
def test_factored_optimizers_of_other_libraries_are_not_identified(library: str) -> None:
    if library == "transformers":
        opt_cls = pytest.importorskip("transformers.optimization").Adafactor
        sd = trained(opt_cls, lr=1e-2, relative_step=False, scale_parameter=False)
    else:
        sd = trained(pytest.importorskip("pytorch_optimizer").CAME)
    refusal(sd)


def test_identify_optimizer_refuses_an_eager_optimizer() -> None:
    model = BranchNet()
    opt = torch.optim.Adagrad(model.parameters())
    assert "not the ones torch's" in refusal(copy.deepcopy(opt.state_dict()))


def test_identify_optimizer_refuses_state_that_contradicts_the_options() -> None:
    (sd,) = state_dicts("adam", steps=1)
    (other,) = state_dicts("adamax", steps=1)
    sd["state"] = other["state"]
    message = refusal(sd)
    assert "its options are torch's Adam's, but the state of 0 has keys exp_avg, exp_inf, step, which Adam" in message


def test_groups_of_different_optimizers_are_refused() -> None:
    (adam,) = state_dicts("adam", steps=0)
    (sgd,) = state_dicts("sgd", steps=0)
    adam["param_groups"].append(dict(sgd["param_groups"][0], params=[9]))
    assert "its param groups hold the option keys of different torch optimizers;" in refusal(adam)


def test_lbfgs_keeps_whole_optimizer_state() -> None:
    torch.manual_seed(0)
    model = BranchNet()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x = branch_inputs(1, seed=1)[0]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x, False).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    groups, entries = inventory(copy.deepcopy(opt.state_dict()))
    assert [entry.param for entry in entries] == [0]
    assert keeps_whole_optimizer_state(groups)
    assert not keeps_whole_optimizer_state(inventory(next(state_dicts("sgd", steps=1)))[0])


def test_state_that_keeps_a_tensor_no_torch_optimizer_keeps_is_not_identified() -> None:
    """Every moment torch's optimizers keep is floating point (bf16 and fp16 ones, fp64, complex for complex
    parameters); AdamW's keys holding integer or bool moments are another library's quantized state."""
    (sd,) = state_dicts("adamw", steps=1)
    for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.uint8, torch.int32, torch.bool):
        cast = copy.deepcopy(sd)
        for entry in cast["state"].values():
            entry["exp_avg"] = entry["exp_avg"].to(dtype)
        groups, entries = inventory(cast)
        if dtype.is_floating_point or dtype.is_complex:
            assert identify_optimizer(groups, entries) == Identification("adamw", "adamw"), dtype
            continue
        assert guess_optimizer(groups, entries) is None
        with pytest.raises(RepairRefused) as raised:
            identify_optimizer(groups, entries, where="optimizer.pt")
        assert str(raised.value) == (
            "cannot identify the optimizer that wrote optimizer.pt exactly, so fresh state is not given: the state "
            f"of 0 keeps exp_avg as {str(dtype)[6:]}, and no torch optimizer keeps a tensor that is not floating point"
        )
