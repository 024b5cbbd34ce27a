"""Telling which lazily-initialized torch optimizer wrote a state dict, from its options and state keys."""

from __future__ import annotations

from collections.abc import Sequence

from optim_repair.decisions.optimizers import KNOWN_OPTIONS, OPTIMIZERS, SPECS, OptimizerSpec, ParamSpec, fresh_state
from optim_repair.errors import Remedy, RepairRefused
from optim_repair.records.inventory import ParamGroup, StateEntry


def _matches_options(spec: OptimizerSpec, groups: Sequence[ParamGroup]) -> bool:
    for group in groups:
        keys = group.option_keys
        if not spec.required_options <= keys:
            return False
        if not (keys & KNOWN_OPTIONS) <= spec.allowed_options:
            return False
    return True


def _matches_state(spec: OptimizerSpec, entries: Sequence[StateEntry]) -> bool:
    return all(
        frozenset(entry.keys) in spec.state_key_sets for entry in entries if entry.is_mapping and not entry.is_empty
    )


def _same_fresh_state(names: Sequence[str], groups: Sequence[ParamGroup]) -> bool:
    """Whether every candidate would fill every group's parameters identically."""
    probe = ParamSpec("float32", (1,))
    for group in groups or (ParamGroup(params=()),):
        states = set()
        for name in names:
            try:
                states.add(fresh_state(name, group, probe))
            except RepairRefused:
                return False
        if len(states) > 1:
            return False
    return True


def _candidates(groups: Sequence[ParamGroup], entries: Sequence[StateEntry]) -> list[str]:
    options_known = any(group.option_keys for group in groups)
    return [
        spec.name
        for spec in SPECS
        if (not options_known or _matches_options(spec, groups)) and _matches_state(spec, entries)
    ]


def _one_candidate(candidates: Sequence[str], groups: Sequence[ParamGroup]) -> str | None:
    """The one candidate to fill for, or None when their fresh states would differ."""
    if len(candidates) == 1:
        return candidates[0]
    if not candidates or not _same_fresh_state(candidates, groups):
        return None
    if set(candidates) <= {"adam", "adamw"}:
        decoupled = any(group.option("decoupled_weight_decay") is True for group in groups)
        return "adamw" if decoupled else "adam"
    return candidates[0]


def guess_optimizer(groups: Sequence[ParamGroup], entries: Sequence[StateEntry]) -> str | None:
    """The registry name of the optimizer that wrote ``groups`` and ``entries``, or None when unsure."""
    return _one_candidate(_candidates(groups, entries), groups)


def identify_optimizer(
    groups: Sequence[ParamGroup],
    entries: Sequence[StateEntry],
    *,
    where: str = "this optimizer state",
) -> str:
    """The registry name of the optimizer that wrote ``groups`` and ``entries``.

    A candidate must (1) find, in every group, the option keys every torch version writes
    for it (``betas`` + ``amsgrad`` for Adam, ``momentum_decay`` for NAdam, ``rho`` for
    Adadelta, ...) and no option key that only other torch optimizers write (keys no torch
    optimizer writes, such as ``initial_lr``, are ignored), and (2) explain the key set of
    every populated state entry. ``where`` names the state in messages.

    When several candidates remain, it is only ambiguous if their fresh states would differ.
    Adam and AdamW create identical state (AdamW is ``Adam(decoupled_weight_decay=True)``):
    the answer is ``"adamw"`` when the groups say ``decoupled_weight_decay=True`` and
    ``"adam"`` otherwise (older torch wrote no such key for either). Likewise when only
    state keys are known and Adam and RAdam both fit, the first in registry order is
    returned, since their fills are the same.

    Raises ``RepairRefused`` listing the candidates and the accepted names otherwise.
    """
    candidates = _candidates(groups, entries)
    chosen = _one_candidate(candidates, groups)
    if chosen is not None:
        return chosen
    remedy = Remedy("optimizer", "NAME", placeholder=True, note=f" (one of: {', '.join(OPTIMIZERS)})")
    if not candidates:
        seen = sorted(frozenset().union(*(group.option_keys for group in groups)))
        raise RepairRefused(
            f"cannot tell which optimizer wrote {where}: its options ({', '.join(seen) or 'none'}) "
            "and state keys fit no lazily-initializing torch optimizer",
            remedy=remedy,
        )
    raise RepairRefused(f"cannot tell which optimizer wrote {where}: candidates {', '.join(candidates)}", remedy=remedy)
