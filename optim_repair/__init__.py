"""optim-repair: find and repair missing optimizer state in PyTorch checkpoints.

Library use::

    import optim_repair
    diagnosis = optim_repair.inspect("checkpoint-1000/")
    plan = optim_repair.plan(diagnosis, fill="fresh")  # a dry run: what fix would add
    optim_repair.fix(diagnosis, "checkpoint-1000-fixed/", fill="fresh")
    optim_repair.diff("checkpoint-1000/", "checkpoint-1000-fixed/").same  # what changed, bit for bit

    # in a trainer, instead of torch.distributed.checkpoint.state_dict.set_optimizer_state_dict:
    from optim_repair import set_optimizer_state_dict
"""

from __future__ import annotations

from optim_repair.version import __version__ as __version__

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing would slow the console's start-up
if TYPE_CHECKING:
    from typing import Any

    from optim_repair.api import (
        DryRun,
        FixResult,
        compare,
        diff,
        dry_run,
        fix,
        inspect,
        latest_checkpoint,
        model_changes,
        plan,
    )
    from optim_repair.decisions.diagnose import Diagnosis, Malformed, OptimizerDiagnosis
    from optim_repair.decisions.notices import Notice
    from optim_repair.errors import (
        ExitCode,
        InputError,
        OptimRepairError,
        OutputError,
        Remedy,
        RepairRefused,
        UnsafeInputError,
        UsageError,
        VerificationError,
    )
    from optim_repair.records.difference import Difference, LeafDifference, OptimizerDifference
    from optim_repair.records.repair_plan import Addition, FilledOptimizer, FreshTensor, RepairPlan
    from optim_repair.records.verification import Verification
    from optim_repair.torch_loader import set_optimizer_state_dict
    from optim_repair.version import Versions, versions

_HOMES = {
    **dict.fromkeys(
        (
            "DryRun", "FixResult", "compare", "diff", "dry_run", "fix", "inspect", "latest_checkpoint",
            "model_changes", "plan",
        ),
        "optim_repair.api",
    ),
    **dict.fromkeys(("Versions", "versions"), "optim_repair.version"),
    **dict.fromkeys(("Diagnosis", "Malformed", "OptimizerDiagnosis"), "optim_repair.decisions.diagnose"),
    "Notice": "optim_repair.decisions.notices",
    **dict.fromkeys(("Difference", "LeafDifference", "OptimizerDifference"), "optim_repair.records.difference"),
    **dict.fromkeys(
        (
            "ExitCode", "InputError", "OptimRepairError", "OutputError", "Remedy", "RepairRefused",
            "UnsafeInputError", "UsageError", "VerificationError",
        ),
        "optim_repair.errors",
    ),
    **dict.fromkeys(("Addition", "FilledOptimizer", "FreshTensor", "RepairPlan"), "optim_repair.records.repair_plan"),
    "Verification": "optim_repair.records.verification",
    "set_optimizer_state_dict": "optim_repair.torch_loader",
}  # fmt: skip
"""Where each public name lives. Imported on first use, so that ``import optim_repair`` is instant and
the console entry point can handle an interrupt before anything heavy loads (the loader imports torch)."""

__all__ = [
    "Addition",
    "Diagnosis",
    "Difference",
    "DryRun",
    "ExitCode",
    "FilledOptimizer",
    "FixResult",
    "FreshTensor",
    "InputError",
    "LeafDifference",
    "Malformed",
    "Notice",
    "OptimRepairError",
    "OptimizerDiagnosis",
    "OptimizerDifference",
    "OutputError",
    "Remedy",
    "RepairPlan",
    "RepairRefused",
    "UnsafeInputError",
    "UsageError",
    "Verification",
    "VerificationError",
    "Versions",
    "compare",
    "diff",
    "dry_run",
    "fix",
    "inspect",
    "latest_checkpoint",
    "model_changes",
    "plan",
    "set_optimizer_state_dict",
    "versions",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'optim_repair' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    """What ``dir(optim_repair)`` and completion show: the public names, which load on first use."""
    return sorted({*globals(), *__all__})
