"""DCP checkpoints saved without collectives (``dcp.save(..., use_collectives=False)``): one ``__<rank>.metadata`` per
rank, each that rank's own view of its own shards, and no global ``.metadata``. Each view is read, judged and
repaired on its own, with a new shard a view whose name no rank's shards use; stock ``dcp.load``, which falls back
to each rank's own metadata, resumes from the copy. On a disk and in a store alike; ``--latest`` takes a rank's
metadata as a step's commit mark."""

from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
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

_RANK_SHARD = re.compile(r"__[0-9]+_[0-9]+\.distcp")
"""The names torch's writer gives a rank's shards."""


@pytest.fixture
def one_rank(tmp_path: Path) -> Built:
    built = dk.rank_local_dcp(tmp_path / "one")
    assert sorted(path.name for path in built.path.iterdir()) == ["__0.metadata", "__0_0.distcp"]
    return built


@pytest.fixture
def two_ranks(tmp_path: Path) -> Built:
    built = dk.rank_local_dcp(tmp_path / "two", ranks=2)
    names = ["__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp"]
    assert sorted(path.name for path in built.path.iterdir()) == names
    return built


def test_one_rank_is_read_repaired_and_resumed_bit_identically(one_rank: Built, tmp_path: Path) -> None:
    original = dk.files(one_rank.path)
    document = json.loads(run_cli(["inspect", one_rank.path, "--json"], code=1).stdout)
    (optimizer,) = document["optimizers"]
    assert optimizer["location"] == "__0.metadata:optim" and optimizer["missing"] == list(dk.HEAD)
    out = tmp_path / "fixed"
    fixed = json.loads(run_cli(["fix", one_rank.path, "--out", out, "--json"]).stdout)
    assert sorted(addition["param"] for addition in fixed["added"]) == sorted(dk.HEAD)
    added = sorted(set(dk.files(out)) - set(original))
    assert len(added) == 1 and not _RANK_SHARD.fullmatch(added[0]) and not (out / ".metadata").exists()
    assert dk.files(one_rank.path) == original
    resumed = dk.resume(out, "adamw", "optim", False)  # stock dcp.load: the global metadata absent, rank 0's own
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    assert json.loads(run_cli(["inspect", out, "--json"]).stdout)["verdict"] == "healthy"


def _check_views(copy: Path) -> None:
    """Each rank's stock ``dcp.load`` reads its half of every original entry, and fresh state for the head."""
    run = dk.trained("adamw")
    names = {id(p): name for name, p in run.model.named_parameters()}
    state = {names[id(p)]: value for p, value in run.optimizer.state.items()}
    for rank, loaded in enumerate(dk.rank_local_views(copy, 2)):
        for name, entry in loaded["state"].items():
            for key, value in entry.items():
                local = value.to_local() if hasattr(value, "to_local") else value
                if name in dk.HEAD:
                    assert not local.any(), (rank, name, key)  # step 0, zero moments: AdamW's first step
                elif local.dim():
                    assert torch.equal(local, torch.chunk(state[name][key], 2, dim=0)[rank]), (rank, name, key)
                else:
                    assert torch.equal(local, state[name][key]), (rank, name, key)


def test_two_ranks_each_view_is_repaired_with_a_shard_no_rank_uses(two_ranks: Built, tmp_path: Path) -> None:
    document = json.loads(run_cli(["inspect", two_ranks.path, "--json"], code=1).stdout)
    locations = [(optimizer["location"], optimizer["missing"]) for optimizer in document["optimizers"]]
    assert locations == [("__0.metadata:optim", list(dk.HEAD)), ("__1.metadata:optim", list(dk.HEAD))]
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.state\.head"):
        dk.rank_local_views(two_ranks.path, 2)  # what each rank's resume from the original meets
    out = tmp_path / "fixed"
    fixed = json.loads(run_cli(["fix", two_ranks.path, "--out", out, "--json"]).stdout)
    assert len(fixed["added"]) == 4
    added = sorted(set(dk.files(out)) - set(dk.files(two_ranks.path)))
    assert len(added) == 2 and not any(_RANK_SHARD.fullmatch(name) for name in added)
    _check_views(out)
    linked = tmp_path / "linked"
    run_cli(["fix", two_ranks.path, "--out", linked, "--link"])
    _check_views(linked)


def test_latest_takes_a_rank_metadata_as_the_commit_mark(one_rank: Built) -> None:
    run = one_rank.path.parent
    newer = run / "checkpoint-9"
    shutil.copytree(one_rank.path, newer)
    (newer / "__0.metadata").unlink()  # a step still being written: its shard, no metadata of any kind
    latest = run_cli(["inspect", run, "--latest", "--json"], code=1)
    assert json.loads(latest.stdout)["path"].endswith("checkpoint-3")


def test_in_a_store_each_view_is_read_and_repaired(
    two_ranks: Built, server: s3server.Server, environment: None, tmp_path: Path
) -> None:
    bucket = s3server.new_bucket(server)
    s3server.upload(server, two_ranks.path, bucket, "run/checkpoint-3/")
    url = f"s3://{bucket}/run/checkpoint-3/"
    local = json.loads(run_cli(["inspect", two_ranks.path, "--json"], code=1).stdout)
    stored = json.loads(run_cli(["inspect", url, "--json"], code=1).stdout)
    assert stored["optimizers"] == local["optimizers"]
    assert json.loads(run_cli(["inspect", f"s3://{bucket}/run/", "--latest", "--json"], code=1).stdout)["verdict"]
    run_cli(["fix", url, "--out", f"s3://{bucket}/fixed/"])
    copy = s3server.download(server, bucket, "fixed/", tmp_path / "downloaded")
    assert not (copy / ".metadata").exists()
    _check_views(copy)
