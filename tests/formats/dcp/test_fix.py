"""``optim-repair inspect`` and ``fix`` on DCP checkpoints, end to end through the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from optim_repair.formats.dcp import read_dcp
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import trainers
from tests.factories.dcp import only


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_a_plain_fix_resumes_bit_identically_through_torchs_own_loaders(tmp_path: Path, flatten: bool) -> None:
    built = dk.unirl_dcp(tmp_path / "in", flatten=flatten)
    key = "optim"
    before = _digests(built.path)
    report = json.loads(run_cli(["inspect", built.path, "--json"], code=1).stdout)
    assert report["format"] == "dcp" and report["verdict"] == "repairable"
    assert [opt["location"] for opt in report["optimizers"]] == [key]
    assert report["optimizers"][0]["missing"] == list(built.all_missing)

    out = tmp_path / "fixed"
    fixed = json.loads(run_cli(["fix", built.path, "--out", out, "--json"]).stdout)
    assert fixed["fill"] == "fresh" and fixed["verification"]["tensors"] > 0
    assert sorted(a["param"] for a in fixed["added"]) == sorted(built.all_missing)
    assert _digests(built.path) == before

    resumed = dk.resume(out, "adamw", key, flatten)
    reference = dk.uninterrupted("adamw")
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    assert json.loads(run_cli(["inspect", out, "--json"]).stdout)["verdict"] == "healthy"


def test_a_torchtitan_checkpoint_is_repaired_into_one_torch_loads(tmp_path: Path) -> None:
    built = dk.torchtitan_dcp(tmp_path / "in")
    out = tmp_path / "fixed"
    run_cli(["fix", built.path, "--out", out])
    dk.resume(out, "adamw", "optimizer", True, top_level=True)  # stock dcp.load + set_optimizer_state_dict accept it
    report = json.loads(run_cli(["inspect", out, "--json"]).stdout)
    assert report["verdict"] == "healthy" and report["optimizers"][0]["location"] == "optimizer"


def test_shapes_are_found_at_the_top_level_and_in_a_model_only_step(tmp_path: Path) -> None:
    """torchtitan keeps the weights at the top level, and its last step may hold the model only: both give
    the shapes of the parameters without state, as the checkpoint itself or as --model."""
    optimizer_only = dk.flattened_without_model(tmp_path / "in").path
    refused = run_cli(["fix", optimizer_only, "--out", tmp_path / "a", "--fill", "fresh"], code=3)
    assert (
        "no parameter shapes for 2 parameter(s) without state (head.proj.bias, head.proj.weight); "
        "the checkpoint holds no model weights; pass --model PATH"
    ) in refused.stderr
    model_only = dk.torchtitan_model_only(tmp_path / "titan")
    run_cli(["fix", optimizer_only, "--out", tmp_path / "b", "--model", model_only])
    fixed = only(read_dcp(tmp_path / "b", ""))
    assert dk.missing_params(fixed) == () and {e.param for e in fixed.entries} >= set(dk.HEAD)
    other = tmp_path / "other.safetensors"
    trainers.save_safetensors({"unrelated.weight": torch.zeros(2)}, other)
    mismatch = run_cli(["fix", optimizer_only, "--out", tmp_path / "c", "--model", other], code=3)
    assert f"looked in {other}" in mismatch.stderr


def test_fill_empty_is_refused_for_dcp_and_nothing_is_written(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    result = run_cli(["fix", built.path, "--out", tmp_path / "fixed", "--fill", "empty"], code=3)
    assert "DCP drops empty mappings" in result.stderr
    assert not (tmp_path / "fixed").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]


def test_unchanged_files_are_copied_byte_identical_or_hard_linked(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    for link, out in ((False, tmp_path / "copied"), (True, tmp_path / "linked")):
        run_cli(["fix", built.path, "--out", out, *(["--link"] if link else [])])
        for original in built.path.iterdir():
            copy = out / original.name
            if original.name == ".metadata":
                continue
            assert copy.read_bytes() == original.read_bytes(), original.name
            shared = copy.stat().st_ino == original.stat().st_ino
            assert shared == link, original.name  # with --link, every file the repair does not change
        assert [p.name for p in out.iterdir() if p.name not in {q.name for q in built.path.iterdir()}] != []


def test_a_dcp_directory_inside_the_argument_is_one_checkpoint(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "runs")
    report = json.loads(run_cli(["inspect", tmp_path / "runs", "--json"], code=1).stdout)
    assert [(o["file"], o["location"]) for o in report["optimizers"]] == [(built.path.name, "optim")]
    assert report["skipped"] == []


def test_lightnings_sharded_checkpoint_is_judged_by_lightnings_loader(tmp_path: Path) -> None:
    """A DCP checkpoint with Lightning's ``meta.pt`` beside its ``.metadata`` is its FSDPStrategy's sharded
    checkpoint, which Lightning resumes through loaders that leave absent entries absent: healthy, with a notice;
    repairable under --strict (for dcp.load), and fixed as any DCP checkpoint."""
    built = dk.unirl_dcp(tmp_path / "run")
    assert json.loads(run_cli(["inspect", built.path, "--json"], code=1).stdout)["verdict"] == "repairable"
    torch.save({"epoch": 0, "global_step": dk.PRE_STEPS}, built.path / "meta.pt")
    document = json.loads(run_cli(["inspect", built.path, "--json"], code=0).stdout)
    (found,) = document["optimizers"]
    assert document["verdict"] == "healthy" and found["loader"] == "lightning-fsdp" and found["resumes_as_is"]
    (notice,) = [notice for notice in found["notices"] if notice["code"] == "lightning-sharded"]
    assert "resume the 2 absent entries exactly" in notice["detail"]
    assert json.loads(run_cli(["inspect", built.path, "--strict", "--json"], code=1).stdout)["verdict"] == "repairable"
    run_cli(["fix", built.path, "--out", tmp_path / "fixed"], code=0)
    assert json.loads(run_cli(["inspect", tmp_path / "fixed", "--strict", "--json"], code=0).stdout)["verdict"] == (
        "healthy"
    )
