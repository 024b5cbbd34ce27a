"""The ``optim-repair`` command: exit codes, the JSON documents, stdout for results and stderr for messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from typer.testing import Result

import optim_repair
from tests import checkpoints as ck
from tests import models
from tests.checkpoints import Built
from tests.conftest import run_cli
from tests.support import assert_fixed_copy, assert_nothing_written, installed_command, untouched

OPTIMIZER_FIELDS = {"file", "location", "key_style", "groups", "params", "states", "missing", "empty", "malformed",
                    "warnings", "cold"}
INSPECT_FIELDS = {"schema_version", "path", "format", "verdict", "optimizers", "warnings", "skipped"}
FIX_FIELDS = INSPECT_FIELDS | {"out", "added", "verification"}


def fix_cli(checkpoint: Path, out: Path, *extra: str, code: int) -> Result:
    """``optim-repair fix``; the input must be unchanged afterwards whatever the outcome."""
    with untouched(checkpoint):
        return run_cli(["fix", checkpoint, "--out", out, *extra], code=code)


def one_error_line(result: Result, *fragments: str) -> str:
    """stderr holds exactly one line, ``optim-repair: error: ...``, holding every fragment; no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("optim-repair: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def check_optimizer_doc(doc: dict[str, Any]) -> None:
    assert set(doc) >= OPTIMIZER_FIELDS
    assert doc["key_style"] in ("name", "index")
    assert all(isinstance(doc[k], int) for k in ("groups", "params", "states"))
    assert isinstance(doc["cold"], bool)
    for finding in doc["malformed"]:
        assert set(finding) == {"param", "code", "detail"}
    for warning in doc["warnings"]:
        assert set(warning) == {"code", "detail"}


def inspect_json(path: Path, code: int) -> dict[str, Any]:
    result = run_cli(["inspect", "--json", path], code=code)
    document: dict[str, Any] = json.loads(result.stdout)
    assert set(document) >= INSPECT_FIELDS
    assert document["schema_version"] == 1 and document["format"] == "torch" and document["path"] == str(path)
    for opt in document["optimizers"]:
        check_optimizer_doc(opt)
    for skipped in document["skipped"]:
        assert set(skipped) == {"file", "reason"}
    return document


# ---------------------------------------------------------------- inspect


def test_inspect_bug_report_json(bug_report_checkpoint: Built) -> None:
    document = inspect_json(bug_report_checkpoint.path, code=1)
    assert document["verdict"] == "repairable"
    (opt,) = document["optimizers"]
    assert {k: opt[k] for k in ("file", "location", "key_style", "groups", "params", "states", "empty", "malformed",
                                 "cold")} == {
        "file": "checkpoint.pt", "location": "optimizer_state_dict", "key_style": "name", "groups": 1, "params": 40,
        "states": 36, "empty": [], "malformed": [], "cold": False}
    assert opt["missing"] == list(models.BUG_REPORT_MISSING)


@pytest.mark.parametrize("factory", ["unirl_torch", "petrainer", "hf_trainer", "accelerate", "lightning",
                                     "multi_optimizer", "legacy_format"])
def test_inspect_every_layout(root: Path, factory: str) -> None:
    built = ck.FACTORIES[factory](root)
    document = inspect_json(built.path, code=1)
    got = {(o["file"], o["location"]): (o["key_style"], o["missing"]) for o in document["optimizers"]}
    style = "index" if factory in ("hf_trainer", "accelerate", "lightning") else "name"
    assert got == {(s.file, s.location): (style, list(m)) for s, m in built.missing.items()}


def test_inspect_hf_lists_skipped_neighbours_and_warns(hf_checkpoint: Built) -> None:
    document = inspect_json(hf_checkpoint.path, code=1)
    assert document["skipped"] == [
        {"file": "rng_state.pth", "reason": "refuses to load global tests.checkpoints.LegacyRandomState"},
        {"file": "scheduler.pt", "reason": "holds no optimizer state"},
        {"file": "training_args.bin", "reason": "refuses to load global tests.checkpoints.TrainingArguments"},
    ]
    assert [w["code"] for w in document["warnings"]] == ["skipped-unsafe"]
    assert document["verdict"] == "repairable", "skipped neighbours do not change the verdict"


def test_inspect_healthy_exits_0(healthy_checkpoint: Built) -> None:
    document = inspect_json(healthy_checkpoint.path, code=0)
    assert document["verdict"] == "healthy"
    result = run_cli(["inspect", healthy_checkpoint.path], code=0)
    assert "healthy" in result.stdout and result.stderr == ""


def test_inspect_cold_and_phantom_warnings(cold_checkpoint: Built, phantom_checkpoint: Built) -> None:
    cold = inspect_json(cold_checkpoint.path, code=1)["optimizers"][0]
    assert cold["cold"] is True
    assert [w["code"] for w in cold["warnings"]] == ["cold", "sparse-ok-for-load-state-dict"]
    assert cold["missing"] == [0, 1, 2, 3, 4, 5] and cold["states"] == 0
    phantom = inspect_json(phantom_checkpoint.path, code=0)["optimizers"][0]
    assert phantom["cold"] is False and "phantom-step" in [w["code"] for w in phantom["warnings"]]


def test_inspect_empty_entries_are_listed_and_healthy(empty_entries_checkpoint: Built) -> None:
    document = inspect_json(empty_entries_checkpoint.path, code=0)
    assert document["optimizers"][0]["empty"] == list(empty_entries_checkpoint.defects[empty_entries_checkpoint.site])


@pytest.mark.parametrize(
    ("name", "code", "param"),
    [("partial_state", "partial-state", "trunk.bias"), ("orphan_state", "orphan-state", "ghost.weight"),
     ("duplicate_param", "duplicate-param", "trunk.weight"), ("bad_entry_not_mapping_list", "bad-entry", "trunk.bias"),
     ("bad_entry_moment_not_tensor", "bad-entry", "trunk.weight"),
     ("shape_mismatch", "shape-mismatch", "trunk.weight")],
)
def test_malformed_inspect_exits_3_and_fix_writes_nothing(
    root: Path, tmp_path: Path, name: str, code: str, param: str
) -> None:
    built = ck.MALFORMED[name](root)
    document = inspect_json(built.path, code=3)
    assert document["verdict"] == "malformed"
    assert [(m["code"], m["param"]) for m in document["optimizers"][0]["malformed"]] == [(code, param)]
    out = tmp_path / "out.pt"
    result = fix_cli(built.path, out, "--json", code=3)
    one_error_line(result, code, repr(param), "malformed")
    assert result.stdout == ""
    assert_nothing_written(out)


def test_inspect_human_report_goes_to_stdout(hf_checkpoint: Built) -> None:
    result = run_cli(["inspect", hf_checkpoint.path], code=1)
    assert "repairable" in result.stdout and "optimizer.pt" in result.stdout
    assert "skipped training_args.bin" in result.stdout
    assert result.stderr == ""


# ---------------------------------------------------------------- fix


def test_fix_json_document(petrainer_checkpoint: Built, tmp_path: Path) -> None:
    built = petrainer_checkpoint
    out = tmp_path / "fixed"
    result = fix_cli(built.path, out, "--json", code=0)
    document = json.loads(result.stdout)
    assert set(document) >= FIX_FIELDS
    assert document["out"] == str(out) and document["schema_version"] == 1
    assert sorted((a["file"], a["location"], a["param"]) for a in document["added"]) == sorted(
        (s.file, s.location, p) for s, missing in built.missing.items() for p in missing)
    for added in document["added"]:
        assert set(added) >= {"file", "location", "param"}
    verification = document["verification"]
    assert set(verification) >= {"tensors", "bytes", "equal"}
    assert verification["equal"] is True and verification["tensors"] == 36 and verification["bytes"] > 0
    assert "writing" in result.stderr, "progress goes to stderr"
    assert_fixed_copy(built, out)


def test_fix_human_report(lightning_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "fixed.ckpt"
    result = fix_cli(lightning_checkpoint.path, out, code=0)
    assert "verified" in result.stdout and str(out) in result.stdout
    assert_fixed_copy(lightning_checkpoint, out)


def test_fix_healthy_writes_a_verified_copy(healthy_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "h.pt"
    document = json.loads(fix_cli(healthy_checkpoint.path, out, "--json", code=0).stdout)
    assert document["added"] == [] and document["verdict"] == "healthy" and out.is_file()


def test_fix_existing_out_exits_5_unless_forced(unirl_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with untouched(out):
        result = fix_cli(unirl_checkpoint.path, out, code=5)
    one_error_line(result, str(out), "already exists", "--force")
    assert result.stdout == ""
    fix_cli(unirl_checkpoint.path, out, "--force", code=0)
    assert_fixed_copy(unirl_checkpoint, out)


def test_fix_nested_out_exits_5(unirl_checkpoint: Built, tmp_path: Path) -> None:
    nested = unirl_checkpoint.path / "fixed"
    result = fix_cli(unirl_checkpoint.path, nested, code=5)
    one_error_line(result, "must not be the input or inside it")
    assert not nested.exists()
    result = fix_cli(unirl_checkpoint.path, unirl_checkpoint.path.parent, "--force", code=5)
    one_error_line(result, "must not contain the input")


# ---------------------------------------------------------------- bad input: exit 4


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    built = ck.healthy(tmp_path / "src")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(built.path.read_bytes()[:700])
    random_bytes = tmp_path / "random.pt"
    random_bytes.write_bytes(os.urandom(2048))
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    return {"truncated": truncated, "random": random_bytes, "empty": empty, "missing": tmp_path / "absent.pt"}


@pytest.mark.parametrize("command", ["inspect", "fix"])
@pytest.mark.parametrize("kind", ["truncated", "random", "empty", "missing"])
def test_unreadable_inputs_exit_4_with_one_line(tmp_path: Path, command: str, kind: str) -> None:
    path = _bad_inputs(tmp_path)[kind]
    out = tmp_path / "out.pt"
    args: Sequence[str | Path] = ["inspect", path] if command == "inspect" else ["fix", path, "--out", out]
    result = run_cli(args, code=4)
    one_error_line(result, str(path))
    assert result.stdout == ""
    assert_nothing_written(out)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_unsafe_pickle_exits_4_naming_the_global_and_runs_nothing(
    root: Path, marker: Path, tmp_path: Path, legacy: bool
) -> None:
    built = ck.unsafe_legacy_pickle(root, marker) if legacy else ck.unsafe_pickle(root, marker)
    result = run_cli(["inspect", built.path], code=4)
    one_error_line(result, f"{built.path}: refuses to load global {os.name}.system")
    out = tmp_path / "out.pt"
    result = fix_cli(built.path, out, code=4)
    one_error_line(result, f"refuses to load global {os.name}.system")
    assert not marker.exists()
    assert_nothing_written(out)


def test_hf_training_args_file_is_refused_naming_the_class(hf_checkpoint: Built) -> None:
    result = run_cli(["inspect", hf_checkpoint.path / "training_args.bin"], code=4)
    one_error_line(result, "training_args.bin: refuses to load global tests.checkpoints.TrainingArguments")


def test_directory_without_optimizer_exits_4(hf_checkpoint: Built) -> None:
    (hf_checkpoint.path / "optimizer.pt").unlink()
    result = run_cli(["inspect", "--json", hf_checkpoint.path], code=4)
    one_error_line(result, "no optimizer state found")
    assert result.stdout == ""


# ---------------------------------------------------------------- usage: exit 2


@pytest.mark.parametrize(
    "args",
    [["inspect"], ["fix", "x.pt"], ["fix", "x.pt", "--out", "y.pt", "--fill", "zeros"], ["inspect", "--bogus", "x"],
     ["frobnicate"]],
    ids=["no-checkpoint", "no-out", "bad-fill", "bad-option", "bad-command"],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = run_cli(args, code=2)
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_optimizer_without_fresh_fill_is_a_usage_error(unirl_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = fix_cli(unirl_checkpoint.path, out, "--fill", "empty", "--optimizer", "adamw", code=2)
    one_error_line(result, "--optimizer")
    assert_nothing_written(out)


def test_remedies_name_the_flags_library_errors_name_keyword_arguments(root: Path, tmp_path: Path) -> None:
    """The library says ``pass model=PATH``; the CLI says ``pass --model PATH``, for the same error."""
    r = models.run()
    alone = root / "optimizer.pt"
    torch.save({"optimizer": get_optimizer_state_dict(r.model, r.optimizer)}, alone)
    hf = ck.hf_trainer(root / "hf")
    cases = [
        ([alone, "--out", tmp_path / "a.pt", "--fill", "fresh"], 3, "; pass --model PATH with the model's weights"),
        ([hf.path, "--out", tmp_path / "b", "--fill", "fresh"], 3, "; pass --fill empty: optimizer.load_state_dict"),
        ([alone, "--out", tmp_path / "c.pt", "--fill", "fresh", "--optimizer", "lion"], 2, "--optimizer 'lion' is"),
        ([alone, "--out", alone], 5, "--out must not be the input or inside it"),
        ([alone, "--out", tmp_path / "absent" / "d.pt"], 5, "no such directory for --out"),
    ]
    for args, code, fragment in cases:
        one_error_line(run_cli(["fix", *args], code=code), fragment)
    for args, _, _ in cases:
        with pytest.raises(optim_repair.OptimRepairError) as caught:
            optim_repair.fix(args[0], args[2], fill=args[4] if len(args) > 4 else None,
                             optimizer=args[6] if len(args) > 6 else None)
        assert "--" not in str(caught.value), "library messages name keyword arguments, not flags"


# ---------------------------------------------------------------- the installed command


def test_the_installed_command_runs_in_a_subprocess(hf_checkpoint: Built, tmp_path: Path) -> None:
    command = installed_command()
    inspected = subprocess.run([*command, "inspect", "--json", str(hf_checkpoint.path)], capture_output=True,
                               text=True, timeout=120)
    assert inspected.returncode == 1, inspected.stderr
    assert json.loads(inspected.stdout)["optimizers"][0]["missing"] == [4, 5]
    out = tmp_path / "fixed"
    with untouched(hf_checkpoint.path):
        fixed = subprocess.run([*command, "fix", str(hf_checkpoint.path), "--out", str(out), "--json"],
                               capture_output=True, text=True, timeout=120)
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["verification"]["equal"] is True
    assert_fixed_copy(hf_checkpoint, out)
    refused = subprocess.run([*command, "inspect", str(tmp_path / "absent.pt")], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 4 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [f"optim-repair: error: {tmp_path / 'absent.pt'}: "
                                                   "no such file or directory"]


def test_human_reports_show_paths_and_names_verbatim(tmp_path: Path) -> None:
    """Brackets in a path or a parameter name are text, not rich markup (``run[lr=1e-3]``, ``x[red].ckpt``)."""
    directory = tmp_path / "run[lr]"
    directory.mkdir()
    model = models.TwoHeadNet()
    opt = models.make_optimizer(model)
    models.train(model, opt, 1)
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = [f"w[{i}]" for i in sd["param_groups"][0]["params"]]
    sd["state"] = {f"w[{i}]": entry for i, entry in sd["state"].items()}
    torch.save(sd, directory / "x[red].ckpt")
    result = run_cli(["inspect", directory], code=1)
    assert f"{directory}" in result.stdout
    assert "x[red].ckpt" in result.stdout
    assert "w[4], w[5]" in result.stdout
    out = tmp_path / "fixed[b]"
    result = fix_cli(directory, out, code=0)
    assert str(out) in result.stdout and "x[red].ckpt" in result.stdout


def test_inspect_and_help_never_import_torch(unirl_checkpoint: Built) -> None:
    """inspect must cost less than ``import torch``: it never imports it (nor does ``--help``)."""
    probe = (
        "import sys\n"
        "from optim_repair.cli import app\n"
        "for args in (['--help'], ['inspect', sys.argv[1]], ['inspect', '--json', sys.argv[1]]):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, str(unirl_checkpoint.path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
