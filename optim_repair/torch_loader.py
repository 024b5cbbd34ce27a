"""A drop-in ``set_optimizer_state_dict`` that keeps never-stepped parameters stateless.

torch's lazily-initialized optimizers (Adam, AdamW, NAdam, RAdam, Adamax, RMSprop, SGD,
Adadelta, ASGD, Rprop, Adafactor, Muon) have no ``state`` entry for a parameter that never had a gradient.
``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` refuses such a
checkpoint ("Missing optimizer state for parameter ..."), and if the entries are filled with
``{}`` it silently loads the *phantom* state of its ``_init_optim_state`` fake step (``step=1``,
zero moments; Rprop even ``step_size=0``), so the run diverges from the one that never stopped.

This loader has torch's signature and does what torch does, except that a parameter whose
entry is absent or ``{}`` ends up with **no state at all**, exactly like the uninterrupted run:
its first gradient initializes it through the optimizer's own ``_init_group``. A trainer
changes one line::

    # from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    from optim_repair import set_optimizer_state_dict

How: for each optimizer, the parameters that need a gradient and have no (or an empty) entry
are found through torch's own name mapping; a shallow copy of the caller's dict gets a ``{}``
placeholder for each of them (the flattened layout gets the keys torch will look up); torch's
loader runs on that copy; then those parameters' entries are removed from ``optimizer.state``.
An optimizer that ends up with no tensor state (SGD without momentum) is loaded with
``full_state_dict=False``, which for non-FSDP parameters loads the same thing and avoids
torch's "Expected device to be set" assertion.

The caller's dict and every container in it are left as they were. Tensors are not copied:
like torch's loader, the optimizer keeps references to the caller's tensors wherever no
dtype or device change is needed, so later steps update them in place; pass a
``copy.deepcopy`` if you keep using the dict.

Not supported, with ``RepairRefused``: ``broadcast_from_rank0`` (ranks other than 0 cannot
see which entries are missing, and all ranks must decide alike); and, when some state is
absent or empty, FSDP1 (``FullyShardedDataParallel``) modules (state lives per flat parameter)
and optimizers outside the registry of ``optim_repair.decisions.optimizers`` (an eagerly-initialized one such
as Adagrad cannot run without state).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from itertools import chain
from typing import Any, cast

import torch
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.checkpoint.state_dict import OptimizerStateType, StateDictOptions

from optim_repair.decisions.optimizers import OPTIMIZERS
from optim_repair.errors import RepairRefused

__all__ = ["set_optimizer_state_dict"]

_STATE = "state"
_PARAM_GROUPS = "param_groups"
_PARAMS = "params"


def _lazy_classes() -> tuple[type[torch.optim.Optimizer], ...]:
    classes: list[type[torch.optim.Optimizer]] = []
    for spec in OPTIMIZERS.values():
        cls = getattr(torch.optim, spec.torch_class, None)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            classes.append(cls)
    return tuple(classes)


def _is_empty(value: object) -> bool:
    return isinstance(value, Mapping) and len(value) == 0


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _finds_device(optim: torch.optim.Optimizer) -> bool:
    """Whether torch's full_state_dict path will find a device in this optimizer's state.

    It looks for a tensor of one or more dimensions in the optimizer's own (local) state dict;
    without one it asserts "Expected device to be set".
    """
    groups = [{k: v for k, v in group.items() if k != _PARAMS} for group in optim.param_groups]
    return any(t.dim() > 0 for t in _tensors([list(optim.state.values()), groups]))


class _Loaded:
    """Which of one optimizer's parameters the dict leaves stateless, and the placeholders."""

    def __init__(self) -> None:
        self.stateless: list[torch.Tensor] = []
        self.names: list[list[str]] = []
        """For the flattened layout: each stateless parameter's names."""
        self.placeholders: dict[str, object] = {}


def _loaded_names(osd: Mapping[str, Any]) -> set[str]:
    groups = osd.get(_PARAM_GROUPS)
    if not isinstance(groups, list):
        return set()
    return {name for group in groups for name in group.get(_PARAMS, ()) if isinstance(name, str)}


def _fqns(param: torch.Tensor, info: Any, loaded: set[str]) -> list[str]:
    """The names torch will look the parameter up by (one per use of a shared parameter)."""
    names = sorted(info.fqn_param_mapping.get(param, ()))
    return [n for n in names if n not in info.shared_params_mapping or n in loaded]


def _nested_by_name(optim: torch.optim.Optimizer, osd: Mapping[str, Any], info: Any, loaded: set[str]) -> _Loaded:
    state = osd[_STATE]
    result = _Loaded()
    for param in chain.from_iterable(group[_PARAMS] for group in optim.param_groups):
        if not param.requires_grad:
            continue
        names = _fqns(param, info, loaded)
        if all(_is_empty(state[name]) for name in names if name in state):
            result.stateless.append(param)
            for name in names:
                if name not in state:
                    result.placeholders[name] = {}
    return result


def _nested_by_index(optim: torch.optim.Optimizer, osd: Mapping[str, Any]) -> _Loaded:
    """``optimizer.state_dict()`` layout: entries by position, as ``load_state_dict`` maps them."""
    state = osd[_STATE]
    saved = chain.from_iterable(group[_PARAMS] for group in osd[_PARAM_GROUPS])
    live = chain.from_iterable(group[_PARAMS] for group in optim.param_groups)
    result = _Loaded()
    for key, param in zip(saved, live, strict=False):  # load_state_dict checks lengths
        if param.requires_grad and _is_empty(state.get(key, {})):
            result.stateless.append(param)
    return result


def _flattened(optim: torch.optim.Optimizer, osd: Mapping[str, Any], info: Any, loaded: set[str]) -> _Loaded:
    """``flatten_optimizer_state_dict=True`` layout: ``state.<fqn>.<key>`` entries."""
    keys = sorted(key for key in osd if isinstance(key, str) and key.startswith(f"{_STATE}."))

    def has_entry(name: str) -> bool:
        prefix = f"{_STATE}.{name}."
        at = bisect.bisect_left(keys, prefix)
        return at < len(keys) and keys[at].startswith(prefix)

    result = _Loaded()
    for param in chain.from_iterable(group[_PARAMS] for group in optim.param_groups):
        if param.requires_grad:
            names = _fqns(param, info, loaded)
            if not any(has_entry(name) for name in names):
                result.stateless.append(param)
                result.names.append(names)
    return result


def _flat_placeholders(optim: torch.optim.Optimizer, plan: _Loaded) -> None:
    """torch rebuilds each flat entry from the keys of the live optimizer's state (after its fake
    step) and puts ``{}`` under each key the dict lacks, which ``__setstate__`` then fails on; so
    a stateless parameter gets placeholders under exactly those keys: the live values."""
    for param, names in zip(plan.stateless, plan.names, strict=True):
        live = optim.state.get(param, {})
        for name in names:
            for key, value in live.items():
                plan.placeholders[f"{_STATE}.{name}.{key}"] = value


def set_optimizer_state_dict(
    model: torch.nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: OptimizerStateType,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load ``optim_state_dict`` like torch's, leaving never-stepped parameters stateless.

    A drop-in for ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``: same
    arguments, same result, except that each parameter whose entry is absent or ``{}`` has no
    state afterwards, so its first gradient initializes it as if the run never stopped::

        from optim_repair import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, checkpoint["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))

    Works with ``full_state_dict`` True or False, one optimizer or several, name-keyed dicts
    (nested or flattened) and ``optimizer.state_dict()``'s index-keyed dicts where torch
    accepts them. The caller's dict is not modified; its tensors are shared with the optimizer
    as torch shares them (see the module docstring).

    Raises ``optim_repair.errors.RepairRefused`` for ``broadcast_from_rank0``, and where
    parameters would be left stateless but cannot be: FSDP1 modules, optimizers that are not
    lazily initialized. Anything else torch raises is raised unchanged.
    """
    optims = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    options = options or StateDictOptions()
    if not optim_state_dict:
        # torch raises its own error for an empty dict: keep it.
        dsd.set_optimizer_state_dict(model, optims, optim_state_dict, options=options)
        return
    if options.broadcast_from_rank0:
        # Only rank 0 holds the dict, so only it could tell which entries are missing; every
        # rank must decide alike (or the broadcast hangs), so all of them refuse.
        raise RepairRefused(
            "optim_repair's set_optimizer_state_dict does not support broadcast_from_rank0; "
            "fill missing entries with fresh state (optim-repair fix --fill fresh) and use "
            "torch's loader"
        )
    info = dsd._verify_options(model, optims, optim_only=True, options=options)

    nested = _STATE in optim_state_dict
    loaded = _loaded_names(optim_state_dict)
    entries = optim_state_dict.get(_STATE)
    by_index = nested and bool(entries) and all(isinstance(key, int) for key in cast(Mapping[Any, Any], entries))
    plans: list[_Loaded] = []
    for optim in optims:
        if not nested:
            plans.append(_flattened(optim, optim_state_dict, info, loaded))
        elif by_index or (not entries and not loaded):
            plans.append(_nested_by_index(optim, optim_state_dict))
        else:
            plans.append(_nested_by_name(optim, optim_state_dict, info, loaded))
    stateless_any = any(plan.stateless for plan in plans)
    if stateless_any:
        _refuse_unsupported(optims, plans, info)

    # torch starts every load with this (a zero-gradient, lr=0 step on a cold optimizer);
    # doing it first lets us see the local state torch will merge with and find devices in.
    for optim in optims:
        dsd._init_optim_state(optim)
    needs_local_device = bool(options.full_state_dict and not info.fsdp_modules)
    if not stateless_any and not (needs_local_device and not all(_finds_device(optim) for optim in optims)):
        dsd.set_optimizer_state_dict(model, optims, optim_state_dict, options=options)
        return

    patched: dict[str, Any] = dict(optim_state_dict)
    if nested:
        patched[_STATE] = dict(cast(Mapping[str, Any], entries))
        for plan in plans:
            patched[_STATE].update(plan.placeholders)
    else:
        for optim, plan in zip(optims, plans, strict=True):
            _flat_placeholders(optim, plan)
            patched.update(plan.placeholders)

    for optim, plan in zip(optims, plans, strict=True):
        these = options
        if needs_local_device and not _finds_device(optim):
            these = dataclasses.replace(options, full_state_dict=False)
        dsd.set_optimizer_state_dict(model, optim, patched, options=these)
        for param in plan.stateless:
            optim.state.pop(param, None)


def _refuse_unsupported(optims: tuple[torch.optim.Optimizer, ...], plans: list[_Loaded], info: Any) -> None:
    count = sum(len(plan.stateless) for plan in plans)
    what = f"{count} parameter(s) have no optimizer state in the checkpoint"
    if info.fsdp_modules:
        raise RepairRefused(
            f"{what}, and FSDP1 (FullyShardedDataParallel) modules keep state per flat "
            "parameter; fill the entries with fresh state first (optim-repair fix --fill fresh)"
        )
    lazy = _lazy_classes()
    for optim, plan in zip(optims, plans, strict=True):
        if plan.stateless and not isinstance(optim, lazy):
            raise RepairRefused(
                f"{what}, and {type(optim).__name__} is not one of the lazily-initialized "
                f"optimizers ({', '.join(spec.torch_class for spec in OPTIMIZERS.values())}): "
                "it may not run without state; fill the entries first"
            )
