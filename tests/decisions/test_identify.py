"""Telling optimizers apart (``optim_repair.decisions.identify``) on the state dicts real torch optimizers write."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from optim_repair.decisions.identify import identify_optimizer
from optim_repair.decisions.optimizers import ParamSpec, fresh_state
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


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_identify_optimizer_on_a_trained_state_dict(variant: str) -> None:
    for sd in state_dicts(variant, steps=2):
        groups, entries = inventory(sd)
        assert identify_optimizer(groups, entries) == EXPECTED_NAME[variant]


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"adamax"}))
def test_identify_optimizer_on_a_cold_state_dict(variant: str) -> None:
    for sd in state_dicts(variant, steps=0):
        assert sd["state"] == {}
        groups, entries = inventory(sd)
        assert identify_optimizer(groups, entries) == EXPECTED_NAME[variant]


def test_cold_adamax_is_ambiguous_with_an_old_radam() -> None:
    # RAdam without 'decoupled_weight_decay' (older torch) has Adamax's options, and the two
    # create different state (exp_avg_sq vs exp_inf): with no populated entry, ask.
    for sd in state_dicts("adamax", steps=0):
        groups, entries = inventory(sd)
        with pytest.raises(RepairRefused) as raised:
            identify_optimizer(groups, entries, where="optimizer.pt")
    message = str(raised.value)
    assert message.startswith("cannot tell which optimizer wrote optimizer.pt: candidates radam, adamax;")
    assert "pass optimizer=NAME (one of: adam, adamw, nadam, radam, adamax, rmsprop," in message


def test_adam_and_adamw_are_told_apart_by_decoupled_weight_decay() -> None:
    base = (("lr", 1e-3), ("betas", (0.9, 0.999)), ("weight_decay", 0.0), ("amsgrad", False))
    adamw = ParamGroup(("w",), (*base, ("decoupled_weight_decay", True)))
    adam = ParamGroup(("w",), (*base, ("decoupled_weight_decay", False)))
    old = ParamGroup(("w",), base)  # older torch wrote the flag for neither
    assert identify_optimizer([adamw], []) == "adamw"
    assert identify_optimizer([adam], []) == "adam"
    assert identify_optimizer([old], []) == "adam"
    assert fresh_state("adam", old, ParamSpec("float32", (2,))) == fresh_state("adamw", old, ParamSpec("float32", (2,)))


def test_identify_optimizer_ignores_keys_no_optimizer_writes() -> None:
    (sd,) = state_dicts("nadam", steps=1)
    for group in sd["param_groups"]:
        group["initial_lr"] = group["lr"]  # an LR scheduler adds this
        group["name"] = "decay"  # trainers add their own
    assert identify_optimizer(*inventory(sd)) == "nadam"


def test_identify_optimizer_uses_state_keys_alone_when_there_are_no_options() -> None:
    (sd,) = state_dicts("adamax", steps=1)
    groups, entries = inventory(sd)
    bare = [ParamGroup(group.params) for group in groups]
    assert identify_optimizer(bare, entries) == "adamax"
    (sd,) = state_dicts("radam", steps=1)
    groups, entries = inventory(sd)
    # Adam and RAdam entries look alike, and so do their fills: not ambiguous.
    assert identify_optimizer([ParamGroup(g.params) for g in groups], entries) == "adam"


def test_identify_optimizer_refuses_an_unknown_optimizer() -> None:
    model = BranchNet()
    opt = torch.optim.Adagrad(model.parameters())
    groups, entries = inventory(copy.deepcopy(opt.state_dict()))
    with pytest.raises(
        RepairRefused, match=r"fit no lazily-initializing torch optimizer; pass optimizer=NAME \(one of: adam,"
    ):
        identify_optimizer(groups, entries)


def test_identify_optimizer_refuses_state_that_contradicts_the_options() -> None:
    (sd,) = state_dicts("adam", steps=1)
    (other,) = state_dicts("adamax", steps=1)
    groups, _ = inventory(sd)
    _, entries = inventory(other)
    with pytest.raises(RepairRefused, match="cannot tell which optimizer wrote"):
        identify_optimizer(groups, entries)
