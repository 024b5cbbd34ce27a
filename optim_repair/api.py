"""The library's front door: what the CLI calls, and what training code can call directly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optim_repair.diagnose import Diagnosis, diagnose
from optim_repair.discovery import discover
from optim_repair.output import write_copy
from optim_repair.progress import Notice, Progress, ignore
from optim_repair.reading import Parsed, read_discovered, read_model_weights
from optim_repair.repair import plan_repair
from optim_repair.repair_plan import Fill, RepairPlan
from optim_repair.verify import Verification


def inspect(path: str | Path) -> Diagnosis:
    """Read ``path`` (a torch file, a checkpoint directory or a DCP directory) and diagnose it.

    Reads no tensor bytes (only ``step`` values); never unpickles unsafely.
    Raises ``optim_repair.errors.InputError`` when there is nothing to inspect.
    """
    return diagnose(read_discovered(discover(Path(path))))


def plan(
    checkpoint: str | Path | Diagnosis,
    *,
    fill: Fill | None = None,
    optimizer: str | None = None,
    model: str | Path | None = None,
) -> RepairPlan:
    """What ``fix`` would add, and with what, without writing anything (a dry run).

    ``checkpoint`` is a path, or the ``Diagnosis`` that ``inspect`` returned for it.
    Raises ``RepairRefused`` when no repair can be built as asked.
    """
    diagnosis = checkpoint if isinstance(checkpoint, Diagnosis) else inspect(checkpoint)
    weights = read_model_weights(Path(model)) if model is not None else ()
    return plan_repair(diagnosis, fill, optimizer=optimizer, model_weights=weights)


@dataclass(frozen=True)
class FixResult:
    """What ``fix`` found, added, wrote and proved."""

    diagnosis: Diagnosis
    plan: RepairPlan
    out: Path
    verification: Verification


def fix(
    checkpoint: str | Path | Diagnosis,
    out: str | Path,
    *,
    fill: Fill | None = None,
    optimizer: str | None = None,
    model: str | Path | None = None,
    force: bool = False,
    link: bool = False,
    sync: bool = True,
    progress: Progress = ignore,
    notice: Notice = lambda message: None,
) -> FixResult:
    """Write a repaired copy of ``checkpoint`` to ``out``, verified as read back; the input is never modified.

    ``checkpoint`` is a path, or the ``Diagnosis`` that ``inspect`` returned for it (not read again).
    ``fill`` is ``"empty"`` (add ``{}``; the default for torch files) or ``"fresh"`` (the exact state
    the optimizer creates on a first step; the default for DCP). Raises an ``OptimRepairError``
    subclass, leaving nothing at ``out``, when the input is malformed or the copy cannot be made.
    ``link`` hard-links the files the repair does not change instead of copying them; ``sync=False``
    skips syncing the copy to the disk (a scratch copy: a crash may lose it, never the input).
    ``progress`` hears of the bytes written and verified (``optim_repair.progress.Step``); ``notice``
    gets lines of text for the user.
    """
    parsed = Parsed()  # what reading parsed, for the writer not to parse it again
    if isinstance(checkpoint, Diagnosis):
        diagnosis, found = checkpoint, discover(Path(checkpoint.inventory.path))
    else:
        found = discover(Path(checkpoint))
        diagnosis = diagnose(read_discovered(found, keep=parsed))
    repair = plan(diagnosis, fill=fill, optimizer=optimizer, model=model)
    verification = write_copy(
        found,
        diagnosis.inventory,
        repair,
        Path(out),
        force=force,
        link=link,
        sync=sync,
        parsed=parsed,
        progress=progress,
        notice=notice,
    )
    return FixResult(diagnosis, repair, Path(out), verification)
