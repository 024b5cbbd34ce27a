"""Deciding a repair plan: which state entries to add, with what. Pure: never touches disk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from optim_repair.decisions.comparison import model_of, weights_beside
from optim_repair.decisions.diagnose import Diagnosis, OptimizerDiagnosis, diagnose_optimizer
from optim_repair.decisions.identify import (
    Identification,
    identify_optimizer,
    named_by_options,
    refuse_non_floating_state,
)
from optim_repair.decisions.operations import apply_operations
from optim_repair.decisions.optimizers import (
    LATEST_RELEASE,
    OPTIMIZERS,
    PARAM_SHAPED_KEYS,
    ParamSpec,
    fresh_state,
    options_asked,
)
from optim_repair.errors import Remedy, RepairRefused, UsageError, shown
from optim_repair.records.inventory import OptimizerInventory, ParamKey, TensorMeta, WeightMap
from optim_repair.records.repair_plan import (
    Addition,
    Fill,
    FillChoice,
    FilledOptimizer,
    GroupOption,
    ParamChange,
    PlanFill,
    RepairPlan,
)
from optim_repair.records.request import NO_OPERATIONS, Operations


def default_fill(format: str) -> Fill:
    """What the default fill gives when nothing was added: fresh state for DCP, which cannot store an empty
    mapping; for a torch file, fresh state where it can be built and ``{}`` elsewhere, named ``empty``."""
    return "fresh" if format == "dcp" else "empty"


_INDEX_EMPTY = (
    "index keys name no parameters, so fresh state has no shapes; optimizer.load_state_dict, the loader of index "
    "keys, keeps {} entries lazy and resumes exactly"
)
_NAME_EMPTY = (
    "{} resumes exactly through optimizer.load_state_dict and set_optimizer_state_dict(full_state_dict=False), "
    "not through full_state_dict=True, which gives those parameters a phantom step=1"
)


def _empty_note(opt: OptimizerDiagnosis, where: str, refused: RepairRefused, count: int) -> str:
    """Why the default fill gave ``{}`` to ``count`` parameters of an optimizer, and where that resumes."""
    if opt.optimizer.key_style == "index":
        return f"{where}: {{}} for {count} parameter(s): {_INDEX_EMPTY}"
    reason = refused.reason.removeprefix(f"{where}: ")
    return f"{where}: {{}} for {count} parameter(s), as fresh state cannot be built ({reason}); {_NAME_EMPTY}"


def _refuse_malformed(diagnosis: Diagnosis) -> None:
    for opt in diagnosis.optimizers:
        for finding in opt.malformed:
            where = f"{opt.optimizer.file or diagnosis.inventory.path}:{opt.optimizer.location or '<root>'}"
            raise RepairRefused(
                f"{where}: {finding.code} for {shown(finding.param)} ({finding.detail}); refusing to write a copy "
                f"of a malformed checkpoint (run inspect for every finding)"
            )


def _agrees_with_moments(opt: OptimizerDiagnosis, lookup: dict[str, TensorMeta]) -> bool:
    """Whether a weight map agrees with the shapes of the optimizer's existing moments."""
    for entry in opt.optimizer.entries:
        param = lookup.get(entry.param) if isinstance(entry.param, str) else None
        for key, value in entry.values or ():
            if param is None or key not in PARAM_SHAPED_KEYS or not isinstance(value, TensorMeta):
                continue
            if value.shape != param.shape:
                return False
    return True


def _missing_shapes(opt: OptimizerDiagnosis, weights: Sequence[WeightMap], where: str) -> dict[ParamKey, TensorMeta]:
    """Shapes and dtypes of the missing params, from the one model the optimizer belongs to.

    A weight map must name every missing parameter and agree with the optimizer's existing
    moments; when several such maps disagree about a missing parameter, nothing is guessed.
    """
    if opt.optimizer.key_style == "index":
        raise RepairRefused(
            f"{where}: an index-keyed optimizer (optimizer.state_dict()) names no parameters, so their "
            "shapes cannot be looked up",
            remedy=Remedy("fill", "empty", note=": optimizer.load_state_dict keeps {} entries lazy"),
        )
    candidates: list[tuple[str, dict[ParamKey, TensorMeta]]] = []
    for weight_map in weights:
        lookup = weight_map.lookup()
        if all(param in lookup for param in opt.missing) and _agrees_with_moments(opt, lookup):
            candidates.append((weight_map.source, {p: lookup[p] for p in opt.missing if isinstance(p, str)}))
    if candidates:
        source, shapes = candidates[0]
        for other_source, other in candidates[1:]:
            if any((shapes[p].dtype, shapes[p].shape) != (other[p].dtype, other[p].shape) for p in shapes):
                raise RepairRefused(
                    f"{where}: {source} and {other_source} give different shapes for the missing parameters",
                    remedy=Remedy("model", "PATH", placeholder=True, note=" with this optimizer's model weights"),
                )
        return shapes
    lacking = sorted(str(p) for p in opt.missing if not any(p in w.lookup() for w in weights))
    looked = ", ".join(w.source for w in weights[:6]) + (f" and {len(weights) - 6} more" if len(weights) > 6 else "")
    where_looked = f"looked in {looked}" if weights else "the checkpoint holds no model weights"
    what = (
        f"no parameter shapes for {len(lacking)} parameter(s) without state "
        f"({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}); {where_looked}"
    )
    if not lacking:
        what = f"no model weights that match this optimizer's existing state; {where_looked}"
    raise RepairRefused(
        f"{where}: {what}",
        remedy=Remedy(
            "model",
            "PATH",
            placeholder=True,
            note=" with the model's weights (safetensors, torch file or DCP directory)",
        ),
    )


def _scalar_dtype(opt: OptimizerDiagnosis, where: str, instead: Remedy | None) -> str:
    """torch's scalar dtype in the run, as the existing entries' ``step`` tensors give it (float32 where none is a
    tensor). Entries of a fused group are set aside: fused Adam keeps a float32 ``step`` whatever the scalar dtype.

    torch keeps every other ``step`` in that one dtype, and turns a Python number into it as it loads; steps that
    disagree (a float64 tensor beside a float32 one, or beside a Python float) are refused, not resolved by
    whichever entry comes first.
    """
    fused = {param for group in opt.optimizer.groups if group.option("fused") for param in group.params}
    seen: dict[tuple[bool, str], ParamKey] = {}  # each kind of step (a tensor's dtype, a Python type): its first entry
    for entry in opt.optimizer.entries:
        step = entry.get("step")
        if entry.param in fused or isinstance(step, bool):
            continue
        if isinstance(step, TensorMeta):
            seen.setdefault((True, step.dtype), entry.param)
        elif isinstance(step, (int, float)):
            seen.setdefault((False, type(step).__name__), entry.param)
    if len(seen) > 1:
        found = ", ".join(
            f"{f'a {name} tensor' if tensor else f'a Python {name}'} in {shown(param)}"
            for (tensor, name), param in seen.items()
        )
        raise RepairRefused(
            f"{where}: the existing entries' steps disagree ({found}), so fresh state has no one dtype for its "
            "step: torch keeps every step in one scalar dtype",
            remedy=instead,
        )
    return next((name for tensor, name in seen if tensor), "float32")


def _moment_dtype(opt: OptimizerDiagnosis, weights: Sequence[WeightMap]) -> str | None:
    """The dtype the optimizer keeps its moments in, where that is not its parameters' (torchtitan's bf16 state on
    fp32 parameters, a fused AdamW with bf16 moments): every existing moment of one dtype, each unlike its own
    parameter's in ``weights``. None where the moments follow their parameters, or nothing tells."""
    lookup: dict[str, TensorMeta] = {}
    for weight_map in weights:
        for name, meta in weight_map.lookup().items():
            lookup.setdefault(name, meta)
    pairs = [
        (value.dtype, lookup[entry.param].dtype)
        for entry in opt.optimizer.entries
        if isinstance(entry.param, str) and entry.param in lookup
        for key, value in entry.values or ()
        if key in PARAM_SHAPED_KEYS and isinstance(value, TensorMeta)
    ]
    kept = {moment for moment, _ in pairs}
    if len(kept) == 1 and all(moment != param for moment, param in pairs):
        return kept.pop()
    return None


def _group_options(opt: OptimizerDiagnosis) -> list[GroupOption]:
    """The options the loading torch asks for and the optimizer's groups lack, each with the value that torch
    gives a group without it."""
    inv = opt.optimizer
    values = options_asked(named_by_options(inv.groups), LATEST_RELEASE)
    return [
        GroupOption(inv.file, inv.location, inv.address, group, key, values[key]) for group, key in opt.missing_options
    ]


def _own_shape(opt: OptimizerDiagnosis, param: ParamKey) -> TensorMeta:
    """A phantom entry's parameter, as its own moments give it (they have the parameter's dtype and shape)."""
    entry = next(entry for entry in opt.optimizer.entries if entry.param == param)
    return next(v for k, v in entry.values or () if k in PARAM_SHAPED_KEYS and isinstance(v, TensorMeta))


def _fresh_additions(
    opt: OptimizerDiagnosis,
    kind: str | None,
    weights: Sequence[WeightMap],
    where: str,
    *,
    stores_empty: bool,
    reset: tuple[ParamKey, ...],
) -> tuple[str, list[Addition]]:
    optimizer = opt.optimizer
    instead = Remedy("fill", "empty") if stores_empty else None
    if kind:
        named = f"{where}: its state is not torch's {OPTIMIZERS[kind].torch_class}'s"
        unnamed = replace(instead, note=" instead of naming the optimizer") if instead else None
        refuse_non_floating_state(optimizer.entries, named, unnamed)
        found = Identification(kind, kind)
    else:
        found = identify_optimizer(optimizer.groups, optimizer.entries, where=where, instead=instead)
    scalar_dtype = _scalar_dtype(opt, where, instead)
    shapes = _missing_shapes(opt, weights, where) if opt.missing else {}
    shapes.update({param: _own_shape(opt, param) for param in reset})
    additions = []
    groups = {param: group for group in optimizer.groups for param in group.params}
    moments = _moment_dtype(opt, weights)
    for param in (*opt.missing, *reset):
        meta = shapes[param]
        spec = ParamSpec(moments or meta.dtype, meta.shape)
        state = fresh_state(found.name, groups[param], spec, scalar_dtype=scalar_dtype)
        if not state and not stores_empty:
            continue  # a stateless optimizer (plain SGD): its fresh state is no state, which DCP cannot store
        replaces = param in reset
        additions.append(Addition(optimizer.file, optimizer.location, optimizer.address, param, state, replaces))
    return found.kind, additions


def _group_members(optimizer: OptimizerInventory, joined: dict[ParamKey, int]) -> dict[ParamKey, ParamKey]:
    """For each parameter joining a group: a parameter already in it, whose hyperparameters it takes."""
    members = {}
    for param, group in joined.items():
        listed = [member for member in optimizer.groups[group].params if member not in joined]
        if not listed:
            raise RepairRefused(f"param group {group} lists no parameter whose hyperparameters an added one could take")
        members[param] = listed[0]
    return members


def _check_arguments(fill: str | None, optimizer: str | None) -> None:
    if fill is not None and fill not in ("auto", "empty", "fresh"):
        raise UsageError(f"fill must be 'auto', 'empty' or 'fresh', not {shown(fill)}")
    if optimizer is not None and fill == "empty":
        fresh = Remedy("fill", "fresh")
        raise UsageError("{argument} only applies to the fresh fill", argument="optimizer", remedy=fresh)
    if optimizer is not None and optimizer not in OPTIMIZERS:
        choices = ", ".join(OPTIMIZERS)
        raise UsageError(f"{{argument}} {shown(optimizer)} is not one of: {choices}", argument="optimizer")


def plan_repair(
    diagnosis: Diagnosis,
    fill: FillChoice | None = None,
    *,
    optimizer: str | None = None,
    model_weights: Sequence[WeightMap] = (),
    reset_phantom_step: bool = False,
    operations: Operations = NO_OPERATIONS,
) -> RepairPlan:
    """The entries to add so that every optimizer has an entry for every listed parameter.

    Without ``fill`` (``auto``), every optimizer gets the exact fresh state its optimizer creates on a first step,
    which resumes exactly through every loader; where that cannot be built (the optimizer is not identified
    exactly, or the parameters' shapes are unknown: index keys, no model weights) a torch file's entries get ``{}``,
    and ``fill_notes`` says why and through which loaders ``{}`` resumes exactly. DCP and flattened state dicts,
    which cannot hold ``{}``, are refused there instead. ``reset_phantom_step`` also replaces every entry with
    ``step`` 1 and all-zero moments (a phantom step's state) by what the fill gives a parameter without state.
    ``operations`` rename, drop and add parameters first; the parameters they add are filled like absent ones.
    """
    _check_arguments(fill, optimizer)
    given: Fill | None = None if fill == "auto" else fill
    asked = given or ("fresh" if optimizer is not None else None)  # naming the optimizer asks for its fresh state
    _refuse_malformed(diagnosis)
    if reset_phantom_step and not any(opt.phantom for opt in diagnosis.optimizers):
        raise RepairRefused(
            "no entry has step=1 and all-zero moments: there is no phantom step to reset (inspect reads no "
            "values of DCP entries, so it finds none there)",
            path=diagnosis.inventory.path,
        )
    additions: list[Addition] = []
    kinds: list[FilledOptimizer] = []
    fills: set[Fill] = set()
    changes: list[ParamChange] = []
    notes: list[str] = []
    options = [option for opt in diagnosis.optimizers for option in _group_options(opt)]
    for original in diagnosis.optimizers:
        file = next(f for f in diagnosis.inventory.files if f.file == original.optimizer.file)
        opt, joined = original, {}
        if operations:
            where = f"{original.optimizer.file or diagnosis.inventory.path}:{original.optimizer.location or '<root>'}"
            model = tuple(model_weights) or model_of(original.optimizer, weights_beside(file, diagnosis.inventory))
            applied = apply_operations(original.optimizer, operations, model, where)
            opt = diagnose_optimizer(applied.optimizer, model, original.loader)
            changes.extend(applied.changes)
            joined = applied.joined
        reset = opt.phantom if reset_phantom_step else ()
        if not opt.missing and not reset:
            continue
        inv = opt.optimizer
        stores_empty = file.format != "dcp" and inv.layout == "nested"
        where = f"{inv.file or diagnosis.inventory.path}:{inv.location or '<root>'}"
        weights = tuple(model_weights) or weights_beside(file, diagnosis.inventory)
        chosen = asked or "fresh"
        kind, fresh = "", list[Addition]()
        if chosen == "fresh":
            try:
                kind, fresh = _fresh_additions(opt, optimizer, weights, where, stores_empty=stores_empty, reset=reset)
            except RepairRefused as refused:
                if asked is not None or not stores_empty:
                    raise
                chosen = "empty"  # the default: {} where fresh state cannot be built, saying why
                notes.append(_empty_note(opt, where, refused, len(opt.missing) + len(reset)))
        if chosen == "empty" and not stores_empty:
            why = (
                "a DCP checkpoint (DCP drops empty mappings when it saves)"
                if file.format == "dcp"
                else "a flattened optimizer state dict (an entry exists only through its state.<name>.<key> keys)"
            )
            raise RepairRefused(
                f"the empty fill cannot be stored in {why}",
                path=inv.file or diagnosis.inventory.path,
                remedy=Remedy("fill", "fresh", note=", the default for it"),
            )
        fills.add(chosen)
        like = _group_members(inv, joined) if inv.layout == "flattened" else {}
        if chosen == "empty":
            additions.extend(
                Addition(inv.file, inv.location, inv.address, param, (), group=joined.get(param))
                for param in opt.missing
            )
            additions.extend(Addition(inv.file, inv.location, inv.address, param, (), True) for param in reset)
            continue
        kinds.append(FilledOptimizer(inv.file, inv.location, kind))
        additions.extend(
            replace(addition, group=joined.get(addition.param), like=like.get(addition.param)) for addition in fresh
        )
    described: PlanFill = asked or default_fill(diagnosis.inventory.format)
    if asked is None and fills:
        described = fills.pop() if len(fills) == 1 else "mixed"
    return RepairPlan(
        described, tuple(additions), tuple(kinds), tuple(changes), tuple(options), tuple(notes), diagnosis.newer_forms
    )
