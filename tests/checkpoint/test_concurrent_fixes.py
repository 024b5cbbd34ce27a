"""Two ``fix`` runs into one ``--out`` at once, as every node of a job running the same resume script starts them.

Of the two installed commands started together, exactly one writes the copy (exit 0); the other exits 5 in one line
(``already exists`` when the winner's copy was in place before the loser began to write, ``appeared while the copy
was written`` when the two raced to the rename), and neither leaves a temporary beside ``--out``. The copy in place
is whole: stock DCP (or ``torch.load``) resumes from it, and ``inspect`` finds it healthy.
"""

from __future__ import annotations

import re
import subprocess
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

import optim_repair
from tests.factories import dcp as dk
from tests.factories import trainers
from tests.factories.built import Built, Site
from tests.factories.support import assert_fixed_copy, installed_command, untouched

TRIALS = 20

LOSER = re.compile(
    r"optim-repair: error: (?P<out>.+): (?P<why>already exists|appeared while the copy was written); "
    r"pass --force to replace it\n"
)


def _race(source: Path, out: Path) -> list[tuple[int, str, str]]:
    """Start two ``optim-repair fix SOURCE --out OUT --quiet`` at once; their exit codes, stdouts and stderrs."""
    command = [*installed_command(), "fix", str(source), "--out", str(out), "--quiet"]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=120)
        results.append((run.returncode, stdout, stderr))
    return results


def _checkpoint(kind: str, root: Path) -> Built:
    """A small repairable checkpoint: a DCP directory (its copy is a directory), or one torch file (a file)."""
    if kind == "dcp":
        return dk.unirl_dcp(root)
    built = trainers.unirl_torch(root)
    return Built(built.path / "checkpoint.pt", {Site("", site.address): m for site, m in built.missing.items()})


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    """The parameters of the run that was never interrupted, which a resume from the DCP copy must reach."""
    return dk.uninterrupted()


@pytest.mark.parametrize("kind", ["dcp", "torch-file"])
def test_two_fixes_into_one_out_leave_one_whole_copy(
    kind: str, tmp_path: Path, expected: dict[str, torch.Tensor]
) -> None:
    built = _checkpoint(kind, tmp_path / "in")
    losses: Counter[str] = Counter()
    with untouched(built.path):
        for trial in range(TRIALS):
            beside = tmp_path / f"trial{trial}"
            beside.mkdir()
            out = beside / ("out" if kind == "dcp" else "out.pt")
            results = _race(built.path, out)
            described = "\n".join(f"exit {code}\n--- stdout\n{so}--- stderr\n{se}" for code, so, se in results)
            assert sorted(code for code, _, _ in results) == [0, 5], f"trial {trial}:\n{described}"
            (_, won, won_errors), (_, _, lost_errors) = sorted(results)
            assert won and not won_errors, f"trial {trial}:\n{described}"
            loser = LOSER.fullmatch(lost_errors)
            assert loser and loser["out"] == str(out), f"trial {trial}: the loser says one line:\n{described}"
            losses[loser["why"]] += 1
            assert sorted(beside.iterdir()) == [out], f"trial {trial}: something else is left beside {out}"
            _assert_whole(kind, built, out, expected)
    print(f"{kind}: {dict(losses)}")  # how often the loser found the copy in place, and how often it raced


def _assert_whole(kind: str, built: Built, out: Path, expected: dict[str, torch.Tensor]) -> None:
    """The copy at ``out`` holds everything the original does, loads as the trainer loads it, and is healthy."""
    if kind == "dcp":
        copy = dk.files(out)
        unchanged = {name: data for name, data in dk.files(built.path).items() if name != ".metadata"}
        assert all(copy.get(name) == data for name, data in unchanged.items()), "every shard is in the copy, as it was"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.distributed is not initialized: DCP says so, and loads
            resumed = dk.resume(out, "adamw", "optim", flatten=False)
        assert all(torch.equal(resumed[name], expected[name]) for name in expected), "resumes exactly"
    else:
        assert_fixed_copy(
            built, out, fill="fresh"
        )  # the missing entries added (fresh: the default), all else as it was
    assert optim_repair.inspect(out, strict=True).verdict == "healthy"
