"""A fast slice of ``scripts/fuzz``: a few hundred mutated checkpoints, each a documented error or a result.

The full run (``python scripts/fuzz --cases 20000``) is the trial the project is held to; this slice
keeps every mutator exercised on every change.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_a_slice_of_the_fuzzer_finds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the fuzzer's worker imports the package by name
    fuzz = importlib.import_module("fuzz")
    summary = fuzz.run(300, seed=7, out=tmp_path / "findings", corpus=tmp_path / "corpus", timeout=30)
    assert summary.cases == 300 and summary.fuzzer_errors == 0
    assert summary.findings == 0, fuzz.format_summary(summary, tmp_path / "findings")
