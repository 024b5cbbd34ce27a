"""A clean-named optimizer beside a wrapped model's weights: ``get_optimizer_state_dict(ddp_or_compiled, opt)``
writes the clean names while ``ddp.state_dict()`` keeps ``module.`` (``_orig_mod.`` when compiled). The two are
compared modulo torch's wrapper prefixes, no breaking ``--rename`` is offered, and the wrapped weights give
the fresh shapes; the repaired copy resumes through torch's own loader into the wrapper, bit-identically."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel

import optim_repair
from tests.conftest import run_cli
from tests.factories.models import TwoHeadNet, make_optimizer, train
from tests.factories.support import untouched

STEPS, MORE = 3, 3


class _DDP(DistributedDataParallel):
    """DDP over a ``Net``, which ``train`` drives: its example input is the wrapped model's."""

    def example_input(self, generator: torch.Generator) -> Tensor:
        return self.module.example_input(generator)  # type: ignore[operator,no-any-return]


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group over a file store, as DDP needs."""
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    yield
    dist.destroy_process_group()


def _wrap(model: nn.Module, wrap: str) -> Any:
    return torch.compile(model, backend="eager") if wrap == "compile" else _DDP(model, find_unused_parameters=True)


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _run(tmp_path: Path, wrap: str) -> tuple[Path, dict[str, Tensor]]:
    """Train the wrapper with ``head_unused`` unused (no state), save the wrapper's own weights and the optimizer
    as torch's state-dict functions write it; return the checkpoint and the uninterrupted run's weights."""
    model = TwoHeadNet()
    wrapped = _wrap(model, wrap)
    opt = make_optimizer(wrapped, "adamw")
    train(wrapped, opt, STEPS, use_all=False)
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": wrapped.state_dict(), "optimizer": get_optimizer_state_dict(wrapped, opt)}, path)
    train(wrapped, opt, MORE, use_all=True, seed=1)
    return path, _params(model)


@pytest.mark.parametrize(("wrap", "prefix"), [("compile", "_orig_mod."), ("ddp", "module.")])
def test_a_clean_optimizer_matches_its_wrapped_models_weights(
    tmp_path: Path, wrap: str, prefix: str, request: pytest.FixtureRequest
) -> None:
    if wrap == "ddp":
        request.getfixturevalue("process_group")
    path, expected = _run(tmp_path, wrap)
    saved = torch.load(path, weights_only=True)
    assert all(name.startswith(prefix) for name in saved["model"]) and not any(
        str(name).startswith(prefix) for name in saved["optimizer"]["state"]
    )
    document = json.loads(run_cli(["inspect", path, "--json"], code=1).stdout)
    (opt,) = document["optimizers"]
    found = opt["model"]
    assert found["not_in_model"] == [] and found["not_in_optimizer"] == [] and found["rename"] is None
    assert (found["optimizer_params"], found["model_params"]) == (6, 6)
    assert "--rename" not in run_cli(["inspect", path], code=1).stdout

    out = tmp_path / "fixed.pt"
    with untouched(path):
        fixed = json.loads(run_cli(["fix", path, "--out", out, "--fill", "fresh", "--json"]).stdout)
    assert sorted(a["param"] for a in fixed["added"]) == ["head_unused.bias", "head_unused.weight"]
    model = TwoHeadNet(seed=3)
    wrapped = _wrap(model, wrap)
    opt = make_optimizer(wrapped, "adamw")
    repaired = torch.load(out, weights_only=True)
    wrapped.load_state_dict(repaired["model"])
    set_optimizer_state_dict(wrapped, opt, repaired["optimizer"])  # stock torch, full_state_dict=False
    train(wrapped, opt, MORE, use_all=True, seed=1)
    resumed = _params(model)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
    assert optim_repair.inspect(out).verdict == "healthy"
