"""Notices: warnings and information with stable codes, and what each loader does with parameters without state.

The loader a layout implies decides what happens to absent entries, ``{}`` entries and a phantom step's
state; each notice says so in the user's words. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from optim_repair.decisions.identify import guess_optimizer
from optim_repair.errors import shown_name
from optim_repair.records.inventory import CheckpointInventory, FileInventory, OptimizerInventory, ParamKey

Loader = Literal["load_state_dict", "set_optimizer_state_dict", "dcp.load", "lightning-fsdp", "deepspeed-universal"]
"""The loader a layout implies: ``optimizer.load_state_dict`` for index keys (``optimizer.state_dict()``),
torch's ``set_optimizer_state_dict`` for parameter names, ``dcp.load`` for a DCP checkpoint, for Lightning's
sharded FSDP checkpoint (a DCP checkpoint with its ``meta.pt``) ``lightning-fsdp``: its FSDPStrategy's
``load_sharded_optimizer_state_dict`` and ``FSDP.optim_state_dict_to_load``, and for a DeepSpeed universal
checkpoint ``deepspeed-universal``: DeepSpeed's ``load_checkpoint`` with ``load_universal``."""
LAZY_LOADERS: frozenset[Loader] = frozenset({"load_state_dict", "lightning-fsdp"})
"""The loaders that resume absent entries exactly, creating them as the optimizer would have."""
Severity = Literal["info", "warning"]


@dataclass(frozen=True)
class Notice:
    """A warning or a piece of information, with a stable ``code``."""

    code: str
    detail: str
    severity: Severity = "warning"


def _phantom_kind(optimizer: OptimizerInventory) -> str | None:
    """The optimizer kind, when a phantom step (what torch's full-state loader gives a parameter without
    state) changes how it trains; None when it does not.

    That loader's ``_init_optim_state`` runs a zero-gradient, lr=0 step on every parameter without
    state. It is harmless for RMSprop, Adadelta and Muon (whose zero momentum stays zero), and for SGD
    unless momentum is used with dampening; every other lazy optimizer then takes a different first
    step. An optimizer not identified exactly is assumed affected.
    """
    found = guess_optimizer(optimizer.groups, optimizer.entries)
    if found is None:
        return "an unidentified optimizer"
    if found.name in ("rmsprop", "adadelta", "muon"):
        return None
    if found.name == "sgd" and not any(g.option("momentum") and g.option("dampening") for g in optimizer.groups):
        return None
    return found.kind


def shown_params(params: tuple[ParamKey, ...], limit: int = 8) -> str:
    names = ", ".join(shown_name(param) if isinstance(param, str) else str(param) for param in params[:limit])
    return f"{names}, and {len(params) - limit} more" if len(params) > limit else names


def _stock_loader_phantom(optimizer: OptimizerInventory, missing: int, empty: int) -> Notice | None:
    """What torch's ``set_optimizer_state_dict(full_state_dict=True)`` does to parameters without state."""
    kind = _phantom_kind(optimizer) if missing or empty else None
    if kind is None:
        return None
    remedies = "load with optim_repair.set_optimizer_state_dict"
    if missing:
        remedies = f"optim-repair fix --fill fresh, or {remedies}"
    if empty:
        remedies += " ({} entries stay {}: --fill fresh fills absent entries only, so run it on the original)"
    if empty:
        what = (
            f"{missing + empty} parameter(s) without state would get a phantom step=1 from torch's stock "
            f"set_optimizer_state_dict with full_state_dict=True (torch 2.6 and later) and train differently "
            f"({kind}); with the default full_state_dict=False, {{}} entries resume exactly"
        )
    else:
        what = (
            f"torch's stock set_optimizer_state_dict refuses the {missing} absent entries (\"Missing optimizer "
            'state" from torch 2.10, a KeyError before); {} entries would make it load, exactly with the default '
            "full_state_dict=False, but with full_state_dict=True (torch 2.6 and later) they would get a phantom "
            f"step=1 and train differently ({kind})"
        )
    return Notice("stock-loader-phantom-step", f"{what}; remedies: {remedies}")


def _dcp_missing_key(optimizer: OptimizerInventory, missing: tuple[ParamKey, ...]) -> Notice:
    """What ``dcp.load`` into a ``get_optimizer_state_dict`` template does with absent entries."""
    detail = f'dcp.load fails with "Missing key in checkpoint state_dict" on the {len(missing)} absent entries'
    kind = _phantom_kind(optimizer)
    if kind is not None:
        detail += (
            "; with allow_partial_load=True it loads, and set_optimizer_state_dict(full_state_dict=True) "
            f"then gives them a phantom step=1 (torch 2.6 and later) and they train differently ({kind})"
        )
    return Notice("dcp-missing-key", f"{detail}; remedy: optim-repair fix (exact fresh state, the default for DCP)")


def _flattened_missing(missing: tuple[ParamKey, ...]) -> Notice:
    """What torch's loader does with a flattened optimizer state dict that lacks entries (pytorch#192224)."""
    return Notice(
        "flattened-missing-state",
        "torch's set_optimizer_state_dict(flatten_optimizer_state_dict=True) fails on the "
        f'{len(missing)} absent entries ("TypeError: float() argument must be a string or a real number, not '
        "'dict'\" from torch 2.10, a KeyError of the absent flattened key before); remedy: optim-repair fix "
        "(exact fresh state, the default for flattened state: it cannot hold {})",
    )


def _index_keyed_sparse(missing: tuple[ParamKey, ...]) -> Notice:
    """Absent entries are what ``optimizer.load_state_dict``, the loader index keys are made for, resumes exactly."""
    return Notice(
        "sparse-ok-for-load-state-dict",
        f"optimizer.load_state_dict (HF Trainer, Accelerate, Lightning) resumes the {len(missing)} absent "
        f"entries exactly, as the optimizer would have created them ({shown_params(missing)}); only a loader that "
        "needs every entry (torch's set_optimizer_state_dict) needs a repair: inspect --strict counts them",
        "info",
    )


def dcp_missing_options(
    optimizer: OptimizerInventory, lacking: tuple[tuple[int, str], ...], release: tuple[int, int]
) -> Notice:
    """What ``dcp.load`` of the loading torch does with param-group options the checkpoint lacks."""
    root = ".".join(str(part) for part in optimizer.address)
    keys = [f"{root}.param_groups.{group}.{key}" for group, key in lacking]
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return Notice(
        "dcp-missing-option",
        f'torch {release[0]}.{release[1]}\'s dcp.load fails with "Missing key in checkpoint state_dict: {keys[0]}": '
        f"its optimizer writes {shown}, which the torch that saved this checkpoint did not; fix adds each with the "
        "value that torch gives a group without it",
    )


def _lightning_sharded(missing: tuple[ParamKey, ...]) -> Notice:
    """Lightning's sharded FSDP checkpoint resumes through loaders that leave absent entries absent."""
    return Notice(
        "lightning-sharded",
        f"Lightning's FSDPStrategy resumes this sharded checkpoint (its meta.pt is beside it) through "
        "load_sharded_optimizer_state_dict and FSDP.optim_state_dict_to_load, which resume the "
        f"{len(missing)} absent entries exactly ({shown_params(missing)}); only dcp.load into a "
        "get_optimizer_state_dict template needs a repair (Missing key): inspect --strict counts them",
        "info",
    )


FSDP1_EMPTY_ERROR = "The state of _OptimStateKey(...) is empty"
"""What FSDP1's ``FSDP.optim_state_dict_to_load`` raises on a ``{}`` entry (with ``use_orig_params=False``, its
default)."""


def fsdp1_loader(missing: int, empty: int) -> Notice:
    """What FSDP1's loader does with a name-keyed file. ``FSDP.optim_state_dict`` (FULL_STATE_DICT) writes what
    ``get_optimizer_state_dict`` writes, so a file cannot say which of the two wrote it."""
    loader = (
        "if FSDP1's FSDP.optim_state_dict wrote this file (it writes what get_optimizer_state_dict writes), "
        "its loader FSDP.optim_state_dict_to_load"
    )
    exact = f"resumes the {missing} absent entries exactly, as they are"
    fresh = "resumes exactly through it and through set_optimizer_state_dict"
    if empty:
        also = f"; it {exact}" if missing else ""
        what = (
            f'{loader} raises on the {empty} {{}} entries ("{FSDP1_EMPTY_ERROR}"){also}: resume from the file '
            f"before {{}} was added, or from its copy made with optim-repair fix --fill fresh, which {fresh}"
        )
    else:
        what = (
            f'{loader} {exact}, but raises on {{}} entries ("{FSDP1_EMPTY_ERROR}"): a copy optim-repair fix fills '
            f"with {{}} (--fill empty, or the default where fresh state cannot be built) breaks it, while fresh state "
            f"(--fill fresh, the default where it can be built) {fresh}"
        )
    return Notice("fsdp1-loader", what)


def fsdp1_after_fill(added_empty: int) -> str:
    """The fix summary's word on ``{}`` entries added to a name-keyed torch file, which FSDP1's loader rejects."""
    return (
        f"the {added_empty} {{}} entries suit set_optimizer_state_dict(full_state_dict=False) and "
        "optimizer.load_state_dict, but FSDP1's FSDP.optim_state_dict_to_load raises on them "
        f'("{FSDP1_EMPTY_ERROR}"): '
        "if FSDP1 wrote this file, resume from the original, or from a copy made with --fill fresh, which resumes "
        "exactly through every loader"
    )


def loader_notices(
    optimizer: OptimizerInventory, loader: Loader, missing: tuple[ParamKey, ...], empty: int
) -> list[Notice]:
    """What the loader the layout implies does with the parameters that have no state."""
    if loader == "load_state_dict":
        return [_index_keyed_sparse(missing)] if missing else []
    if loader == "dcp.load":
        return [_dcp_missing_key(optimizer, missing)] if missing else []
    if loader == "lightning-fsdp":
        return [_lightning_sharded(missing)] if missing else []
    if loader == "deepspeed-universal":
        return [_universal_missing(missing)] if missing else []
    if optimizer.layout == "flattened":
        return [_flattened_missing(missing)] if missing else []
    phantom = _stock_loader_phantom(optimizer, len(missing), empty)
    found = [phantom] if phantom is not None else []
    return [*found, fsdp1_loader(len(missing), empty)] if missing or empty else found


def _universal_missing(missing: tuple[ParamKey, ...]) -> Notice:
    return Notice(
        "universal-missing-state",
        f"{len(missing)} parameters of this DeepSpeed universal checkpoint have no exp_avg.pt, exp_avg_sq.pt or "
        f"step.pt and are not frozen ({shown_params(missing)}): load_checkpoint with load_universal reads them for "
        "every parameter it steps, so the resume fails; DeepSpeed writes them for every such parameter, so the "
        "conversion was cut short: run ds_to_universal on the ZeRO checkpoint again (fix does not write them)",
    )


def loader_of(key_style: str, file_format: str, writer: str | None = None) -> Loader:
    """The loader a layout implies (see ``Loader``)."""
    if file_format == "dcp":
        return "lightning-fsdp" if writer == "lightning" else "dcp.load"
    if file_format == "deepspeed-universal":
        return "deepspeed-universal"
    return "load_state_dict" if key_style == "index" else "set_optimizer_state_dict"


def phantom_entries(phantom: tuple[ParamKey, ...]) -> Notice:
    return Notice(
        "phantom-step-entries",
        f"{len(phantom)} entries have step=1 and all-zero moments ({shown_params(phantom)}): the state torch's "
        "full-state loader gives a parameter without state (UniRL checkpoints before its PR #440 carry it for "
        "never-updated parameters); fix --reset-phantom-step turns them back into the state the optimizer would have",
    )


def checkpoint_notices(inventory: CheckpointInventory, loading: tuple[int, int] | None) -> list[Notice]:
    """The notices about a checkpoint as a whole: files skipped, read by no torch as old as ``loading`` (the torch
    that will load it), or holding DeepSpeed's partitions, and links that reach outside it."""
    notices = []
    unsafe = [skip.file for skip in inventory.skipped if skip.kind == "unsafe"]
    if unsafe:
        notices.append(
            Notice(
                "skipped-unsafe",
                f"{len(unsafe)} file(s) would import code if loaded and were skipped: {shown_params(tuple(unsafe))}",
            )
        )
    for file in newer_forms(inventory, loading):
        newer = file.reads_from
        assert loading is not None and newer is not None  # what newer_forms found
        notices.append(
            Notice(
                "newer-torch-metadata",
                f"{file.file or inventory.path}: torch {loading[0]}.{loading[1]} cannot read this DCP .metadata, "
                f'which torch {newer[0]}.{newer[1]} or later wrote (its TensorProperties record strides: "too '
                'many values to unpack (expected 5)"); fix writes the form it reads (resume with '
                f"torch {newer[0]}.{newer[1]} or later, or fix with --for-torch {newer[0]}.{newer[1]}, to keep "
                "this one)",
            )
        )
    zero = [skip.file for skip in inventory.skipped if skip.kind == "deepspeed-zero"]
    if zero:
        notices.append(
            Notice(
                "deepspeed-zero",
                f"DeepSpeed ZeRO partitioned state in {len(zero)} file(s) ({shown_params(tuple(zero))}): ZeRO keeps "
                "flat partitions per group, not per-parameter entries, so missing entries do not apply; DeepSpeed's "
                "load_checkpoint resumes it",
                "info",
            )
        )
    if inventory.links_outside:
        links = inventory.links_outside
        notices.append(
            Notice(
                "links-outside",
                f"{len(links)} symbolic link(s) point outside the checkpoint and are kept as links in a copy, where "
                f"a relative one may reach nothing: {shown_params(links)}; fix --dereference copies what they reach",
                "info",
            )
        )
    return notices


def newer_forms(inventory: CheckpointInventory, loading: tuple[int, int] | None) -> list[FileInventory]:
    """The files of ``inventory`` that torch ``loading`` cannot read: a newer torch wrote them in a newer form."""
    if loading is None:
        return []
    return [file for file in inventory.files if file.reads_from is not None and loading < file.reads_from]
