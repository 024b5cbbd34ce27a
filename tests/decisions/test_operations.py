"""When the model changed: ``fix --rename``, ``--drop``, ``--drop-not-in-model`` and ``--add-from-model``.

Each drift is built for real (a ``torch.compile``d run, a DDP-wrapped one, a layer unfrozen between runs, a layer
removed), repaired, and resumed through torch's stock ``set_optimizer_state_dict``, against a run that never
stopped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

import optim_repair
from tests.conftest import run_cli
from tests.decisions.test_comparison import named_state_dict
from tests.factories import trainers
from tests.factories.built import Built
from tests.factories.models import TwoHeadNet, make_optimizer, train
from tests.factories.support import assert_nothing_written, installed_command, untouched
from tests.factories.versions import MISSING_STATE_ERROR, missing_state_match

STEPS, MORE = 3, 3


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _resume(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    saved = torch.load(path, weights_only=True)
    set_model_state_dict(model, saved["policy_state_dict"])
    set_optimizer_state_dict(model, opt, saved["optimizer_state_dict"])


class _DDP(DistributedDataParallel):
    """DDP over a ``Net``, which ``train`` drives: its example input is the wrapped model's."""

    def example_input(self, generator: torch.Generator) -> Tensor:
        return self.module.example_input(generator)  # type: ignore[operator,no-any-return]


def _wrapped_run(tmp_path: Path, wrap: str) -> tuple[Path, dict[str, Tensor]]:
    """Train a wrapped model (compiled, or DDP), save its state keyed by the wrapper's names, and the unwrapped
    model's weights; return the checkpoint and the weights an uninterrupted run ends with."""
    model = TwoHeadNet()
    wrapped: Any = torch.compile(model, backend="eager") if wrap == "compile" else _DDP(model)
    opt = make_optimizer(wrapped, "adamw")
    train(wrapped, opt, STEPS, use_all=True)
    path = tmp_path / "checkpoint.pt"
    state = {"policy_state_dict": get_model_state_dict(model), "optimizer_state_dict": named_state_dict(wrapped, opt)}
    torch.save(state, path)
    train(wrapped, opt, MORE, use_all=True, seed=1)
    return path, _params(model)


@pytest.fixture
def process_group() -> Any:
    """A one-rank gloo process group, as DDP needs."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("wrap", "prefix"), [("compile", "_orig_mod."), ("ddp", "module.")])
def test_a_wrapped_runs_state_is_renamed_into_the_plain_model(
    tmp_path: Path, wrap: str, prefix: str, request: pytest.FixtureRequest
) -> None:
    if wrap == "ddp":
        request.getfixturevalue("process_group")
    path, expected = _wrapped_run(tmp_path, wrap)
    found = optim_repair.inspect(path).optimizers[0].model  # the weights beside it: the unwrapped model
    assert found is not None and found.rename is not None and str(found.rename) == f"^{re.escape(prefix)}="
    model = TwoHeadNet(seed=3)
    opt = make_optimizer(model, "adamw")
    with pytest.raises(MISSING_STATE_ERROR, match=missing_state_match("trunk.weight")):  # stock torch, wrapped names
        _resume(path, model, opt)
    out = tmp_path / "fixed.pt"
    with untouched(path):
        document = json.loads(run_cli(["fix", path, "--out", out, "--rename", str(found.rename), "--json"]).stdout)
    assert [(c["old"], c["new"]) for c in document["changed"]] == [
        (f"{prefix}{name}", name) for name, _ in TwoHeadNet().named_parameters()
    ]
    assert document["added"] == [] and document["verification"]["tensors"] > 0
    model = TwoHeadNet(seed=3)
    opt = make_optimizer(model, "adamw")
    _resume(out, model, opt)
    train(model, opt, MORE, use_all=True, seed=1)
    resumed = _params(model)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


def test_a_layer_unfrozen_between_runs_is_added_with_fresh_state(tmp_path: Path) -> None:
    """The run trains without ``head_unused`` (frozen, in no group); the next one unfreezes it into group 0.
    Against the run that never stopped and appends it to group 0 at the same step."""
    model = TwoHeadNet()
    model.head_unused.requires_grad_(False)
    opt = make_optimizer(model, "adamw")
    train(model, opt, STEPS, use_all=True)
    path = tmp_path / "checkpoint.pt"
    torch.save({"policy_state_dict": get_model_state_dict(model),
                "optimizer_state_dict": get_optimizer_state_dict(model, opt)}, path)  # fmt: skip
    model.head_unused.requires_grad_(True)
    opt.param_groups[0]["params"].extend(model.head_unused.parameters())
    train(model, opt, MORE, use_all=True, seed=1)
    expected = _params(model)

    out = tmp_path / "fixed.pt"
    document = json.loads(run_cli(["fix", path, "--out", out, "--add-from-model", "--fill", "fresh", "--json"]).stdout)
    fresh = ["step", "exp_avg", "exp_avg_sq"]
    assert [(a["param"], a["group"], a["keys"]) for a in document["added"]] == [
        ("head_unused.weight", 0, fresh),
        ("head_unused.bias", 0, fresh),
    ]
    resumed_model = TwoHeadNet(seed=3)
    resumed_opt = make_optimizer(resumed_model, "adamw")
    _resume(out, resumed_model, resumed_opt)
    train(resumed_model, resumed_opt, MORE, use_all=True, seed=1)
    resumed = _params(resumed_model)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
    groups = torch.load(out, weights_only=True)["optimizer_state_dict"]["param_groups"]
    assert groups[0]["params"][-2:] == ["head_unused.weight", "head_unused.bias"]


class OneHeadNet(TwoHeadNet):
    """``TwoHeadNet`` after a refactor removed ``head_unused``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed=seed)
        del self.head_unused

    def forward(self, x: Tensor, use_all: bool = False) -> Tensor:
        out: Tensor = self.head_used(torch.relu(self.trunk(x)))
        return out


def test_a_removed_layer_is_dropped(tmp_path: Path) -> None:
    model = TwoHeadNet()
    opt = make_optimizer(model, "adamw")
    train(model, opt, STEPS, use_all=True)
    path = tmp_path / "checkpoint.pt"
    torch.save({"optimizer_state_dict": get_optimizer_state_dict(model, opt)}, path)
    train(model, opt, MORE, use_all=False, seed=1)  # head_unused out of the loss: as if removed
    expected = {name: value for name, value in _params(model).items() if not name.startswith("head_unused.")}
    smaller = tmp_path / "model.safetensors"
    trainers.save_safetensors(get_model_state_dict(OneHeadNet()), smaller)
    assert optim_repair.inspect(path, model=smaller).verdict == "repairable"
    for args, name in (
        (["--drop", "^head_unused\\."], "a.pt"),
        (["--drop-not-in-model", "--model", str(smaller)], "b.pt"),
    ):
        out = tmp_path / name
        document = json.loads(run_cli(["fix", path, "--out", out, *args, "--json"]).stdout)
        assert [(c["old"], c["new"]) for c in document["changed"]] == [
            ("head_unused.weight", None),
            ("head_unused.bias", None),
        ]
        resumed_model = OneHeadNet(seed=3)
        resumed_opt = make_optimizer(resumed_model, "adamw")
        saved = torch.load(out, weights_only=True)
        resumed_model.load_state_dict(_at_checkpoint())
        set_optimizer_state_dict(resumed_model, resumed_opt, saved["optimizer_state_dict"])
        train(resumed_model, resumed_opt, MORE, use_all=False, seed=1)
        resumed = _params(resumed_model)
        assert all(torch.equal(resumed[n], expected[n]) for n in expected)
        assert optim_repair.inspect(out, model=smaller).verdict == "healthy"


def _at_checkpoint() -> dict[str, Tensor]:
    """The weights of the ``test_a_removed_layer_is_dropped`` run at its checkpoint, rebuilt by training again."""
    model = TwoHeadNet()
    opt = make_optimizer(model, "adamw")
    train(model, opt, STEPS, use_all=True)
    return {k: v for k, v in get_model_state_dict(model).items() if not k.startswith("head_unused.")}


def test_operations_that_cannot_apply_are_refused(tmp_path: Path, hf_checkpoint: Built) -> None:
    model = TwoHeadNet()
    opt = make_optimizer(model, "adamw")
    train(model, opt, 2, use_all=True)
    path = tmp_path / "checkpoint.pt"
    torch.save({"optimizer_state_dict": get_optimizer_state_dict(model, opt)}, path)
    out = tmp_path / "out.pt"
    cases = [
        (["--rename", "^nothing\\.=x."], 3, "matches no parameter name"),
        (["--rename", "^head_(un)?used=head"], 3, "one name"),
        (["--rename", "no-equals-sign"], 2, "--rename takes OLD=NEW"),
        (["--drop", "^absent"], 3, "the drop pattern '^absent' matches no parameter name"),
        (["--add-from-model"], 3, "needs the model, and none was found beside the optimizer"),
        (["--to-group", "1"], 2, "--to-group only says which group the model's added parameters join; pass --add"),
    ]
    for args, code, fragment in cases:
        result = run_cli(["fix", path, "--out", out, *args], code=code)
        assert fragment in result.stderr, (args, result.stderr)
        assert_nothing_written(out)
    index = run_cli(["fix", hf_checkpoint.path, "--out", out, "--drop", "x"], code=3)
    assert "keyed by indices" in index.stderr


def test_an_optimizer_inside_a_tuple_is_changed_too(tmp_path: Path) -> None:
    """``torch.save((weights, optimizer))``: the tuple is rebuilt around the changed optimizer, the original graph
    kept as it was for verification."""
    model = TwoHeadNet()
    opt = make_optimizer(model, "adamw")
    train(model, opt, 2, use_all=True)
    path = tmp_path / "pair.pt"
    torch.save((get_model_state_dict(model), get_optimizer_state_dict(model, opt)), path)
    out = tmp_path / "fixed.pt"
    run_cli(["fix", path, "--out", out, "--drop", "^head_unused\\."])
    weights, optimizer = torch.load(out, weights_only=True)
    kept = ["trunk.weight", "trunk.bias", "head_used.weight", "head_used.bias"]
    assert set(optimizer["state"]) == set(kept) and optimizer["param_groups"][0]["params"] == kept
    assert weights.keys() == get_model_state_dict(model).keys()


def _prefixed(state: dict[str, Any], prefix: str, flatten: bool) -> dict[str, Any]:
    """An optimizer state dict as a wrapper's run names it: every parameter name gains ``prefix``."""
    if flatten:
        return {f"{key.split('.', 1)[0]}.{prefix}{key.split('.', 1)[1]}": value for key, value in state.items()}
    return {"state": {f"{prefix}{name}": entry for name, entry in state["state"].items()},
            "param_groups": [{**group, "params": [f"{prefix}{name}" for name in group["params"]]}
                             for group in state["param_groups"]]}  # fmt: skip


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_a_dcp_checkpoint_is_renamed_through_its_metadata_alone(tmp_path: Path, flatten: bool) -> None:
    """A DDP-style ``module.`` prefix on a DCP checkpoint's optimizer: --rename with --link writes a new
    ``.metadata`` and a small shard (the ``params`` lists, the fresh moments of the unused head), hard-links every
    original shard, and stock dcp.load + set_optimizer_state_dict resume bit-identically."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.factories import dcp as dk

    run = dk.trained("adamw")
    optimizer = get_optimizer_state_dict(run.model, run.optimizer, options=dk.options(flatten))
    path = tmp_path / "checkpoint"
    state = {"model": get_model_state_dict(run.model), "optim": _prefixed(optimizer, "module.", flatten)}
    save(state, checkpoint_id=path)
    (found,) = optim_repair.inspect(path).optimizers
    assert found.model is not None and str(found.model.rename) == "^module\\.="
    out = tmp_path / "fixed"
    document = json.loads(run_cli(["fix", path, "--out", out, "--rename", "^module\\.=", "--link", "--json"]).stdout)
    assert len(document["changed"]) == len(list(run.model.parameters()))
    assert sorted(a["param"] for a in document["added"]) == sorted(dk.HEAD)
    shard = "__0_0.distcp"
    assert (out / shard).stat().st_ino == (path / shard).stat().st_ino, "no shard bytes copied"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([*(p.name for p in path.iterdir()), "__optim_repair_0.distcp"])
    resumed = dk.resume(out, "adamw", "optim", flatten)
    expected = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
    dcp_to_torch_save(out, tmp_path / "whole.pt")  # torch's own converter reads the renamed planner_data
    assert optim_repair.inspect(out).verdict == "healthy"


def test_a_dcp_parameter_is_dropped_from_state_and_params(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.factories import dcp as dk

    built = dk.unirl_dcp(tmp_path / "in")
    out = tmp_path / "fixed"
    document = json.loads(run_cli(["fix", built.path, "--out", out, "--drop", "^blocks\\.1\\.", "--json"]).stdout)
    dropped = sorted(c["old"] for c in document["changed"])
    assert dropped and all(name.startswith("blocks.1.") for name in dropped)
    (fixed,) = optim_repair.inspect(out).optimizers
    assert not any(str(p).startswith("blocks.1.") for p in fixed.optimizer.params) and fixed.missing == ()
    dcp_to_torch_save(out, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)["optim"]
    assert not any(name.startswith("blocks.1.") for name in whole["state"])
    assert not any(name.startswith("blocks.1.") for name in whole["param_groups"][0]["params"])


def test_dropping_every_parameter_is_refused(tmp_path: Path) -> None:
    """A copy whose optimizer has no parameter left would not even be found again (found by the fuzzer)."""
    from tests.factories import dcp as dk

    built = dk.unirl_dcp(tmp_path / "in")
    out = tmp_path / "fixed"
    result = run_cli(["fix", built.path, "--out", out, "--drop", "."], code=3)
    assert "the drops leave the optimizer no parameter; nothing would be left to resume" in result.stderr
    assert not out.exists()


def test_a_layer_unfrozen_between_runs_joins_a_dcp_checkpoint(tmp_path: Path) -> None:
    """FSDP2-style DCP: the head was frozen (in no group) and is unfrozen into group 0; against the run that never
    stopped and appends it to group 0 at the same step."""
    from torch.distributed.checkpoint import save

    from tests.factories import dcp as dk

    model = dk.DeepNet()
    model.head.requires_grad_(False)
    opt = make_optimizer(model, "adamw")
    train(model, opt, dk.PRE_STEPS, use_all=True)
    path = tmp_path / "checkpoint"
    save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    model.head.requires_grad_(True)
    opt.param_groups[0]["params"].extend(model.head.parameters())
    train(model, opt, dk.POST_STEPS, use_all=True, seed=1)
    expected = _params(model)

    out = tmp_path / "fixed"
    document = json.loads(run_cli(["fix", path, "--out", out, "--add-from-model", "--json"]).stdout)
    assert document["fill"] == "fresh" and sorted(a["param"] for a in document["added"]) == sorted(dk.HEAD)
    assert {a["group"] for a in document["added"]} == {0}
    resumed = dk.resume(out, "adamw", "optim", False)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_a_layer_joins_a_flattened_optimizer_with_its_groups_hyperparameters(tmp_path: Path, fmt: str) -> None:
    """torchtitan-style flattened state (``param_groups.<name>.<hp>`` for every parameter): the unfrozen head takes
    the hyperparameters of a member of group 0, and resumes as in the run that never stopped."""
    from torch.distributed.checkpoint import save

    from tests.factories import dcp as dk

    model = dk.DeepNet()
    model.head.requires_grad_(False)
    opt = make_optimizer(model, "adamw")
    train(model, opt, dk.PRE_STEPS, use_all=True)
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, opt, options=dk.options(True))}  # fmt: skip
    path = tmp_path / ("checkpoint" if fmt == "dcp" else "checkpoint.pt")
    if fmt == "dcp":
        save(state, checkpoint_id=path)
    else:
        torch.save(state, path)
    model.head.requires_grad_(True)
    opt.param_groups[0]["params"].extend(model.head.parameters())
    train(model, opt, dk.POST_STEPS, use_all=True, seed=1)
    expected = _params(model)

    out = tmp_path / ("fixed" if fmt == "dcp" else "fixed.pt")
    document = json.loads(run_cli(["fix", path, "--out", out, "--add-from-model", "--fill", "fresh", "--json"]).stdout)
    assert sorted(a["param"] for a in document["added"]) == sorted(dk.HEAD)
    if fmt == "dcp":
        resumed = dk.resume(out, "adamw", "optim", True)
    else:
        saved = torch.load(out, weights_only=True)
        flat = saved["optim"]
        assert flat["param_groups.head.proj.bias.lr"] == flat["param_groups.blocks.0.attn.to_q.weight.lr"]
        resumed_model = dk.DeepNet(seed=7)
        resumed_opt = make_optimizer(resumed_model, "adamw")
        set_model_state_dict(resumed_model, saved["model"])
        set_optimizer_state_dict(resumed_model, resumed_opt, saved["optim"], options=dk.options(True))
        train(resumed_model, resumed_opt, dk.POST_STEPS, use_all=True, seed=1)
        resumed = _params(resumed_model)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


def test_a_layer_unfrozen_between_runs_joins_an_index_keyed_optimizer(tmp_path: Path) -> None:
    """HF-style ``optimizer.state_dict()`` beside ``model.safetensors``: the model's parameters beyond the
    optimizer's join group 0 as its next indices; ``optimizer.load_state_dict`` resumes as the run that never
    stopped and appended the unfrozen layer to group 0."""
    model = TwoHeadNet()
    model.head_unused.requires_grad_(False)
    opt = make_optimizer(model, "adamw")
    train(model, opt, STEPS, use_all=True)
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    torch.save(opt.state_dict(), checkpoint / "optimizer.pt")
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    trainers.save_safetensors(weights, checkpoint / "model.safetensors")
    model.head_unused.requires_grad_(True)
    opt.param_groups[0]["params"].extend(model.head_unused.parameters())
    train(model, opt, MORE, use_all=True, seed=1)
    expected = _params(model)

    out = tmp_path / "fixed"
    document = json.loads(run_cli(["fix", checkpoint, "--out", out, "--add-from-model", "--json"]).stdout)
    assert [(a["param"], a["group"], a["keys"]) for a in document["added"]] == [(4, 0, []), (5, 0, [])]
    resumed_model = TwoHeadNet(seed=3)
    resumed_model.load_state_dict(weights)
    resumed_model.head_unused.requires_grad_(False)
    resumed_opt = make_optimizer(resumed_model, "adamw")
    resumed_model.head_unused.requires_grad_(True)
    resumed_opt.param_groups[0]["params"].extend(resumed_model.head_unused.parameters())
    resumed_opt.load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))
    train(resumed_model, resumed_opt, MORE, use_all=True, seed=1)
    resumed = _params(resumed_model)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        unrepaired = make_optimizer(resumed_model, "adamw")
        unrepaired.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))


def _long_named_checkpoint(tmp_path: Path) -> Path:
    """A real run's name-keyed optimizer state whose first parameter has a 48-character name: 41 a's, ``.weight``."""
    model = TwoHeadNet()
    opt = make_optimizer(model, "adamw")
    train(model, opt, 2, use_all=True)
    state, long = get_optimizer_state_dict(model, opt), {"trunk.weight": "a" * 41 + ".weight"}
    state["state"] = {long.get(name, name): entry for name, entry in state["state"].items()}
    state["param_groups"] = [{**g, "params": [long.get(p, p) for p in g["params"]]} for g in state["param_groups"]]
    torch.save({"optimizer_state_dict": state}, tmp_path / "checkpoint.pt")
    return tmp_path / "checkpoint.pt"


@pytest.mark.parametrize("option", [["--rename", "(a+)+$=x"], ["--drop", "(a+)+$"], ["--drop", "(a|aa)*b"]])
def test_a_pattern_that_could_backtrack_without_bound_is_refused_at_once(tmp_path: Path, option: list[str]) -> None:
    path, out = _long_named_checkpoint(tmp_path), tmp_path / "out.pt"
    command = [*installed_command(), "fix", str(path), "--out", str(out), *option]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr.count("\n")) == (2, 1), result.stderr
    refused = f"{option[0]} '{option[1].split('=')[0]}' could make the matcher try more than 10,000,000,000 ways"
    assert refused in result.stderr
    assert_nothing_written(out)


@pytest.mark.parametrize("rename", ["^a+\\.=x.", "(.*)\\.weight$=\\1.w", "^(a*)(a*)\\.(.*)$=\\2\\1.\\3", "a=b"])
def test_common_patterns_are_applied_to_long_names(tmp_path: Path, rename: str) -> None:
    run_cli(["fix", _long_named_checkpoint(tmp_path), "--out", tmp_path / "out.pt", "--rename", rename], code=0)
