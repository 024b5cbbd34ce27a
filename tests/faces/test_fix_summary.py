"""fix's summary is the diff of the original and its copy: a line a file (rewritten, hard-linked, copied, added)
with its bytes, a line of totals with the time taken, index keys named by the model beside them, and in JSON the
document ``diff`` gives, which ``diff`` itself finds against the copy."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from optim_repair import api
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import trainers
from tests.factories.models import BranchNet, branch_inputs, train_branches
from tests.factories.terminal import run_in_terminal


def _index_keyed(root: Path) -> Path:
    """A torch file as a plain training loop saves it: the model's state dict beside ``optimizer.state_dict()``
    (index keys), the head never trained."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "head": nn.Linear(4, 2)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model["body"](torch.randn(3, 4)).pow(2).mean().backward()
    optimizer.step()
    root.mkdir()
    path = root / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    return path


def test_on_an_80_column_terminal_each_file_is_a_line_and_the_totals_one_more(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "run")
    code, lines = run_in_terminal(
        ["fix", "run/checkpoint-3", "--out", "fixed", "--link", "--color", "never"], cwd=tmp_path
    )
    assert code == 0, lines
    assert all(len(line) <= 80 for line in lines), lines
    files = {line.split()[0]: line.split()[1] for line in lines if line.startswith(" ") and len(line.split()) >= 3}
    assert files["optimizer.pt"] == "rewritten"
    assert {files[name] for name in ("model.safetensors", "scheduler.pt", "trainer_state.json")} == {"hard-linked"}
    count = sum(1 for path in built.path.iterdir() if path.is_file())
    (totals,) = [line for line in lines if line.startswith(f"{count} file(s): 1 rewritten, {count - 1} hard-linked;")]
    assert totals.endswith(" s")


def test_index_keys_are_named_by_the_model_saved_beside_them(tmp_path: Path) -> None:
    path = _index_keyed(tmp_path / "in")
    result = run_cli(["fix", path, "--out", tmp_path / "out.pt"], code=0)
    assert "{} for 2 (head.weight), 3 (head.bias)" in result.stdout
    document = json.loads(run_cli(["fix", path, "--out", tmp_path / "again.pt", "--json"], code=0).stdout)
    (optimizer,) = document["diff"]["optimizers"]
    assert optimizer["appeared"] == ["2 (head.weight)", "3 (head.bias)"]


def test_a_safetensors_files_sorted_names_name_no_index(tmp_path: Path) -> None:
    """HF's model.safetensors lists its tensors sorted by name, not in the model's order: no index is named."""
    built = trainers.hf_trainer(tmp_path / "run")
    result = run_cli(["fix", built.path, "--out", tmp_path / "fixed"], code=0)
    assert "{} for 4, 5" in result.stdout and "(" not in result.stdout.split("{} for 4, 5")[1].split("\n")[0]


def test_the_json_diff_is_what_diff_finds_between_the_original_and_the_copy(tmp_path: Path) -> None:
    for built, out in ((trainers.unirl_torch(tmp_path / "t"), tmp_path / "t-out"),
                       (dk.unirl_dcp(tmp_path / "d"), tmp_path / "d-out")):  # fmt: skip
        document = json.loads(run_cli(["fix", built.path, "--out", out, "--json"], code=0).stdout)
        assert document["seconds"] >= 0 and document["files"] == document["diff"]["files"]
        assert {change["how"] for change in document["files"]} <= {"rewritten", "copied", "added"}
        found = api.diff(built.path, out)
        assert sorted(leaf["name"] for leaf in document["diff"]["differences"]) == sorted(
            leaf.name for leaf in found.leaves
        )
        (planned,), (seen,) = document["diff"]["optimizers"], found.optimizers
        assert sorted(planned["appeared"]) == sorted(seen.appeared)
        assert document["diff"]["leaves"]["tensors"] == document["verification"]["tensors"]


def test_the_summary_and_the_json_say_the_dtype_of_every_tensor_added(tmp_path: Path) -> None:
    """A real AdamW run whose unused branch has a bf16 weight and an fp32 bias: each added entry's tensors take their
    parameter's dtype, their step the run's scalar dtype, and both the summary and ``added[].dtypes`` say which."""
    torch.manual_seed(0)
    model = BranchNet()
    model.extra.weight = nn.Parameter(model.extra.weight.detach().bfloat16())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_branches(model, optimizer, branch_inputs(2, seed=1), use_extra=False)
    path = tmp_path / "checkpoint.pt"
    state_dict = get_optimizer_state_dict(model, optimizer)
    torch.save({"policy_state_dict": model.state_dict(), "optimizer_state_dict": state_dict}, path)
    wide = {"COLUMNS": "1000"}
    summary = run_cli(["fix", path, "--out", tmp_path / "fixed.pt"], code=0, env=wide).stdout
    assert (
        "exp_avg (bfloat16), exp_avg_sq (bfloat16), step (float32) for extra.weight; "
        "exp_avg (float32), exp_avg_sq (float32), step (float32) for extra.bias"
    ) in summary
    document = json.loads(run_cli(["fix", path, "--out", tmp_path / "again.pt", "--json"], code=0).stdout)
    assert [(a["param"], a["dtypes"]) for a in document["added"]] == [
        ("extra.weight", {"step": "float32", "exp_avg": "bfloat16", "exp_avg_sq": "bfloat16"}),
        ("extra.bias", {"step": "float32", "exp_avg": "float32", "exp_avg_sq": "float32"}),
    ]
    state = torch.load(tmp_path / "again.pt", weights_only=True)["optimizer_state_dict"]["state"]
    for added in document["added"]:
        for key, dtype in added["dtypes"].items():
            assert state[added["param"]][key].dtype == getattr(torch, dtype), (added["param"], key)
