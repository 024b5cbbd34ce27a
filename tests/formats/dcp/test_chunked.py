"""The frontier-scale builder writes what torch's DCP reader reads, and what optim-repair repairs.

``tests.factories.chunked`` builds checkpoints of millions of chunks for ``scripts/benchmark.py``; here a
small one proves the layout real: torch reads every chunk back, and a repaired copy loads.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import optim_repair
from tests.factories.chunked import WIDTH, build_chunked, chunk_count


def _torch_reads(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(state, FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def test_torch_reads_every_chunk_and_optim_repair_finds_the_missing(tmp_path: Path) -> None:
    ranks, params = 8, 70
    missing = build_chunked(tmp_path / "ckpt", ranks, params)
    metadata = FileSystemReader(tmp_path / "ckpt").read_metadata()
    chunks = sum(len(item.chunks) for item in metadata.state_dict_metadata.values() if hasattr(item, "chunks"))
    assert chunks == chunk_count(ranks, params)
    state = _torch_reads(tmp_path / "ckpt")
    assert len(state["model"]) == params and all(t.shape == (ranks, WIDTH) for t in state["model"].values())
    assert set(state["model"]) - set(state["optim"]["state"]) == set(missing)
    diagnosis = optim_repair.inspect(tmp_path / "ckpt")
    assert [opt.missing for opt in diagnosis.optimizers] == [tuple(missing)]
    optim_repair.fix(tmp_path / "ckpt", tmp_path / "fixed", link=True)
    repaired = _torch_reads(tmp_path / "fixed")["optim"]["state"]
    assert set(repaired) == set(state["model"])
    assert torch.equal(repaired[missing[0]]["exp_avg"], torch.zeros(ranks, WIDTH))
    assert float(repaired[missing[0]]["step"]) == 0.0
