"""Findings about an inventory: missing, empty and malformed entries, and notices. Pure functions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from optim_repair.decisions.census import StepCensus, lagging_notice_detail, step_census
from optim_repair.decisions.comparison import ModelComparison, compare, model_of, weights_beside
from optim_repair.decisions.identify import keeps_whole_optimizer_state, named_by_options, state_key_sets_by_options
from optim_repair.decisions.notices import (
    LAZY_LOADERS,
    Loader,
    Notice,
    checkpoint_notices,
    dcp_missing_options,
    loader_notices,
    loader_of,
    newer_forms,
    phantom_entries,
    shown_params,
)
from optim_repair.decisions.optimizers import PARAM_SHAPED_KEYS, options_asked
from optim_repair.records.inventory import (
    CheckpointInventory,
    OptimizerInventory,
    ParamKey,
    Skipped,
    StateEntry,
    TensorMeta,
    WeightMap,
)
from optim_repair.version import torch_release

Verdict = Literal["healthy", "repairable", "malformed"]


@dataclass(frozen=True)
class Malformed:
    """A state entry that cannot be repaired safely; ``code`` is stable."""

    param: ParamKey | None
    code: Literal["partial-state", "orphan-state", "duplicate-param", "bad-entry", "shape-mismatch"]
    detail: str


@dataclass(frozen=True)
class OptimizerDiagnosis:
    """Every finding about one optimizer; its fields and properties are named as in the JSON document."""

    optimizer: OptimizerInventory
    loader: Loader
    missing: tuple[ParamKey, ...]
    empty: tuple[ParamKey, ...]
    malformed: tuple[Malformed, ...]
    notices: tuple[Notice, ...]
    model: ModelComparison | None = None
    """The optimizer against its model (``--model``, or the weights beside it), when there is one."""
    phantom: tuple[ParamKey, ...] = ()
    """Entries with ``step`` 1 and all-zero moments (as far as inspect reads them): the state torch's full-state
    loader gives a parameter without state, which ``fix --reset-phantom-step`` turns back."""
    missing_options: tuple[tuple[int, str], ...] = ()
    """The (group, option) pairs its loader asks for and its groups lack (``dcp.load`` of a torch that writes
    ``decoupled_weight_decay``, on a checkpoint written before it did)."""
    census: StepCensus | None = None
    """Every parameter's ``step``, where inspect read them (``decisions.census``)."""

    @property
    def file(self) -> str:
        return self.optimizer.file

    @property
    def location(self) -> str:
        return self.optimizer.location

    @property
    def key_style(self) -> str:
        return self.optimizer.key_style

    @property
    def layout(self) -> str:
        return self.optimizer.layout

    @property
    def groups(self) -> int:
        return len(self.optimizer.groups)

    @property
    def params(self) -> int:
        return len(set(self.optimizer.params))

    @property
    def states(self) -> int:
        return len(self.optimizer.entries)

    @property
    def cold(self) -> bool:
        return all(entry.is_empty for entry in self.optimizer.entries)

    @property
    def resumes_as_is(self) -> bool:
        """Whether its loader resumes it exactly as it is: no entry is absent, or its loader
        (``optimizer.load_state_dict``, Lightning's sharded FSDP loader) creates absent entries lazily, as the
        optimizer would have."""
        return not self.missing or self.loader in LAZY_LOADERS


@dataclass(frozen=True)
class Diagnosis:
    """Every finding about a checkpoint, and the inventory they were made from."""

    inventory: CheckpointInventory
    optimizers: tuple[OptimizerDiagnosis, ...]
    notices: tuple[Notice, ...]
    strict: bool = False
    """Whether any absent entry makes the checkpoint repairable, whatever its loader."""
    newer_forms: tuple[str, ...] = ()
    """Files the torch that will load them cannot read, which a newer torch wrote (``newer-torch-metadata``): a fix
    writes them in the form that torch reads."""

    @property
    def path(self) -> str:
        return self.inventory.path

    @property
    def format(self) -> str:
        return self.inventory.format

    @property
    def skipped(self) -> tuple[Skipped, ...]:
        return self.inventory.skipped

    @property
    def verdict(self) -> Verdict:
        """Will a resume through the loader each layout implies work and continue exactly?"""
        if any(opt.malformed or (opt.model and opt.model.shape_mismatches) for opt in self.optimizers):
            return "malformed"
        if any(opt.missing and (self.strict or not opt.resumes_as_is) for opt in self.optimizers):
            return "repairable"
        if any(opt.missing_options for opt in self.optimizers):
            return "repairable"  # dcp.load asks for options torch added since: fix adds them
        if self.newer_forms:
            return "repairable"  # the loading torch cannot read them: fix writes its form
        if any(opt.model and not opt.model.matches for opt in self.optimizers):
            return "repairable"  # names the model does not have: fix --rename or --drop-not-in-model
        return "healthy"


def _duplicate_params(optimizer: OptimizerInventory) -> list[Malformed]:
    where: dict[ParamKey, list[int]] = {}
    for index, group in enumerate(optimizer.groups):
        for param in group.params:
            where.setdefault(param, []).append(index)
    return [
        Malformed(param, "duplicate-param", f"listed {len(groups)} times, in groups {sorted(set(groups))}")
        for param, groups in where.items()
        if len(groups) > 1
    ]


def _bad_entries(entry: StateEntry) -> list[Malformed]:
    if not entry.is_mapping:
        return [Malformed(entry.param, "bad-entry", f"the entry is a {entry.type_name}, not a mapping")]
    outside = [
        Malformed(entry.param, "bad-entry", f"{key} lies outside its storage (a damaged tensor record)")
        for key, value in entry.values or ()
        if isinstance(value, TensorMeta) and not value.in_bounds
    ]
    return outside + [
        Malformed(entry.param, "bad-entry", f"{key} is {_value_kind(value)}, not a tensor")
        for key, value in entry.values or ()
        if key in PARAM_SHAPED_KEYS
        and not isinstance(value, TensorMeta)
        and not (key == "momentum_buffer" and value is None)
    ]


def _value_kind(value: object) -> str:
    if value is None:
        return "None"
    return f"a {getattr(value, 'type_name', type(value).__name__)}"


def _partial_entries(optimizer: OptimizerInventory) -> tuple[list[Malformed], list[Notice]]:
    """Entries that lack keys other entries of their group have, and have no key of their own.

    An entry is partial only when its keys are a strict subset of another entry's in the same group, and
    the optimizer its groups name never creates that key set: factored optimizers keep different state by rank
    (torch's Adafactor ``row_var``/``col_var`` for matrices, ``variance`` for vectors). For an optimizer the
    registry does not know by its option keys, which may keep different state by size (bitsandbytes' 8-bit AdamW:
    32-bit state without its quantization keys below a size threshold), a differing key set is a notice, never
    malformed.
    """
    found: list[tuple[ParamKey, int, list[str]]] = []
    for index, group in enumerate(optimizer.groups):
        members = set(group.params)
        populated = [e for e in optimizer.entries if e.param in members and e.values]
        counts = Counter(frozenset(e.keys) for e in populated)
        for entry in populated:
            keys = frozenset(entry.keys)
            wider = [(count, sorted(other)) for other, count in counts.items() if keys < other]
            if wider:
                _, reference = max(wider)
                found.append((entry.param, index, [key for key in reference if key not in keys]))
    known = state_key_sets_by_options(optimizer.groups)
    if known is None:
        if not found:
            return [], []
        params = tuple(param for param, _, _ in found)
        detail = (
            f"{len(found)} entries lack keys other entries of their group have ({shown_params(params)}): the "
            "optimizer is none optim-repair knows by its option keys, and some keep different state by a "
            "parameter's size or rank (bitsandbytes' 8-bit AdamW keeps 32-bit state below its size threshold)"
        )
        return [], [Notice("differing-state-keys", detail, "info")]
    return [
        Malformed(param, "partial-state", f"lacks {', '.join(lacking)}, which other entries of group {index} have")
        for param, index, lacking in found
        if frozenset(next(e.keys for e in optimizer.entries if e.param == param)) not in known
    ], []


def _shape_mismatches(entry: StateEntry, weights: dict[str, TensorMeta]) -> list[Malformed]:
    shaped = [
        (key, value) for key, value in entry.values or () if key in PARAM_SHAPED_KEYS and isinstance(value, TensorMeta)
    ]
    param = weights.get(entry.param) if isinstance(entry.param, str) else None
    if param is not None:
        reference = ("the parameter", param.shape)
    elif shaped:
        reference = (shaped[0][0], shaped[0][1].shape)
    else:
        return []
    return [
        Malformed(
            entry.param,
            "shape-mismatch",
            f"{key} has shape {list(value.shape)} but {reference[0]} has {list(reference[1])}",
        )
        for key, value in shaped
        if value.shape != reference[1]
    ]


def _phantom_entry(entry: StateEntry) -> bool:
    """``step`` 1 and every moment zero in what inspect read of it: a phantom step's state."""
    step = entry.get("step")
    if not isinstance(step, TensorMeta) or step.value != 1:
        return False
    moments = [v for k, v in entry.values or () if k in PARAM_SHAPED_KEYS and isinstance(v, TensorMeta)]
    return bool(moments) and all(moment.zero_head for moment in moments)


def _is_phantom(optimizer: OptimizerInventory) -> bool:
    populated = [entry for entry in optimizer.entries if entry.values]
    return bool(populated) and all(_phantom_entry(entry) for entry in populated)


_NO_FULL_STATE_LOADER = Notice(
    "lbfgs-loader",
    "torch's set_optimizer_state_dict cannot load LBFGS state, complete as it is: with full_state_dict=True its "
    "initializing step() has no closure (TypeError), without it every parameter but the first lacks state "
    "('Missing optimizer state'); load it with optimizer.load_state_dict, its state under index keys",
)
"""For name-keyed LBFGS state, whose layout implies torch's ``set_optimizer_state_dict`` (measured on 2.13)."""


def _whole_optimizer_state(optimizer: OptimizerInventory) -> Notice:
    params = tuple(dict.fromkeys(optimizer.params))
    first = f" ({params[0]})" if params else ""
    return Notice(
        "whole-optimizer-state",
        f"LBFGS keeps one state entry for the whole optimizer, under its first parameter{first}, not one per "
        f"parameter: the other {max(len(params) - 1, 0)} parameter(s) have no entry by design, and nothing is missing",
        "info",
    )


def _reference_shapes(weights: Iterable[WeightMap]) -> dict[str, TensorMeta]:
    """Parameter shapes to check moments against. A name the weight maps disagree on is no reference:
    a file holding two models (``models.actor``, ``models.critic``) names ``trunk.weight`` twice."""
    shapes: dict[str, TensorMeta] = {}
    ambiguous: set[str] = set()
    for weight_map in weights:
        for name, meta in weight_map.tensors:
            if shapes.setdefault(name, meta).shape != meta.shape:
                ambiguous.add(name)
    return {name: meta for name, meta in shapes.items() if name not in ambiguous}


def missing_options(
    optimizer: OptimizerInventory, loader: Loader, release: tuple[int, int] | None
) -> tuple[tuple[int, str], ...]:
    """The (group, option) pairs ``dcp.load`` of torch ``release`` asks for that the groups lack: ``dcp.load`` reads
    every key of its template, a ``get_optimizer_state_dict`` of that release's optimizer. Other loaders fill an
    absent option in (``Optimizer.__setstate__``). Flattened groups are not judged."""
    if loader != "dcp.load" or release is None or optimizer.layout != "nested":
        return ()
    asked = options_asked(named_by_options(optimizer.groups), release)
    return tuple(
        (index, key) for index, group in enumerate(optimizer.groups) for key in asked if key not in group.option_keys
    )


def diagnose_optimizer(
    optimizer: OptimizerInventory,
    weights: Iterable[WeightMap] = (),
    loader: Loader | None = None,
    release: tuple[int, int] | None = None,
) -> OptimizerDiagnosis:
    """Every finding about one optimizer; ``loader`` defaults to the one its keys imply in a torch file, and
    ``release`` (the torch that will load it) to the installed torch."""
    loader = loader or loader_of(optimizer.key_style, "torch")
    release = release or torch_release()
    lacking = missing_options(optimizer, loader, release)
    shapes = _reference_shapes(weights)
    listed = set(optimizer.params)
    present = {entry.param for entry in optimizer.entries}
    whole = keeps_whole_optimizer_state(optimizer.groups)
    missing = () if whole else tuple(dict.fromkeys(param for param in optimizer.params if param not in present))
    malformed = _duplicate_params(optimizer)
    malformed += [
        Malformed(entry.param, "orphan-state", "has a state entry but is in no param group")
        for entry in optimizer.entries
        if entry.param not in listed
    ]
    for entry in optimizer.entries:
        malformed += _bad_entries(entry)
        malformed += _shape_mismatches(entry, shapes)
    partial, differing = _partial_entries(optimizer)
    malformed += partial
    notices = [_whole_optimizer_state(optimizer), *differing] if whole else differing
    if whole and loader == "set_optimizer_state_dict":
        notices.append(_NO_FULL_STATE_LOADER)
    if all(entry.is_empty for entry in optimizer.entries):
        cold = "no parameter has optimizer state yet: the optimizer never stepped with a gradient for any of them"
        notices.append(Notice("cold", cold, "info"))
    elif _is_phantom(optimizer):
        notices.append(
            Notice(
                "phantom-step",
                "every entry has step == 1 and all-zero moments: a never-stepped optimizer exported through "
                "get_optimizer_state_dict, whose initializing fake step advanced the clock",
            )
        )
    empty = tuple(entry.param for entry in optimizer.entries if entry.is_empty)
    phantom = tuple(entry.param for entry in optimizer.entries if entry.values and _phantom_entry(entry))
    if phantom and not _is_phantom(optimizer):
        notices.append(phantom_entries(phantom))
    notices += loader_notices(optimizer, loader, missing, len(empty))
    if lacking and release is not None:
        notices.append(dcp_missing_options(optimizer, lacking, release))
    census = step_census(optimizer, missing)
    lagging = lagging_notice_detail(census, phantom) if census is not None else None
    if lagging is not None:
        notices.append(Notice("lagging-steps", lagging, "info"))
    return OptimizerDiagnosis(
        optimizer=optimizer,
        loader=loader,
        missing=missing,
        empty=empty,
        malformed=tuple(malformed),
        notices=tuple(notices),
        phantom=phantom,
        missing_options=lacking,
        census=census,
    )


def diagnose(
    inventory: CheckpointInventory,
    *,
    strict: bool = False,
    model: Sequence[WeightMap] | None = None,
    release: tuple[int, int] | None = None,
) -> Diagnosis:
    """Every finding about a checkpoint; ``strict``: every absent entry needs a repair, whatever the loader.
    Each optimizer is compared with ``model`` (weight maps), or with the weights beside it that name one of
    its parameters. ``release`` is the torch that will load it (by default the installed one)."""
    optimizers: list[OptimizerDiagnosis] = []
    for file in inventory.files:
        weights = weights_beside(file, inventory)
        for optimizer in file.optimizers:
            loader = loader_of(optimizer.key_style, file.format, file.writer)
            found = diagnose_optimizer(optimizer, weights, loader, release)
            maps = tuple(model) if model is not None else model_of(optimizer, weights)
            optimizers.append(replace(found, model=compare(optimizer, maps)) if maps else found)
    loading = release or torch_release()
    notices = checkpoint_notices(inventory, loading)
    newer = tuple(file.file for file in newer_forms(inventory, loading))
    return Diagnosis(inventory, tuple(optimizers), tuple(notices), strict, newer)
