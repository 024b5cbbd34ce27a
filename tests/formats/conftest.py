"""The two pickle scans, side by side: the Python reference and the compiled one (where ``_scan.c`` was built)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest

from optim_repair.formats import pickle_limits
from optim_repair.formats.pickle_opcodes import PICKLE, OpcodeSet

BUILT = importlib.util.find_spec("optim_repair.formats._scan") is not None
NOT_BUILT = "optim_repair/formats/_scan.c is not built (installed without a C compiler, or a checkout not installed -e)"
SCANNERS = ["pure-python", pytest.param("compiled", marks=pytest.mark.skipif(not BUILT, reason=NOT_BUILT))]
"""``pickle_limits.SCANNER``'s values, the compiled one skipped where it was not built."""

Scan = Callable[[Any, int, OpcodeSet], tuple[int, bool]]


def outcome(scan: Scan, data: Any, pos: int = 0, allowed: OpcodeSet = PICKLE) -> tuple[object, object]:
    """What a scan makes of ``data``: ``("scanned", (end, exact))``, or the exception's class and message."""
    try:
        return "scanned", scan(data, pos, allowed)
    except Exception as exc:
        return type(exc), str(exc)


def checked(data: Any, pos: int = 0, allowed: OpcodeSet = PICKLE) -> tuple[int, bool]:
    """The compiled scan of ``data`` (a bytes copy for the reference), once it is shown to do as the Python one."""
    compiled = outcome(compiled_scan, data, pos, allowed)
    assert compiled == outcome(pickle_limits.scan_python, bytes(data), pos, allowed), bytes(data)[:200]
    return compiled_scan(data, pos, allowed)


compiled_scan: Scan = pickle_limits.scan_compiled


@pytest.fixture(params=SCANNERS)
def both_scans(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``pickle_limits.scan`` (and so ``check_pickle``) runs the Python scan, then the compiled one, each checked
    against the Python one on every input it is given."""
    monkeypatch.setattr(pickle_limits, "SCANNER", request.param)
    if request.param == "compiled":
        monkeypatch.setattr(pickle_limits, "scan_compiled", checked)
    return str(request.param)
