"""Factories of real checkpoints for tests, by what they build; ``FACTORIES``: each that needs only a directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.factories.built import Built
from tests.factories.defects import MALFORMED, cold, empty_entries, healthy, phantom_step, tricky_tensors
from tests.factories.trainers import (
    accelerate,
    bug_report,
    hf_trainer,
    legacy_format,
    lightning,
    multi_optimizer,
    petrainer,
    unirl_torch,
)

FACTORIES: dict[str, Callable[[Path], Built]] = {
    "unirl_torch": unirl_torch,
    "petrainer": petrainer,
    "hf_trainer": hf_trainer,
    "accelerate": accelerate,
    "lightning": lightning,
    "multi_optimizer": multi_optimizer,
    "legacy_format": legacy_format,
    "bug_report": bug_report,
    "healthy": healthy,
    "cold": cold,
    "phantom_step": phantom_step,
    "empty_entries": empty_entries,
    "tricky_tensors": tricky_tensors,
    **MALFORMED,
}
"""Every factory that needs only a directory, by name."""
