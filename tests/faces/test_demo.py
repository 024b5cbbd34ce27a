"""``optim-repair demo`` where torch cannot be imported: one line saying it needs torch, not a bug report.

(The demo itself is the README's first command, which CI runs on a fresh machine.)"""

from __future__ import annotations

import subprocess
import sys

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
