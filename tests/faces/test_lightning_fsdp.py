"""optim-repair on the sharded checkpoint PyTorch Lightning's own Trainer and FSDPStrategy write on two real gloo
ranks, resumed through Lightning's own ``fit(ckpt_path=...)`` (``tests.factories.lightning_fsdp``).

AdamW has no state for ``head``: Lightning's loader (``load_sharded_optimizer_state_dict`` +
``FSDP.optim_state_dict_to_load``) resumes the checkpoint as it is exactly, so inspect calls it healthy with a
``lightning-sharded`` notice and only ``--strict`` counts the absent entries; the fixed copy resumes exactly too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.conftest import run_cli
from tests.factories import lightning_fsdp

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is unavailable"),
    pytest.mark.filterwarnings("ignore"),
]
pytest.importorskip("pytorch_lightning")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> lightning_fsdp.Saved:
    return lightning_fsdp.save(tmp_path_factory.mktemp("lightning-fsdp"))


@pytest.fixture(scope="module")
def resumed(saved: lightning_fsdp.Saved, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fixed copy, the CLI's output while making it, and both resumes through Lightning, from one spawn."""
    out = tmp_path_factory.mktemp("lightning-copies")
    fixed = out / "fixed"
    made = run_cli(["fix", saved.checkpoint, "--out", fixed], code=None)
    checkpoints = [saved.checkpoint, fixed] if made.exit_code == 0 else [saved.checkpoint]
    return {"made": made, "fixed": fixed, "resumed": lightning_fsdp.resume(out / "resume", checkpoints)}


def _assert_bit_identical(actual: Any, expected: dict[str, Tensor], what: str) -> None:
    assert isinstance(actual, dict), f"{what}: Lightning's loader raised {actual}"
    assert list(actual) == list(expected), what
    differ = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert differ == [], f"{what}: {differ} differ"


def test_lightning_writes_a_dcp_directory_with_its_meta_pt(saved: lightning_fsdp.Saved) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    names = sorted(path.name for path in saved.checkpoint.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    keys = FileSystemReader(saved.checkpoint).read_metadata().state_dict_metadata
    assert {key.split(".")[0] for key in keys} == {"model", "optimizer_0"}
    assert not [key for key in keys if key.startswith("optimizer_0.state.head.")]
    assert "optimizer_0.state.body.weight.exp_avg" in keys


def test_inspect_names_lightnings_loader_and_calls_it_healthy(saved: lightning_fsdp.Saved) -> None:
    document = json.loads(run_cli(["inspect", saved.checkpoint, "--json"], code=0).stdout)
    assert document["verdict"] == "healthy"
    (opt,) = document["optimizers"]
    assert opt["loader"] == "lightning-fsdp"
    assert opt["missing"] == list(lightning_fsdp.HEAD)
    assert [notice["code"] for notice in opt["notices"]] == ["lightning-sharded"]


def test_strict_inspect_counts_the_absent_entries(saved: lightning_fsdp.Saved) -> None:
    document = json.loads(run_cli(["inspect", saved.checkpoint, "--strict", "--json"], code=1).stdout)
    assert document["verdict"] == "repairable"


def test_lightning_resumes_the_original_exactly(saved: lightning_fsdp.Saved, resumed: dict[str, Any]) -> None:
    for rank, (found, reference) in enumerate(zip(resumed["resumed"], saved.uninterrupted(), strict=True)):
        _assert_bit_identical(found[str(saved.checkpoint)], reference, f"rank {rank}: the original vs uninterrupted")


def test_fix_exits_0_and_lightning_resumes_the_fixed_copy_exactly(
    saved: lightning_fsdp.Saved, resumed: dict[str, Any]
) -> None:
    assert resumed["made"].exit_code == 0, resumed["made"].stdout + resumed["made"].stderr
    for rank, (found, reference) in enumerate(zip(resumed["resumed"], saved.uninterrupted(), strict=True)):
        _assert_bit_identical(found[str(resumed["fixed"])], reference, f"rank {rank}: the fixed copy vs uninterrupted")
