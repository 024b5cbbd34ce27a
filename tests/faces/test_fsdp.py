"""optim-repair on what FSDP1 and verl's FSDP2 checkpoint manager write, resumed through their own loaders on two
real gloo ranks (``tests.factories.fsdp``), and on what ``dcp.save`` gathers from those ranks.

FSDP1's ``FSDP.optim_state_dict`` file looks like ``get_optimizer_state_dict`` output: its loader resumes the
original exactly, rejects the default ``{}`` copy, and resumes the ``--fill fresh`` copy exactly; the notice and the
fix summary say so. verl's per-rank files hold DTensor state under index keys: each rank's file is read and its
absent entries listed, the ``{}`` copy resumes exactly through ``optimizer.load_state_dict``, and fresh state, which
would have to be a DTensor, is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from optim_repair.checkpoint.discovery import discover
from optim_repair.checkpoint.reading import DiskListing, read_parsed
from optim_repair.formats.dcp import read_metadata
from optim_repair.formats.dcp.metadata_reader import read_summary
from tests.conftest import run_cli
from tests.factories import fsdp

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is unavailable")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> fsdp.Saved:
    return fsdp.save(tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def copies(saved: fsdp.Saved, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The repaired copies, the CLI's output while making them, and every resume, from one spawn."""
    out = tmp_path_factory.mktemp("copies")
    empty, fresh, verl = out / "empty.pt", out / "fresh.pt", out / "verl"
    model = saved.fsdp1 / "model.pt"
    made = {
        "empty": run_cli(["fix", saved.fsdp1 / "optimizer.pt", "--out", empty]),
        "fresh": run_cli(["fix", saved.fsdp1 / "optimizer.pt", "--out", fresh, "--fill", "fresh", "--model", model]),
        "verl": run_cli(["fix", saved.verl, "--out", verl]),
    }
    jobs = [(saved.fsdp1 / "optimizer.pt", model), (empty, model), (fresh, model)]
    resumed = fsdp.resume(out / "resume", jobs, [saved.verl, verl])
    return {"made": made, "resumed": resumed, "empty": empty, "fresh": fresh, "verl": verl}


def _assert_bit_identical(actual: dict[str, Tensor], expected: dict[str, Tensor], what: str) -> None:
    assert list(actual) == list(expected), what
    differ = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert differ == [], f"{what}: {differ} differ"


def _notice(document: dict[str, Any], code: str) -> str:
    (opt,) = document["optimizers"]
    details: list[str] = [n["detail"] for n in opt["notices"] if n["code"] == code]
    assert len(details) == 1, opt["notices"]
    return details[0]


def test_fsdp1_loader_resumes_the_original_and_the_fresh_copy_exactly(
    saved: fsdp.Saved, copies: dict[str, Any]
) -> None:
    rank0 = copies["resumed"][0]
    reference = saved.fsdp1_uninterrupted()
    _assert_bit_identical(rank0[str(saved.fsdp1 / "optimizer.pt")], reference, "the original vs uninterrupted")
    _assert_bit_identical(rank0[str(copies["fresh"])], reference, "the --fill fresh copy vs uninterrupted")


def test_fsdp1_loader_rejects_the_empty_copy(copies: dict[str, Any]) -> None:
    for rank in copies["resumed"]:
        message = rank[str(copies["empty"])]
        assert isinstance(message, str)
        assert "The state of _OptimStateKey(unflat_param_names=('head.weight', 'head.bias')" in message
        assert "is empty" in message


def test_inspect_names_fsdp1_loader_for_a_name_keyed_file(saved: fsdp.Saved) -> None:
    document = json.loads(run_cli(["inspect", saved.fsdp1 / "optimizer.pt", "--json"], code=1).stdout)
    assert document["optimizers"][0]["missing"] == list(fsdp.HEAD)
    detail = _notice(document, "fsdp1-loader")
    assert "FSDP.optim_state_dict_to_load resumes the 2 absent entries exactly" in detail
    assert 'raises on {} entries ("The state of _OptimStateKey(...) is empty")' in detail
    assert "(--fill empty, or the default where fresh state cannot be built) breaks it" in detail
    assert "(--fill fresh, the default where it can be built) resumes exactly through it and through set_optimizer" in (
        detail
    )


def test_inspect_of_the_empty_copy_warns_that_fsdp1_rejects_it(copies: dict[str, Any]) -> None:
    document = json.loads(run_cli(["inspect", copies["empty"], "--json"], code=0).stdout)
    detail = _notice(document, "fsdp1-loader")
    assert 'raises on the 2 {} entries ("The state of _OptimStateKey(...) is empty")' in detail


def test_fix_summary_says_fsdp1_rejects_empty_entries(copies: dict[str, Any]) -> None:
    empty, fresh = copies["made"]["empty"].stdout, copies["made"]["fresh"].stdout
    assert "FSDP1's FSDP.optim_state_dict_to_load raises on them" in empty
    assert "--fill fresh, which resumes exactly through every loader" in empty
    assert "FSDP1" not in fresh


def test_inspect_reports_each_verl_rank_file(saved: fsdp.Saved) -> None:
    document = json.loads(run_cli(["inspect", saved.verl, "--json"], code=0).stdout)
    found = {opt["file"]: opt for opt in document["optimizers"]}
    assert sorted(found) == [f"optim_world_size_2_rank_{rank}.pt" for rank in range(fsdp.WORLD)]
    for opt in found.values():
        assert (opt["key_style"], opt["loader"], opt["missing"], opt["malformed"]) == (
            "index", "load_state_dict", list(fsdp.VERL_HEAD), []
        )  # fmt: skip
    strict = run_cli(["inspect", saved.verl, "--strict"], code=1)
    ranks = ", ".join(f"optim_world_size_2_rank_{rank}.pt:<root>" for rank in range(fsdp.WORLD))
    assert f"missing in {ranks}: 2, 3" in strict.stdout, "said once for the ranks that share it"


def test_verl_rank_files_are_described_by_their_local_shards(saved: fsdp.Saved) -> None:
    from tests.factories.support import read_checkpoint

    inventory = read_checkpoint(saved.verl)
    for rank in range(fsdp.WORLD):
        state = torch.load(saved.verl / f"optim_world_size_2_rank_{rank}.pt", weights_only=True)
        (opt,) = next(f for f in inventory.files if f.file == f"optim_world_size_2_rank_{rank}.pt").optimizers
        for entry in opt.entries:
            local = state["state"][entry.param]["exp_avg"].to_local()
            meta = entry.get("exp_avg")
            assert (meta.dtype, meta.shape, meta.stride) == ("float32", tuple(local.shape), local.stride())


def test_verl_empty_copy_resumes_exactly_per_rank(saved: fsdp.Saved, copies: dict[str, Any]) -> None:
    assert "optim_world_size_2_rank_0.pt:<root>" in copies["made"]["verl"].stdout
    for rank, (resumed, reference) in enumerate(zip(copies["resumed"], saved.verl_uninterrupted(), strict=True)):
        _assert_bit_identical(resumed[str(saved.verl)], reference, f"rank {rank}: the original vs uninterrupted")
        _assert_bit_identical(resumed[str(copies["verl"])], reference, f"rank {rank}: the copy vs uninterrupted")


def test_fresh_state_for_verl_rank_files_is_refused_in_one_line(saved: fsdp.Saved, tmp_path: Path) -> None:
    result = run_cli(["fix", saved.verl, "--out", tmp_path / "out", "--fill", "fresh"], code=3)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "index-keyed" in lines[0] and "--fill empty" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_fresh_state_for_sharded_dtensor_state_is_refused(saved: fsdp.Saved, tmp_path: Path) -> None:
    model = saved.verl / "model_world_size_2_rank_0.pt"
    args = ["fix", saved.sharded / "optimizer_rank_0.pt", "--out", tmp_path / "out.pt", "--fill", "fresh"]
    result = run_cli([*args, "--optimizer", "adamw", "--model", model], code=3)
    assert "holds DTensor state (FSDP2, saved per rank)" in result.stderr
    assert "pass --fill empty" in result.stderr
    assert not (tmp_path / "out.pt").exists()


def test_what_dcp_save_gathers_from_real_ranks_is_inspected_summarized(saved: fsdp.Saved) -> None:
    """Gathered from the ranks, each storage key is a string of its own in the pickle: the summarized read
    summarizes those records all the same, and finds what the whole read finds."""
    whole, summary = read_metadata(saved.dcp), read_summary(saved.dcp)
    assert summary.summarized and set(summary.storage) < set(whole.storage)
    assert summary.items.keys() == whole.items.keys() and summary.planner_data == whole.planner_data
    found = discover(saved.dcp)
    assert read_parsed(DiskListing(found), keep=False)[0] == read_parsed(DiskListing(found), keep=True)[0]
    document = json.loads(run_cli(["inspect", saved.dcp, "--json"], code=None).stdout)
    (opt,) = document["optimizers"]
    assert sorted(opt["missing"]) == sorted(fsdp.HEAD)
