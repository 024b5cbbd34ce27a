"""``optim_repair.torch_loader.set_optimizer_state_dict`` against an uninterrupted run.

A model whose ``extra`` branch gets no gradient before the checkpoint has no optimizer state
for it; after the resume every branch trains. The run resumed through our loader must end
bit-identical (``torch.equal``) to the run that never stopped, for every lazily-initialized
optimizer, for sparse and ``{}``-filled dicts, and with ``full_state_dict`` True and False.
torch's own loader, given ``{}``, does not: that is why the loader exists.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from optim_repair.errors import RepairRefused
from optim_repair.torch_loader import set_optimizer_state_dict
from tests.factories.models import BranchNet, MatrixMuon, TorchAdafactor, branch_inputs
from tests.factories.versions import MISSING_STATE_ERROR, NO_DEVICE_MATCH, missing_state_match

VARIANTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "rmsprop-centered-momentum": (torch.optim.RMSprop, {"lr": 1e-2, "centered": True, "momentum": 0.9}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2}),
    "sgd-dampening": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "adadelta": (torch.optim.Adadelta, {"lr": 0.5}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2, "t0": -1.0}),
    "rprop": (torch.optim.Rprop, {"lr": 3e-3}),
    "adafactor": (TorchAdafactor, {"lr": 1e-2}),
    "muon": (MatrixMuon, {"lr": 1e-2}),
}


EXTRA = ("extra.weight", "extra.bias")

Optimizers = tuple[torch.optim.Optimizer, ...]
Make = Callable[[BranchNet], Optimizers]
Load = Callable[[BranchNet, Optimizers, dict[str, Any]], None]


def train(model: BranchNet, optims: Optimizers, xs: list[torch.Tensor], use_extra: bool) -> None:
    for x in xs:
        for opt in optims:
            opt.zero_grad(set_to_none=True)
        model(x, use_extra).pow(2).mean().backward()
        for opt in optims:
            opt.step()


def by_name(model: nn.Module, optims: Optimizers) -> dict[str, Any]:
    """The optimizers' state keyed by parameter names, as torch's DSD API keys it.

    Built from ``optimizer.state_dict()`` rather than ``get_optimizer_state_dict``, which runs a
    fake step on a cold optimizer and would change the uninterrupted run it is taken from.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    result: dict[str, Any] = {"state": {}, "param_groups": []}
    for opt in optims:
        params = [p for group in opt.param_groups for p in group["params"]]
        sd = copy.deepcopy(opt.state_dict())
        result["state"].update({names[id(params[i])]: entry for i, entry in sd["state"].items()})
        result["param_groups"] += [
            dict(group, params=[names[id(params[i])] for i in group["params"]]) for group in sd["param_groups"]
        ]
    return result


def single(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> Make:
    return lambda model: (cls(model.parameters(), **kwargs),)


def run(
    make: Make,
    load: Load,
    *,
    before: int = 3,
    checkpoint_of: Callable[[BranchNet, Optimizers], dict[str, Any]] = by_name,
    warm_resume: bool = False,
    expect_stateless: bool = True,
    after_checkpoint: Callable[[Optimizers], None] = lambda optims: None,
) -> tuple[BranchNet, Optimizers]:
    """Train ``before`` steps without ``extra``, checkpoint, train 3 steps with it; resume the
    checkpoint through ``load`` and check that it ends exactly where the reference does."""
    torch.manual_seed(0)
    reference = BranchNet()
    ref_optims = make(reference)
    train(reference, ref_optims, branch_inputs(before, seed=1), use_extra=False)
    weights = copy.deepcopy(reference.state_dict())
    checkpoint = checkpoint_of(reference, ref_optims)
    assert not any(name in checkpoint.get("state", {}) for name in EXTRA)
    after_checkpoint(ref_optims)
    train(reference, ref_optims, branch_inputs(3, seed=2), use_extra=True)

    resumed = BranchNet()
    optims = make(resumed)
    if warm_resume:  # the optimizer already has state, for every param, before the load
        train(resumed, optims, branch_inputs(2, seed=3), use_extra=True)
    resumed.load_state_dict(weights)
    load(resumed, optims, checkpoint)
    extra = [p for n, p in resumed.named_parameters() if n in EXTRA]
    for opt in optims:
        assert not expect_stateless or not any(p in opt.state for p in extra), "never-stepped params have no state"
    after_checkpoint(optims)
    train(resumed, optims, branch_inputs(3, seed=2), use_extra=True)

    for (name, expected), actual in zip(reference.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(actual, expected), name
    expected_state = by_name(reference, ref_optims)["state"]
    actual_state = by_name(resumed, optims)["state"]
    assert sorted(actual_state) == sorted(expected_state)
    for name, entry in expected_state.items():
        assert list(actual_state[name]) == list(entry), name
        for key, value in entry.items():
            got = actual_state[name][key]
            assert (got is None and value is None) or torch.equal(got, value), f"{name}.{key}"
    return resumed, optims


def ours(full: bool, **more: Any) -> Load:
    def load(model: BranchNet, optims: Optimizers, checkpoint: dict[str, Any]) -> None:
        options = StateDictOptions(full_state_dict=full, **more)
        set_optimizer_state_dict(model, optims if len(optims) > 1 else optims[0], checkpoint, options=options)

    return load


def with_empty_entries(load: Load) -> Load:
    """Load after filling the missing entries with ``{}`` (what a naive repair writes)."""

    def filled(model: BranchNet, optims: Optimizers, checkpoint: dict[str, Any]) -> None:
        checkpoint = copy.deepcopy(checkpoint)
        for group in checkpoint["param_groups"]:
            for name in group["params"]:
                checkpoint["state"].setdefault(name, {})
        load(model, optims, checkpoint)

    return filled


@pytest.mark.parametrize("full", [True, False], ids=["full", "sharded"])
@pytest.mark.parametrize("style", ["sparse", "empty"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_resume_is_bit_identical(variant: str, style: str, full: bool) -> None:
    load = ours(full)
    run(single(*VARIANTS[variant]), with_empty_entries(load) if style == "empty" else load)


def stock(full: bool) -> Load:
    def load(model: BranchNet, optims: Optimizers, checkpoint: dict[str, Any]) -> None:
        dsd.set_optimizer_state_dict(model, optims, checkpoint, options=StateDictOptions(full_state_dict=full))

    return load


def test_stock_loader_with_empty_entries_diverges_for_adamw() -> None:
    """torch gives ``{}`` entries the phantom state of its fake step: step=1, so AdamW's first
    real update of ``extra`` uses step 2's bias correction and the run diverges."""
    make = single(*VARIANTS["adamw"])
    with pytest.raises(AssertionError, match=r"torch\.equal"):  # the parameters differ
        run(make, with_empty_entries(stock(full=True)), expect_stateless=False)

    torch.manual_seed(0)
    model = BranchNet()
    (opt,) = make(model)
    train(model, (opt,), branch_inputs(1, seed=1), use_extra=False)
    checkpoint = by_name(model, (opt,))
    resumed = BranchNet()
    (cold,) = make(resumed)  # the phantom comes from torch's fake step on a cold optimizer
    with_empty_entries(stock(full=True))(resumed, (cold,), checkpoint)
    assert cold.state[resumed.extra.weight]["step"] == 1
    assert not cold.state[resumed.extra.weight]["exp_avg"].any()


def test_stock_loader_with_empty_entries_and_the_default_options_resumes_exactly() -> None:
    """Without ``full_state_dict=True`` torch loads ``{}`` through ``optimizer.load_state_dict``, which keeps
    an empty entry lazy: no phantom step."""
    run(single(*VARIANTS["adamw"]), with_empty_entries(stock(full=False)), expect_stateless=False)


@pytest.mark.parametrize("variant", ["adafactor", "muon"])
def test_what_the_stock_loaders_phantom_step_does_to_adafactor_and_muon(variant: str) -> None:
    """What ``decisions.notices`` says: the phantom step moves Adafactor's clock (step=1), and leaves Muon's
    zero momentum zero, so ``{}`` entries resume Muon exactly even through torch's full-state loader."""
    load = with_empty_entries(stock(full=True))
    if variant == "muon":
        run(single(*VARIANTS[variant]), load, expect_stateless=False)
        return
    with pytest.raises(AssertionError, match=r"torch\.equal"):
        run(single(*VARIANTS[variant]), load, expect_stateless=False)


def test_stock_loader_refuses_a_sparse_dict() -> None:
    with pytest.raises(MISSING_STATE_ERROR, match=missing_state_match("extra.weight")):
        run(single(*VARIANTS["adamw"]), stock(full=True))


def test_get_optimizer_state_dict_output_resumes_exactly() -> None:
    def checkpoint_of(model: BranchNet, optims: Optimizers) -> dict[str, Any]:
        (opt,) = optims  # warm: get_optimizer_state_dict's fake step does not run
        full = StateDictOptions(full_state_dict=True)
        return copy.deepcopy(get_optimizer_state_dict(model, opt, options=full))

    run(single(*VARIANTS["adamw"]), ours(full=True), checkpoint_of=checkpoint_of)


@pytest.mark.parametrize("full", [True, False], ids=["full", "sharded"])
def test_several_optimizers_one_of_them_cold(full: bool) -> None:
    """AdamW for the trunk and head; NAdam for ``extra`` alone, never stepped before the checkpoint."""

    def make(model: BranchNet) -> Optimizers:
        used = [*model.trunk.parameters(), *model.head.parameters()]
        return torch.optim.AdamW(used, lr=1e-2), torch.optim.NAdam(model.extra.parameters(), lr=1e-2)

    run(make, ours(full))
    run(make, with_empty_entries(ours(full)))


@pytest.mark.parametrize("full", [True, False], ids=["full", "sharded"])
@pytest.mark.parametrize("variant", ["adamw", "nadam", "sgd-dampening"])
def test_fully_cold_optimizer(variant: str, full: bool) -> None:
    """A checkpoint taken before the first step: no state anywhere."""
    run(single(*VARIANTS[variant]), ours(full), before=0)
    run(single(*VARIANTS[variant]), with_empty_entries(ours(full)), before=0)


@pytest.mark.parametrize("full", [True, False], ids=["full", "sharded"])
def test_stateless_sgd_with_empty_entries(full: bool) -> None:
    """Plain SGD stores nothing; torch's full_state_dict path asserts "Expected device to be set"."""
    make = single(*VARIANTS["sgd"])
    if full:
        with pytest.raises(AssertionError, match=NO_DEVICE_MATCH):
            run(make, with_empty_entries(stock(full=True)))
    run(make, with_empty_entries(ours(full)))


def test_an_lr_change_before_the_first_gradient_is_honoured() -> None:
    """Rprop's first step size is the lr *at the first gradient*: a scheduler that changes lr
    after the checkpoint defeats any fill taken from the saved lr, but not an absent entry."""

    def halve_lr(optims: Optimizers) -> None:
        for group in optims[0].param_groups:
            group["lr"] /= 2

    make = single(*VARIANTS["rprop"])
    run(make, ours(full=True), after_checkpoint=halve_lr)

    def fill_with_saved_lr(model: BranchNet, optims: Optimizers, checkpoint: dict[str, Any]) -> None:
        checkpoint = copy.deepcopy(checkpoint)
        lr = checkpoint["param_groups"][0]["lr"]
        for name, param in model.named_parameters():
            fresh = {
                "step": torch.tensor(0.0),
                "prev": torch.zeros_like(param),
                "step_size": torch.full_like(param, lr),
            }
            checkpoint["state"].setdefault(name, fresh)
        optims[0].load_state_dict(checkpoint)

    with pytest.raises(AssertionError, match=r"torch\.equal"):
        run(make, fill_with_saved_lr, after_checkpoint=halve_lr, expect_stateless=False)


def test_loading_into_a_warm_optimizer_forgets_its_state() -> None:
    """The checkpoint, not the optimizer's past, decides: ``extra`` ends with no state."""
    run(single(*VARIANTS["adamw"]), ours(full=True), warm_resume=True)
    run(single(*VARIANTS["adamw"]), ours(full=False), warm_resume=True)


@pytest.mark.parametrize(
    "options",
    [
        {"full_state_dict": False, "flatten_optimizer_state_dict": True},
        {"full_state_dict": True},  # torch 2.13 cannot load flat dicts with both flags set
    ],
    ids=["flatten", "full"],
)
def test_flattened_dict(options: dict[str, Any]) -> None:
    def checkpoint_of(model: BranchNet, optims: Optimizers) -> dict[str, Any]:
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        return copy.deepcopy(get_optimizer_state_dict(model, optims[0], options=flat))

    def load(model: BranchNet, optims: Optimizers, checkpoint: dict[str, Any]) -> None:
        assert "state" not in checkpoint and "state.trunk.weight.step" in checkpoint
        set_optimizer_state_dict(model, optims[0], checkpoint, options=StateDictOptions(**options))

    run(single(*VARIANTS["adamw"]), load, checkpoint_of=checkpoint_of)


def test_index_keyed_dict() -> None:
    """``optimizer.state_dict()`` itself, which torch loads with full_state_dict=False."""

    def checkpoint_of(model: BranchNet, optims: Optimizers) -> dict[str, Any]:
        return copy.deepcopy(optims[0].state_dict())

    run(single(*VARIANTS["nadam"]), ours(full=False), checkpoint_of=checkpoint_of)


def structure(value: object) -> object:
    """Everything about a state dict that loading must not change: containers, keys, values."""
    if isinstance(value, dict):
        return ("dict", id(value), [(k, structure(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, id(value), [structure(v) for v in value])
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value.dtype, tuple(value.shape), value.tolist())
    return value


@pytest.mark.parametrize("full", [True, False], ids=["full", "sharded"])
def test_the_callers_dict_is_left_alone_and_tensors_are_shared_as_torch_shares_them(full: bool) -> None:
    torch.manual_seed(0)
    model = BranchNet()
    (opt,) = single(*VARIANTS["adamw"])(model)
    train(model, (opt,), branch_inputs(2, seed=1), use_extra=False)
    checkpoint = by_name(model, (opt,))
    checkpoint["state"]["extra.bias"] = {}
    before = structure(checkpoint)

    ours(full)(model, (opt,), checkpoint)
    assert structure(checkpoint) == before
    assert model.extra.bias not in opt.state and model.extra.weight not in opt.state
    keys = ("step", "exp_avg", "exp_avg_sq")
    shared = [opt.state[model.trunk.weight][k] is checkpoint["state"]["trunk.weight"][k] for k in keys]

    complete = copy.deepcopy(checkpoint)
    for name, param in model.named_parameters():
        if name in EXTRA:
            zeros = torch.zeros_like(param)
            complete["state"][name] = {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}
    (stock_opt,) = single(*VARIANTS["adamw"])(model)
    model.zero_grad(set_to_none=True)  # else torch skips its fake step, then asserts
    dsd.set_optimizer_state_dict(model, stock_opt, complete, options=StateDictOptions(full_state_dict=full))
    assert shared == [stock_opt.state[model.trunk.weight][k] is complete["state"]["trunk.weight"][k] for k in keys]


def test_broadcast_from_rank0_is_refused() -> None:
    model = BranchNet()
    opt = torch.optim.AdamW(model.parameters())
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with pytest.raises(RepairRefused, match="does not support broadcast_from_rank0"):
        set_optimizer_state_dict(model, opt, by_name(model, (opt,)), options=options)


def test_an_eager_optimizer_with_missing_state_is_refused() -> None:
    model = BranchNet()
    opt = torch.optim.Adagrad(model.parameters())
    checkpoint = by_name(model, (opt,))
    del checkpoint["state"]["extra.bias"]
    with pytest.raises(RepairRefused, match=r"1 parameter.*Adagrad is not one of the lazily-initialized"):
        set_optimizer_state_dict(model, opt, checkpoint)


def test_an_eager_optimizer_with_complete_state_loads_as_torch_loads_it() -> None:
    torch.manual_seed(0)
    model = BranchNet()
    opt = torch.optim.Adagrad(model.parameters(), initial_accumulator_value=0.5)
    checkpoint = by_name(model, (opt,))
    fresh = torch.optim.Adagrad(model.parameters())
    set_optimizer_state_dict(model, fresh, checkpoint, options=StateDictOptions(full_state_dict=True))
    assert torch.equal(fresh.state[model.extra.bias]["sum"], torch.full((3,), 0.5))
