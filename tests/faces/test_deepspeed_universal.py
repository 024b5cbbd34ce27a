"""optim-repair on DeepSpeed universal checkpoints that DeepSpeed itself writes (``tests.factories.
deepspeed_universal``: ZeRO stage 2 on one gloo rank, converted by ``ds_to_universal``) and resumes (``load_checkpoint``
with ``load_universal``): read per parameter, healthy where every parameter it steps has its state files, and a
conversion cut short (a parameter's state files gone) found as missing state, which DeepSpeed's own resume
refuses and ``fix`` does not write."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.factories import s3server

universal_factory = pytest.importorskip("tests.factories.deepspeed_universal", exc_type=ImportError)
pytest.importorskip("deepspeed", exc_type=ImportError)

_STATE = ["exp_avg", "exp_avg_sq", "step"]


@pytest.fixture(scope="module")
def universal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return universal_factory.save(tmp_path_factory.mktemp("universal"))


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return universal_factory.save(tmp_path_factory.mktemp("frozen"), frozen=True)


def _inspected(path: Path | str, code: int = 0) -> dict[str, object]:
    document: dict[str, object] = json.loads(run_cli(["inspect", path, "--json"], code=code).stdout)
    return document


def test_it_is_read_per_parameter_and_healthy(universal: Path) -> None:
    document = _inspected(universal)
    (optimizer,) = document["optimizers"]  # type: ignore[misc]
    assert (optimizer["file"], optimizer["loader"], optimizer["params"]) == ("zero", "deepspeed-universal", 4)
    assert document["verdict"] == "healthy" and optimizer["missing"] == []
    assert optimizer["model"]["not_in_model"] == [] and optimizer["model"]["shape_mismatches"] == []
    assert [notice["code"] for notice in document["notices"]] == []  # type: ignore[attr-defined]
    assert [skip["file"] for skip in document["skipped"]] == ["mp_rank_00_model_states.pt"]  # type: ignore[attr-defined]
    listed = run_cli(["inspect", universal]).stdout
    assert "flat partitions" not in listed and "zero/head.weight" not in listed


def test_frozen_parameters_are_outside_the_optimizer(frozen: Path) -> None:
    assert sorted(path.name for path in (frozen / "zero" / "head.weight").iterdir()) == ["fp32.pt"]
    document = _inspected(frozen)
    (optimizer,) = document["optimizers"]  # type: ignore[misc]
    assert optimizer["params"] == 2 and optimizer["missing"] == [] and document["verdict"] == "healthy"


def test_its_copy_resumes_bit_identically_through_deepspeed(universal: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy" / universal.name
    copy.parent.mkdir()
    fixed = json.loads(run_cli(["fix", universal, "--out", copy, "--json"]).stdout)
    assert fixed["added"] == [] and fixed["verification"]["bytes"] > 0
    resumed = universal_factory.resume(copy)
    reference = universal_factory.uninterrupted(universal)
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def test_a_conversion_cut_short_is_missing_state(universal: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "zero" / universal.name
    shutil.copytree(universal, damaged)
    for key in _STATE:
        (damaged / "zero" / "head.weight" / f"{key}.pt").unlink()
    with pytest.raises(RuntimeError, match="DeepSpeed resume process exited"):
        universal_factory.resume(damaged)  # DeepSpeed's own resume refuses it
    document = _inspected(damaged, code=1)
    (optimizer,) = document["optimizers"]  # type: ignore[misc]
    assert optimizer["missing"] == ["head.weight"] and document["verdict"] == "repairable"
    assert [notice["code"] for notice in optimizer["notices"]] == ["universal-missing-state"]
    out = tmp_path / "fixed"
    refused = run_cli(["fix", damaged, "--out", out], code=3)
    assert "a DeepSpeed universal checkpoint: writing its per-parameter state files is not supported" in refused.stderr
    assert not out.exists()


def test_in_a_store_it_reads_as_it_does_locally(universal: Path, server: s3server.Server, environment: None) -> None:
    bucket = s3server.new_bucket(server)
    s3server.upload(server, universal, bucket, "run/universal/")
    stored = _inspected(f"s3://{bucket}/run/universal/")
    assert stored["optimizers"] == _inspected(universal)["optimizers"]
