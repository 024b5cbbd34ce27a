"""Telling which lazily-initialized torch optimizer wrote a state dict, exactly, from its options and state keys.

Fresh state is built only for an optimizer identified exactly: every param group holds the very option
keys some torch version writes for it (keys torch's LR schedulers add aside), and its registry entry
explains the keys of every populated state entry. An optimizer from another library that keeps a
lookalike subset of torch's keys (torchao's ``AdamW8bit``: ``lr, betas, eps, weight_decay, amsgrad``)
or adds its own (pytorch-optimizer's ``LARS``: ``trust_coefficient``, a group ``step``) is not guessed
at: its fresh state differs from torch's. Nor is state that keeps a tensor no torch optimizer keeps: one
that does not hold floating-point numbers (``exp_avg`` as ``uint8``) under torch's own keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from optim_repair.decisions.optimizers import (
    NOT_OPTIMIZER_OPTIONS,
    OPTIMIZERS,
    SPECS,
    WHOLE_OPTIMIZER_STATE,
    WHOLE_OPTIMIZER_STATE_ADDED,
    OptimizerSpec,
)
from optim_repair.errors import Remedy, RepairRefused
from optim_repair.records.dtypes import is_floating
from optim_repair.records.inventory import ParamGroup, StateEntry, TensorMeta


@dataclass(frozen=True)
class Identification:
    """The optimizer that wrote a state dict."""

    name: str
    """The registry name whose fresh state fills it."""
    kind: str
    """What to call it: ``name``, or ``"adam or adamw"`` when the writer recorded nothing that tells them apart."""


def _own_options(group: ParamGroup) -> frozenset[str]:
    return group.option_keys - NOT_OPTIMIZER_OPTIONS


def _matches_options(spec: OptimizerSpec, groups: Sequence[ParamGroup]) -> bool:
    return bool(groups) and all(_own_options(group) in spec.option_sets for group in groups)


def _populated(entries: Sequence[StateEntry]) -> list[StateEntry]:
    return [entry for entry in entries if entry.is_mapping and not entry.is_empty]


def _matches_state(spec: OptimizerSpec, entries: Sequence[StateEntry]) -> bool:
    return all(frozenset(entry.keys) in spec.state_key_sets for entry in _populated(entries))


def _candidates(groups: Sequence[ParamGroup], entries: Sequence[StateEntry]) -> list[str]:
    return [spec.name for spec in SPECS if _matches_options(spec, groups) and _matches_state(spec, entries)]


def _one_candidate(candidates: Sequence[str], groups: Sequence[ParamGroup]) -> Identification | None:
    """The candidate to fill for, or None when there is none.

    Only Adam and AdamW share option keys (the registry's tests check it), and they create the same
    state (AdamW is ``Adam(decoupled_weight_decay=True)``). torch from 2.8 records that flag; before
    2.8 neither records it, and no value tells them apart (AdamW's ``weight_decay`` default of 1e-2
    is anyone's choice), so the kind is then "adam or adamw": the fill is the same either way.
    """
    if len(candidates) <= 1:
        return Identification(candidates[0], candidates[0]) if candidates else None
    flags = {group.option("decoupled_weight_decay") for group in groups}
    if flags == {True}:
        return Identification("adamw", "adamw")
    if flags == {False}:
        return Identification("adam", "adam")
    return Identification("adamw", "adam or adamw")


def named_by_options(groups: Sequence[ParamGroup]) -> tuple[str, ...]:
    """The registry optimizers whose option keys, as some torch version writes them, the groups hold."""
    return tuple(spec.name for spec in SPECS if _matches_options(spec, groups))


def state_key_sets_by_options(groups: Sequence[ParamGroup]) -> frozenset[frozenset[str]] | None:
    """The state key sets the optimizers whose option keys the groups hold create (Adafactor's differ by a
    parameter's rank), or None when no registry optimizer holds them: what a state entry may hold, as far as
    its groups tell."""
    specs = [spec for spec in SPECS if _matches_options(spec, groups)]
    return frozenset().union(*(spec.state_key_sets for spec in specs)) if specs else None


def non_floating_state(entries: Sequence[StateEntry]) -> str | None:
    """Why no torch optimizer wrote ``entries``, where one keeps a tensor other than ``step`` that does not hold
    floating-point numbers (``exp_avg`` as ``uint8``); None where none does.

    Every tensor torch's optimizers keep is floating point: moments in their parameter's dtype, or in another one
    (torchtitan's bf16 moments on fp32 parameters), and their one-element scalars. An integer moment is another
    library's quantized state, whose first step is not zeros. (``step`` is judged apart, as the scalar dtype.)
    """
    for entry in _populated(entries):
        for key, value in entry.values or ():
            if key != "step" and isinstance(value, TensorMeta) and not is_floating(value.dtype):
                return (
                    f"the state of {entry.param!r} keeps {key} as {value.dtype}, and no torch optimizer keeps a "
                    "tensor that is not floating point"
                )
    return None


def refuse_non_floating_state(entries: Sequence[StateEntry], refused: str, remedy: Remedy | None) -> None:
    """Raise ``RepairRefused`` (``refused``, then why) where ``entries`` keep a tensor no torch optimizer keeps."""
    reason = non_floating_state(entries)
    if reason is not None:
        raise RepairRefused(f"{refused}, so fresh state is not given: {reason}", remedy=remedy)


def guess_optimizer(groups: Sequence[ParamGroup], entries: Sequence[StateEntry]) -> Identification | None:
    """The optimizer that wrote ``groups`` and ``entries`` when it is identified exactly, else None."""
    if non_floating_state(entries) is not None:
        return None
    return _one_candidate(_candidates(groups, entries), groups)


def keeps_whole_optimizer_state(groups: Sequence[ParamGroup]) -> bool:
    """Whether the groups are LBFGS's, which keeps one state entry for the whole optimizer, not one per parameter."""
    return bool(groups) and all(
        _own_options(group) - WHOLE_OPTIMIZER_STATE_ADDED == WHOLE_OPTIMIZER_STATE for group in groups
    )


def _shown_keys(keys: frozenset[str] | set[str]) -> str:
    return ", ".join(sorted(keys)) or "none"


def _nearest(keys: frozenset[str]) -> tuple[OptimizerSpec, frozenset[str], frozenset[str]]:
    """The registry optimizer nearest to option keys ``keys``: the fewest keys it never writes, then the fewest
    it writes that ``keys`` lacks. Returns it, the keys lacking and the keys foreign to it."""
    scored = [
        (len(keys - spec.options), len(option_set - keys), spec.name, spec, option_set)
        for spec in SPECS
        for option_set in spec.option_sets
    ]
    *_, spec, option_set = min(scored, key=lambda item: item[:3])
    return spec, option_set - keys, keys - spec.options


def _why_not_exact(groups: Sequence[ParamGroup], entries: Sequence[StateEntry]) -> str:
    """Why no registry optimizer fits, in one clause about the first group or entry that rules them out."""
    for index, group in enumerate(groups):
        keys = _own_options(group)
        if not keys:
            return f"param group {index} records no options"
        if not any(keys in spec.option_sets for spec in SPECS):
            spec, lacking, foreign = _nearest(keys)
            differences = [f"lacks {_shown_keys(lacking)}"] if lacking else []
            differences += [f"has {_shown_keys(foreign)}"] if foreign else []
            return (
                f"the options of param group {index} ({_shown_keys(keys)}) are not the ones torch's "
                f"{spec.torch_class} writes: it {' and '.join(differences)}"
            )
    if not groups:
        return "it has no param groups"
    fitting = [spec for spec in SPECS if _matches_options(spec, groups)]
    if not fitting:
        return "its param groups hold the option keys of different torch optimizers"
    spec = fitting[0]
    entry = next(e for e in _populated(entries) if frozenset(e.keys) not in spec.state_key_sets)
    return (
        f"its options are torch's {spec.torch_class}'s, but the state of {entry.param!r} has keys "
        f"{_shown_keys(set(entry.keys))}, which {spec.torch_class} does not create"
    )


def identify_optimizer(
    groups: Sequence[ParamGroup],
    entries: Sequence[StateEntry],
    *,
    where: str = "this optimizer state",
    instead: Remedy | None = None,
) -> Identification:
    """The optimizer that wrote ``groups`` and ``entries``, identified exactly.

    A candidate must (1) find in every group exactly the option keys some torch version writes for
    it (``initial_lr`` and the other keys torch's LR schedulers add are set aside; any other key, a
    trainer's own or another library's, rules every candidate out), and (2) explain the key set of
    every populated state entry. State that keeps a tensor no torch optimizer keeps (``non_floating_state``)
    rules out every candidate. ``where`` names the state in messages.

    Raises ``RepairRefused`` with the reason otherwise, naming ``optimizer`` as the remedy: a user
    who knows which registry optimizer's fresh state fits can say so; for state no torch optimizer keeps,
    naming one does not help, and the remedy is ``instead`` (None: none).
    """
    refuse_non_floating_state(entries, f"cannot identify the optimizer that wrote {where} exactly", instead)
    chosen = guess_optimizer(groups, entries)
    if chosen is not None:
        return chosen
    raise RepairRefused(
        f"cannot identify the optimizer that wrote {where} exactly, so fresh state is not given: "
        f"{_why_not_exact(groups, entries)}",
        remedy=Remedy("optimizer", "NAME", placeholder=True, note=f" (one of: {', '.join(OPTIMIZERS)})"),
    )
