"""The compiled scan built once with AddressSanitizer and UBSan (``scripts/scan_sanitized.py``, into a temporary
copy of the package), held to the Python scan on a few hundred differential cases: each ends alike, and neither
sanitizer reports anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_sanitized_compiled_scan_does_as_the_python_one_and_nothing_is_reported() -> None:
    command = [sys.executable, str(ROOT / "scripts" / "scan_sanitized.py"), "--cases", "400", "--seed", "11"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.splitlines() == ["400 cases, 400 agree, 0 sanitizer report lines"], result.stdout[-4000:]
