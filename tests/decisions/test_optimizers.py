"""The fresh-state registry against real torch optimizers.

Two proofs per optimizer (and per flag that changes its state): the entry ``fresh_state``
describes is the one the optimizer's own ``_init_group`` creates (keys, order, dtypes, shapes,
values), and a checkpoint whose missing entries are filled with it resumes bit-identically,
through torch's ``set_optimizer_state_dict(full_state_dict=True)`` and through
``optimizer.load_state_dict``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from optim_repair.decisions.optimizers import OPTIMIZERS, FreshValue, ParamSpec, fresh_state
from optim_repair.errors import RepairRefused
from optim_repair.records.inventory import ParamGroup, TensorMeta
from optim_repair.records.repair_plan import FreshTensor
from tests.factories.models import VARIANTS, BranchNet, TorchAdafactor, branch_inputs, train_branches
from tests.factories.support import group_of
from tests.factories.versions import HAS_MUON, NO_DEVICE_MATCH

Factory = Callable[[Any], torch.optim.Optimizer]


def test_registry_covers_every_lazy_optimizer() -> None:
    assert set(OPTIMIZERS) == {spec for spec, _, _ in VARIANTS.values()}
    for spec in OPTIMIZERS.values():
        if spec.torch_class == "Muon" and not HAS_MUON:
            continue  # the registry knows Muon's state before the installed torch has the class
        assert issubclass(getattr(torch.optim, spec.torch_class), torch.optim.Optimizer)


# --- building torch values from the registry -----------------------------------------------


def build(value: FreshValue) -> Any:
    if isinstance(value, FreshTensor):
        return torch.full(value.shape, value.fill, dtype=getattr(torch, value.dtype))
    return value


def assert_same_value(actual: object, expected: object, key: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), key
        assert actual.dtype == expected.dtype, key
        assert actual.shape == expected.shape, key
        assert torch.equal(actual, expected), key
    else:
        assert actual is expected or actual == expected, key
        assert type(actual) is type(expected), key


# --- 1. the entry is what _init_group creates ----------------------------------------------


def init_group(opt: torch.optim.Optimizer, param: torch.Tensor) -> list[list[Any]]:
    """Run the optimizer's real ``_init_group`` for ``param``; return the lists it filled."""
    group = opt.param_groups[0]
    init = opt._init_group  # type: ignore[attr-defined]
    lists: list[list[Any]] = [[] for _ in list(inspect.signature(init).parameters)[1:]]
    init(group, *lists)
    return lists


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    ("dtype", "default"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
        (torch.complex64, torch.float32),
    ],
    ids=["float32", "bfloat16", "default-float64", "complex64"],
)
def test_fresh_state_is_what_init_group_creates(variant: str, dtype: torch.dtype, default: torch.dtype) -> None:
    name, cls, kwargs = VARIANTS[variant]
    if dtype.is_complex and name in ("adafactor", "muon"):
        pytest.skip(f"{cls.__name__} does not support complex parameters")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        param = nn.Parameter(torch.randn(3, 2, dtype=dtype))
        param.grad = torch.randn_like(param)
        opt = cls([param], **kwargs)
        lists = init_group(opt, param)
        actual = opt.state[param]
        scalar = "float64" if default == torch.float64 else "float32"
        group = group_of(opt.state_dict()["param_groups"][0])
        expected = fresh_state(name, group, ParamSpec(str(dtype)[6:], (3, 2)), scalar_dtype=scalar)
    finally:
        torch.set_default_dtype(previous)

    if name == "sgd":
        # SGD creates no tensor: _init_group reads momentum_buffer (None on a first step);
        # step() stores the buffer afterwards. Without momentum it never touches the state.
        assert dict(actual) == {}
        if kwargs.get("momentum", 0):
            assert expected == (("momentum_buffer", None),)
            assert lists[-1] == [None]
        else:
            assert expected == ()
        return
    assert list(actual) == [key for key, _ in expected]
    for key, value in expected:
        assert_same_value(actual[key], build(value), key)


@pytest.mark.parametrize("shape", [(), (5,), (3, 2), (2, 3, 4)], ids=["0-dim", "vector", "matrix", "3-dim"])
def test_adafactor_factors_by_rank_as_init_group_does(shape: tuple[int, ...]) -> None:
    param = nn.Parameter(torch.randn(shape))
    param.grad = torch.randn_like(param)
    opt = TorchAdafactor([param])
    init_group(opt, param)
    group = group_of(opt.state_dict()["param_groups"][0])
    expected = fresh_state("adafactor", group, ParamSpec("float32", shape))
    assert list(opt.state[param]) == [key for key, _ in expected]
    for key, value in expected:
        assert_same_value(opt.state[param][key], build(value), key)


def test_fused_adam_step_is_float32_whatever_the_default_dtype() -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        param = nn.Parameter(torch.randn(3, dtype=torch.float32))
        param.grad = torch.randn_like(param)
        opt = torch.optim.AdamW([param], fused=True)
        init_group(opt, param)
        group = group_of(opt.state_dict()["param_groups"][0])
        expected = fresh_state("adamw", group, ParamSpec("float32", (3,)), scalar_dtype="float64")
    finally:
        torch.set_default_dtype(previous)
    assert [k for k, _ in expected] == list(opt.state[param])
    for key, value in expected:
        assert_same_value(opt.state[param][key], build(value), key)
    assert expected[0] == ("step", FreshTensor("float32", (), 0.0))


def test_hyperparameters_come_from_the_group() -> None:
    group = ParamGroup(params=("w",), options=(("lr", 0.25), ("momentum", 0.0)))
    spec = ParamSpec("float16", (4,))
    assert dict(fresh_state("rprop", group, spec))["step_size"] == FreshTensor("float16", (4,), 0.25)
    assert dict(fresh_state("asgd", group, spec))["eta"] == FreshTensor("float32", (), 0.25)
    assert fresh_state("sgd", group, spec) == ()


@pytest.mark.parametrize(
    ("optimizer", "options", "message"),
    [
        ("lion", (), "unknown optimizer 'lion'"),
        ("rprop", (), "has no 'lr' option"),
        ("asgd", (("lr", TensorMeta("float32", (), (), "0", 0, 4)),), "'lr' is a tensor"),
        ("sgd", (("lr", 0.1),), "has no 'momentum' option"),
        ("rmsprop", (("momentum", "0.9"),), "'momentum' is '0.9', not a number"),
    ],
)
def test_fresh_state_refuses(optimizer: str, options: Any, message: str) -> None:
    with pytest.raises(RepairRefused, match=message):
        fresh_state(optimizer, ParamGroup(("w",), options), ParamSpec("float32", (2,)))


def test_fresh_state_refuses_an_unknown_scalar_dtype() -> None:
    with pytest.raises(RepairRefused, match="scalar dtype 'float16'"):
        fresh_state("adam", ParamGroup(("w",)), ParamSpec("float32", (2,)), scalar_dtype="float16")


# --- 2. a filled checkpoint resumes bit-identically ----------------------------------------


def by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter names, as torch's DSD API keys it."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in opt.param_groups for p in group["params"]]
    sd = copy.deepcopy(opt.state_dict())
    return {
        "state": {names[id(params[i])]: entry for i, entry in sd["state"].items()},
        "param_groups": [
            dict(group, params=[names[id(params[i])] for i in group["params"]]) for group in sd["param_groups"]
        ],
    }


def run(variant: str, load: Callable[[BranchNet, torch.optim.Optimizer, dict[str, Any]], None]) -> None:
    """Uninterrupted run vs. a run resumed from a checkpoint taken while ``extra`` was unused."""
    _, cls, kwargs = VARIANTS[variant]
    torch.manual_seed(0)
    reference = BranchNet()
    ref_opt = cls(reference.parameters(), **kwargs)
    train_branches(reference, ref_opt, branch_inputs(3, seed=1), use_extra=False)
    weights = copy.deepcopy(reference.state_dict())
    checkpoint = by_name(reference, ref_opt)
    assert not any(name.startswith("extra.") for name in checkpoint["state"])
    train_branches(reference, ref_opt, branch_inputs(3, seed=2), use_extra=True)

    resumed = BranchNet()
    resumed.load_state_dict(weights)
    opt = cls(resumed.parameters(), **kwargs)
    load(resumed, opt, checkpoint)
    train_branches(resumed, opt, branch_inputs(3, seed=2), use_extra=True)

    for (name, expected), actual in zip(reference.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(actual, expected), name
    expected_state = by_name(reference, ref_opt)["state"]
    actual_state = by_name(resumed, opt)["state"]
    assert list(actual_state) == list(expected_state)
    for name, entry in expected_state.items():
        assert list(actual_state[name]) == list(entry), name
        for key, value in entry.items():
            assert_same_value(actual_state[name][key], value, f"{name}.{key}")


def fill_fresh(model: BranchNet, checkpoint: dict[str, Any], name: str) -> dict[str, Any]:
    """The checkpoint with every missing entry filled from the registry (in memory)."""
    filled = copy.deepcopy(checkpoint)
    params = dict(model.named_parameters())
    for group in filled["param_groups"]:
        inventory_group = group_of(group)
        for pname in group["params"]:
            if pname not in filled["state"]:
                spec = ParamSpec(str(params[pname].dtype)[6:], tuple(params[pname].shape))
                state = fresh_state(name, inventory_group, spec)
                if state:  # () = the optimizer stores nothing: absent already is fresh
                    filled["state"][pname] = {key: build(value) for key, value in state}
    return filled


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fresh_fill_resumes_exactly_through_torch_set_optimizer_state_dict(variant: str) -> None:
    name = VARIANTS[variant][0]

    def load(model: BranchNet, opt: torch.optim.Optimizer, checkpoint: dict[str, Any]) -> None:
        filled = fill_fresh(model, checkpoint, name)
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, opt, filled, options=options)

    if variant == "sgd":
        # Plain SGD stores no state at all; torch's own full_state_dict loader cannot load
        # even its own output for it (optim_repair.torch_loader can: see tests/faces/test_torch_loader.py).
        with pytest.raises(AssertionError, match=NO_DEVICE_MATCH):
            run(variant, load)
        return
    run(variant, load)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fresh_fill_resumes_exactly_through_load_state_dict(variant: str) -> None:
    name = VARIANTS[variant][0]

    def load(model: BranchNet, opt: torch.optim.Optimizer, checkpoint: dict[str, Any]) -> None:
        filled = fill_fresh(model, checkpoint, name)
        names = [n for n, _ in model.named_parameters()]
        state = {names.index(n): entry for n, entry in filled["state"].items()}
        groups = [dict(g, params=[names.index(n) for n in g["params"]]) for g in filled["param_groups"]]
        opt.load_state_dict({"state": state, "param_groups": groups})

    run(variant, load)


def test_zeros_momentum_buffer_is_not_fresh_for_sgd_with_dampening() -> None:
    """Why the registry says None: a zeros buffer changes the first update when dampening != 0."""

    def load(model: BranchNet, opt: torch.optim.Optimizer, checkpoint: dict[str, Any]) -> None:
        filled = copy.deepcopy(checkpoint)
        for pname, param in model.named_parameters():
            filled["state"].setdefault(pname, {"momentum_buffer": torch.zeros_like(param)})
        set_optimizer_state_dict(model, opt, filled, options=StateDictOptions(full_state_dict=True))

    with pytest.raises(AssertionError):
        run("sgd-dampening", load)
