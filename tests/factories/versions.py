"""The installed torch's version, for the tests whose expectations differ between torch releases.

A leaf module (``tests.factories.support`` imports ``models``, which needs these), so that every test and
factory can ask the same question the same way. CI runs the pinned torch; ``scripts/torch_versions.py`` runs
the suite under older ones, where a test either expects that torch's own behaviour or skips with a reason.
"""

from __future__ import annotations

import re

import torch


def _release(version: str) -> tuple[int, int]:
    """``"2.8.0+cu128"`` -> ``(2, 8)``; ``"2.10.0a0+git1234"`` -> ``(2, 10)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    assert match is not None, f"unparsable torch version {version!r}"
    return int(match[1]), int(match[2])


TORCH: tuple[int, int] = _release(torch.__version__)
"""The installed torch's (major, minor)."""

HAS_MUON = hasattr(torch.optim, "Muon")
"""``torch.optim.Muon`` is new in torch 2.9."""

NO_MUON = "torch.optim.Muon is new in torch 2.9"

HAS_ADAFACTOR = hasattr(torch.optim, "Adafactor")
"""``torch.optim.Adafactor`` is new in torch 2.5."""

NO_ADAFACTOR = "torch.optim.Adafactor is new in torch 2.5"

MISSING_STATE_ERROR: type[Exception] = RuntimeError if TORCH >= (2, 10) else KeyError
"""What torch's ``set_optimizer_state_dict`` raises for a parameter without a ``state`` entry: from torch 2.10
a RuntimeError("Missing optimizer state for parameter '<name>' ..."); before, a bare KeyError of the name."""


def missing_state_match(name: str | None = None) -> str:
    """The ``pytest.raises(MISSING_STATE_ERROR, match=...)`` pattern for a parameter without state."""
    if TORCH >= (2, 10):
        return "Missing optimizer state" + ("" if name is None else f" for parameter {re.escape(repr(name))}")
    return "" if name is None else re.escape(repr(name))


NO_DEVICE_MATCH = "Expected device to be set" if TORCH >= (2, 10) else "^$"
"""The message of the AssertionError torch's full_state_dict loader raises for an optimizer without tensor
state (plain SGD): from torch 2.10 it says so; before, a bare ``assert device is not None`` says nothing."""
