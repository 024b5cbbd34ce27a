"""DCP checkpoints saved without collectives (``dcp.save(..., use_collectives=False)``): one ``__<rank>.metadata`` per
rank, each rank's own view, and no global ``.metadata``. optim-repair neither reads nor repairs them; it says so in
one line, on a disk and in a store, and ``--latest`` takes such a step as complete."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint.state_dict_saver import save

from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import s3server
from tests.factories.built import Built

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.skipif(
        "use_collectives" not in inspect.signature(save).parameters, reason="this torch's dcp.save always coordinates"
    ),
]


@pytest.fixture
def rank_local(tmp_path: Path) -> Built:
    built = dk.rank_local_dcp(tmp_path / "run")
    assert sorted(path.name for path in built.path.iterdir()) == ["__0.metadata", "__0_0.distcp"]
    return built


def test_inspect_and_fix_refuse_it_in_one_line(rank_local: Built, tmp_path: Path) -> None:
    found = run_cli(["inspect", rank_local.path], code=4)
    assert "saved without collectives" in found.stderr and "__0.metadata" in found.stderr
    assert len(found.stderr.strip().splitlines()) == 1 and "Traceback" not in found.stderr
    document = json.loads(run_cli(["inspect", rank_local.path, "--json"], code=4).stdout)
    assert document["error"]["exit_code"] == 4 and "use_collectives=False" in document["error"]["message"]
    given = run_cli(["inspect", rank_local.path / "__0.metadata"], code=4)
    assert f"part of a DCP checkpoint; pass its directory, {rank_local.path}" in given.stderr
    out = tmp_path / "fixed"
    fixed = run_cli(["fix", rank_local.path, "--out", out], code=4)
    assert "saved without collectives" in fixed.stderr and not out.exists()


def test_beside_a_checkpoint_it_reads_it_is_skipped_with_a_warning(rank_local: Built, tmp_path: Path) -> None:
    both = tmp_path / "both"
    shutil.copytree(rank_local.path, both / "rank-local")
    dk.unirl_dcp(both / "global")
    document = json.loads(run_cli(["inspect", both, "--json"], code=1).stdout)
    assert [optimizer["file"] for optimizer in document["optimizers"]] == ["global/checkpoint-3"]
    assert [(skip["file"], skip["kind"]) for skip in document["skipped"]] == [
        ("rank-local/__0.metadata", "dcp-rank-local")
    ]
    (notice,) = [notice for notice in document["notices"] if notice["code"] == "dcp-rank-local"]
    assert notice["severity"] == "warning" and "rank-local/__0.metadata" in notice["detail"]


def test_latest_takes_its_rank_metadata_as_the_commit_mark(rank_local: Built, tmp_path: Path) -> None:
    run = rank_local.path.parent
    newer = run / "checkpoint-9"
    shutil.copytree(rank_local.path, newer)
    (newer / "__0.metadata").unlink()  # a step still being written: shards, no metadata of any kind
    latest = run_cli(["inspect", run, "--latest"], code=4)
    assert "checkpoint-3" in latest.stderr and "saved without collectives" in latest.stderr


def test_in_a_store_it_is_refused_alike(
    rank_local: Built, server: s3server.Server, environment: None, tmp_path: Path
) -> None:
    bucket = s3server.new_bucket(server)
    s3server.upload(server, rank_local.path, bucket, "run/checkpoint-3/")
    url = f"s3://{bucket}/run/checkpoint-3/"
    found = run_cli(["inspect", url], code=4)
    assert "saved without collectives" in found.stderr and len(found.stderr.strip().splitlines()) == 1
    assert "checkpoint-3" in run_cli(["inspect", f"s3://{bucket}/run/", "--latest"], code=4).stderr
