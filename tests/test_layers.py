"""The house is checked: import contracts hold, and every module says in one line what it is."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import optim_repair

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(optim_repair.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_import_contracts_hold() -> None:
    """The layers and forbidden imports written in pyproject.toml ([tool.importlinter])."""
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert command, "import-linter is a test dependency"
    result = subprocess.run([command, "--config", str(ROOT / "pyproject.toml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module", MODULES, ids=lambda path: path.relative_to(PACKAGE).as_posix())
def test_every_module_says_what_it_is(module: Path) -> None:
    docstring = ast.get_docstring(ast.parse(module.read_text()))
    assert docstring, f"{module.name} has no docstring"
    assert docstring.splitlines()[0].endswith((".", ":")), "the first line is a sentence"
    assert len(module.read_text().splitlines()) <= 420, "a module this long holds more than one concern"
