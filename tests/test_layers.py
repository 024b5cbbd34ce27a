"""The house is checked: import contracts hold, and every module says in one line what it is."""

from __future__ import annotations

import ast
import re
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


def test_only_the_storage_layer_reaches_the_s3_client() -> None:
    """boto3 is imported by name at run time (an optional extra), which import contracts do not see: no module
    outside ``storage/`` names it."""
    naming = [
        module.relative_to(PACKAGE).as_posix()
        for module in MODULES
        if module.relative_to(PACKAGE).parts[0] != "storage"
        and ("boto3" in module.read_text() or "botocore" in module.read_text())
    ]
    assert naming == []


def test_each_stores_client_is_imported_in_its_own_package_alone() -> None:
    """A store is its package: boto3 is imported only in ``storage/s3/``, google-auth only in ``storage/gcs/``,
    Azure's SDK only in ``storage/azure/``, and requests (the transport of both) only in those two (by name at run
    time, as an extra is, or by an import statement)."""
    clients = {"boto3|botocore": {"s3"}, "google": {"gcs"}, "azure": {"azure"}, "requests": {"gcs", "azure"}}
    naming = [
        (module.relative_to(PACKAGE).as_posix(), names)
        for module in MODULES
        for names, stores in clients.items()
        if not (module.relative_to(PACKAGE).parts[0] == "storage" and module.relative_to(PACKAGE).parts[1] in stores)
        and re.search(rf'import_module\("({names})[."]|^\s*(import|from) ({names})\b', module.read_text(), re.M)
    ]
    assert naming == []
    own = {"s3": "boto3", "gcs": "google\\.auth", "azure": "azure\\.storage\\.blob"}
    assert all(
        any(
            re.search(rf'import_module\("{client}"', module.read_text())
            for module in (PACKAGE / "storage" / store).glob("*.py")
        )
        for store, client in own.items()
    )


def test_every_module_the_design_names_exists() -> None:
    """docs/design.md draws the house: each path it names (``storage/s3/store.py``, ``tests/...``) is one."""
    text = (ROOT / "docs" / "design.md").read_text()
    named = set(re.findall(r"`((?:[\w.]+/)+[\w.]+\.py)`", text))
    assert len(named) > 20
    missing = [name for name in sorted(named) if not ((PACKAGE / name).exists() or (ROOT / name).exists())]
    assert missing == []


def test_every_format_that_holds_optimizers_has_its_adapter() -> None:
    """A format is a package with an ``adapter.py`` (safetensors too, which holds weights only), and the registry
    plans each role that holds optimizers through one."""
    from optim_repair.formats.registry import ADAPTERS

    homes = {plan.__module__ for plan in ADAPTERS.values()}
    assert homes == {
        "optim_repair.formats.torchfile.adapter",
        "optim_repair.formats.dcp.adapter",
        "optim_repair.formats.deepspeed_universal.adapter",
    }
    formats = sorted(path.parent.name for path in (PACKAGE / "formats").glob("*/__init__.py"))
    assert formats == ["dcp", "deepspeed_universal", "safetensors", "torchfile"]
    assert all((PACKAGE / "formats" / name / "adapter.py").is_file() for name in formats)
