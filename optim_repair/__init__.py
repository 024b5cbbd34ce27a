"""optim-repair: find and repair missing optimizer state in PyTorch checkpoints.

Library use::

    import optim_repair
    diagnosis = optim_repair.inspect("checkpoint-1000/")
    plan = optim_repair.plan(diagnosis, fill="fresh")  # a dry run: what fix would add
    optim_repair.fix(diagnosis, "checkpoint-1000-fixed/", fill="fresh")

    # in a trainer, instead of torch.distributed.checkpoint.state_dict.set_optimizer_state_dict:
    from optim_repair import set_optimizer_state_dict
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from optim_repair.api import FixResult, fix, inspect, plan
from optim_repair.diagnose import Diagnosis, Malformed, Notice, OptimizerDiagnosis
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
from optim_repair.repair_plan import Addition, FilledOptimizer, FreshTensor, RepairPlan
from optim_repair.verify import Verification

if TYPE_CHECKING:
    from optim_repair.torch_loader import set_optimizer_state_dict

__version__ = "0.1.0"

__all__ = [
    "Addition",
    "Diagnosis",
    "ExitCode",
    "FilledOptimizer",
    "FixResult",
    "FreshTensor",
    "InputError",
    "Malformed",
    "Notice",
    "OptimRepairError",
    "OptimizerDiagnosis",
    "OutputError",
    "Remedy",
    "RepairPlan",
    "RepairRefused",
    "UnsafeInputError",
    "UsageError",
    "Verification",
    "VerificationError",
    "fix",
    "inspect",
    "plan",
    "set_optimizer_state_dict",
]


def __getattr__(name: str) -> Any:
    # The loader imports torch; load it only when a trainer asks for it.
    if name == "set_optimizer_state_dict":
        from optim_repair.torch_loader import set_optimizer_state_dict

        return set_optimizer_state_dict
    raise AttributeError(f"module 'optim_repair' has no attribute {name!r}")
