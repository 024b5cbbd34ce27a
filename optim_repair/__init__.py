"""optim-repair: find and repair missing optimizer state in PyTorch checkpoints.

Library use::

    import optim_repair
    diagnosis = optim_repair.inspect("checkpoint-1000/")
    optim_repair.fix("checkpoint-1000/", "checkpoint-1000-fixed/", fill="fresh")

    # in a trainer, instead of torch.distributed.checkpoint.state_dict.set_optimizer_state_dict:
    from optim_repair import set_optimizer_state_dict
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from optim_repair.api import FixResult, fix, inspect
from optim_repair.errors import (
    InputError,
    OptimRepairError,
    OutputError,
    RepairRefused,
    UnsafeInputError,
    UsageError,
    VerificationError,
)

if TYPE_CHECKING:
    from optim_repair.loader import set_optimizer_state_dict

__version__ = "0.1.0"

__all__ = [
    "FixResult",
    "InputError",
    "OptimRepairError",
    "OutputError",
    "RepairRefused",
    "UnsafeInputError",
    "UsageError",
    "VerificationError",
    "fix",
    "inspect",
    "set_optimizer_state_dict",
]


def __getattr__(name: str) -> Any:
    # The loader imports torch; load it only when a trainer asks for it.
    if name == "set_optimizer_state_dict":
        from optim_repair.loader import set_optimizer_state_dict

        return set_optimizer_state_dict
    raise AttributeError(f"module 'optim_repair' has no attribute {name!r}")
