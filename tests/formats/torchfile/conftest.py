"""Fixtures of the torch-file tests: a repaired copy written by the tool's own writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from optim_repair.formats.torchfile import write_torch_file
from optim_repair.records.repair_plan import Addition
from tests.factories.built import Built
from tests.factories.support import empty_additions


@pytest.fixture
def tricky_copy(tricky_checkpoint: Built, tmp_path: Path) -> tuple[Built, Path, list[Addition]]:
    """A correct repaired copy of the tricky checkpoint, written by the tool's own writer."""
    out = tmp_path / "copy.pt"
    planned = empty_additions(tricky_checkpoint)
    write_torch_file(tricky_checkpoint.path, "tricky", planned, out)
    return tricky_checkpoint, out, planned
