"""``optim-repair demo`` where torch cannot be imported: one line saying it needs torch, not a bug report.

(The demo itself is the README's first command, which CI runs on a fresh machine.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.faces.test_reports import on_terminal

_WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; sys.argv = ['optim-repair', 'demo']\n"
    "from optim_repair.console import main\n"
    "main()\n"
)
"""The installed command's entry point, in a Python where ``import torch`` fails as it does without torch."""


def test_the_demo_without_torch_says_it_needs_torch() -> None:
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "optim-repair: error: the demo trains a model with torch, which is not installed here: pip install torch "
        "(inspect and fix need no torch)\n"
    )
    assert result.stdout == ""


def test_the_demo_tells_its_story_in_one_screen(tmp_path: Path) -> None:
    """On an 80-column terminal, messages included: torch refuses, inspect finds the missing state, fix repairs
    and proves it, and the fresh copy resumes bit-identically, in at most 30 lines, each within the width."""
    shown = on_terminal(tmp_path, "demo", columns=80)
    lines = shown.rstrip("\n").splitlines()
    assert len(lines) <= 30, shown
    assert all(len(line) <= 80 for line in lines), shown
    text = " ".join(shown.split())
    assert "Missing optimizer state" in text or "KeyError" in text
    assert "repairable" in text and "aux_head.weight, aux_head.bias" in text
    assert text.count("bit-identical") >= 2 and "--fill fresh" in text
    (fresh,) = [line for line in lines if line.startswith("│fresh") or line.startswith("|fresh")]
    assert "yes" in fresh
