"""The library's front door: what the CLI calls, and what training code can call directly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optim_repair.checkpoint import read_checkpoint, read_model_weights
from optim_repair.diagnose import Diagnosis, diagnose
from optim_repair.repair import Fill, RepairPlan, plan_repair
from optim_repair.verify import Verification
from optim_repair.writer import Progress, write_copy


def inspect(path: str | Path) -> Diagnosis:
    """Read ``path`` (a torch file, a checkpoint directory or a DCP directory) and diagnose it.

    Reads no tensor bytes (only ``step`` values); never unpickles unsafely.
    Raises ``optim_repair.errors.InputError`` when there is nothing to inspect.
    """
    return diagnose(read_checkpoint(Path(path)))


@dataclass(frozen=True)
class FixResult:
    diagnosis: Diagnosis
    plan: RepairPlan
    out: Path
    verification: Verification


def fix(
    path: str | Path,
    out: str | Path,
    *,
    fill: Fill | None = None,
    optimizer: str | None = None,
    model: str | Path | None = None,
    force: bool = False,
    link: bool = False,
    progress: Progress = lambda message: None,
) -> FixResult:
    """Write a repaired copy of ``path`` to ``out``, verified from disk; ``path`` is never modified.

    ``fill`` is ``"empty"`` (add ``{}``; the default for torch files) or ``"fresh"`` (the exact state
    the optimizer creates on a first step; the default for DCP). Raises an ``OptimRepairError``
    subclass, leaving nothing at ``out``, when the input is malformed or the copy cannot be made.
    """
    diagnosis = inspect(path)
    weights = read_model_weights(Path(model)) if model is not None else ()
    plan = plan_repair(diagnosis, fill, optimizer=optimizer, model_weights=weights)
    verification = write_copy(diagnosis.inventory, plan, Path(out), force=force, link=link, progress=progress)
    return FixResult(diagnosis, plan, Path(out), verification)
