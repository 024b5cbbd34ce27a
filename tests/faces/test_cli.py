"""The ``optim-repair`` command: exit codes, the JSON documents, stdout for results and stderr for messages."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import shutil
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
from optim_repair.formats.pickle_limits import SCANNER
from tests import factories
from tests.conftest import run_cli
from tests.factories import defects, hostile, models, trainers
from tests.factories.built import Built
from tests.factories.support import assert_fixed_copy, assert_nothing_written, installed_command, untouched

TORCH_PACKAGE = importlib.metadata.version("torch")
"""The installed torch as the tool reports it: the package's version, which a CUDA build's ``torch.__version__``
extends by a local part (``2.4.1`` against ``2.4.1+cu121``)."""

OPTIMIZER_FIELDS = {
    "file",
    "location",
    "key_style",
    "layout",
    "loader",
    "resumes_as_is",
    "groups",
    "params",
    "states",
    "missing",
    "empty",
    "malformed",
    "notices",
    "cold",
}
INSPECT_FIELDS = {
    "schema_version",
    "versions",
    "path",
    "format",
    "verdict",
    "strict",
    "optimizers",
    "notices",
    "skipped",
}
FIX_FIELDS = INSPECT_FIELDS | {"out", "added", "verification"}


def fix_cli(checkpoint: Path, out: Path, *extra: str, code: int) -> Result:
    """``optim-repair fix``; the input must be unchanged afterwards whatever the outcome."""
    with untouched(checkpoint):
        return run_cli(["fix", checkpoint, "--out", out, *extra], code=code)


def error_document(code: str, exit_code: int, line: str, path: str | None) -> dict[str, Any]:
    """What ``--json`` prints on stdout for the error whose one line on stderr is ``line``."""
    message = line.removeprefix("optim-repair: error: ")
    return {"schema_version": 2, "error": {"code": code, "exit_code": exit_code, "message": message, "path": path}}


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
    for notice in doc["notices"]:
        assert set(notice) == {"code", "severity", "detail"} and notice["severity"] in ("info", "warning")


def inspect_json(path: Path, code: int) -> dict[str, Any]:
    result = run_cli(["inspect", "--json", path], code=code)
    document: dict[str, Any] = json.loads(result.stdout)
    assert set(document) >= INSPECT_FIELDS
    assert document["schema_version"] == 2 and document["format"] == "torch" and document["path"] == str(path)
    assert document["versions"] == {
        "optim_repair": optim_repair.__version__,
        "torch": TORCH_PACKAGE,
        "scanner": SCANNER,
    }
    for opt in document["optimizers"]:
        check_optimizer_doc(opt)
    for skipped in document["skipped"]:
        assert set(skipped) == {"file", "kind", "reason"} and skipped["kind"] in ("other", "unsafe", "deepspeed-zero")
    return document


# ---------------------------------------------------------------- inspect


def test_inspect_bug_report_json(bug_report_checkpoint: Built) -> None:
    document = inspect_json(bug_report_checkpoint.path, code=1)
    assert document["verdict"] == "repairable"
    (opt,) = document["optimizers"]
    assert {
        k: opt[k] for k in ("file", "location", "key_style", "groups", "params", "states", "empty", "malformed", "cold")
    } == {
        "file": "checkpoint.pt",
        "location": "optimizer_state_dict",
        "key_style": "name",
        "groups": 1,
        "params": 40,
        "states": 36,
        "empty": [],
        "malformed": [],
        "cold": False,
    }
    assert opt["missing"] == list(models.BUG_REPORT_MISSING)


@pytest.mark.parametrize(
    "factory", ["unirl_torch", "petrainer", "hf_trainer", "accelerate", "lightning", "multi_optimizer", "legacy_format"]
)
def test_inspect_every_layout(root: Path, factory: str) -> None:
    """Index-keyed optimizers resume through optimizer.load_state_dict, which takes absent entries: healthy,
    with the absent entries still listed; name-keyed ones need a repair."""
    built = factories.FACTORIES[factory](root)
    index = factory in ("hf_trainer", "accelerate", "lightning")
    document = inspect_json(built.path, code=0 if index else 1)
    got = {(o["file"], o["location"]): (o["key_style"], o["missing"]) for o in document["optimizers"]}
    style = "index" if index else "name"
    assert got == {(s.file, s.location): (style, list(m)) for s, m in built.missing.items()}
    loader = "load_state_dict" if index else "set_optimizer_state_dict"
    assert {(o["loader"], o["resumes_as_is"]) for o in document["optimizers"]} == {(loader, index)}
    strict = json.loads(run_cli(["inspect", "--json", "--strict", built.path], code=1).stdout)
    assert strict["verdict"] == "repairable" and strict["strict"] is True


def test_inspect_hf_lists_skipped_neighbours_and_warns(hf_checkpoint: Built) -> None:
    document = inspect_json(hf_checkpoint.path, code=0)
    assert document["skipped"] == [
        {"file": "rng_state.pth", "kind": "other", "reason": "holds no optimizer state"},
        {"file": "scheduler.pt", "kind": "other", "reason": "holds no optimizer state"},
        {
            "file": "training_args.bin",
            "kind": "unsafe",
            "reason": "refuses to load global tests.factories.trainers.TrainingArguments",
        },
    ]
    assert [(n["code"], n["severity"]) for n in document["notices"]] == [("skipped-unsafe", "warning")]
    assert document["verdict"] == "healthy", "skipped neighbours do not change the verdict"


def test_inspect_healthy_exits_0(healthy_checkpoint: Built) -> None:
    document = inspect_json(healthy_checkpoint.path, code=0)
    assert document["verdict"] == "healthy"
    result = run_cli(["inspect", healthy_checkpoint.path], code=0)
    assert "healthy" in result.stdout and result.stderr == ""


def test_inspect_cold_and_phantom_warnings(cold_checkpoint: Built, phantom_checkpoint: Built) -> None:
    cold = inspect_json(cold_checkpoint.path, code=0)["optimizers"][0]
    assert cold["cold"] is True
    assert [(n["code"], n["severity"]) for n in cold["notices"]] == [
        ("cold", "info"),
        ("sparse-ok-for-load-state-dict", "info"),
    ]
    assert cold["missing"] == [0, 1, 2, 3, 4, 5] and cold["states"] == 0
    phantom = inspect_json(phantom_checkpoint.path, code=0)["optimizers"][0]
    assert phantom["cold"] is False and ("phantom-step", "warning") in [
        (n["code"], n["severity"]) for n in phantom["notices"]
    ]


def test_inspect_empty_entries_are_listed_and_healthy(empty_entries_checkpoint: Built) -> None:
    document = inspect_json(empty_entries_checkpoint.path, code=0)
    assert document["optimizers"][0]["empty"] == list(empty_entries_checkpoint.defects[empty_entries_checkpoint.site])


@pytest.mark.parametrize(
    ("name", "code", "param"),
    [
        ("partial_state", "partial-state", "trunk.bias"),
        ("orphan_state", "orphan-state", "ghost.weight"),
        ("duplicate_param", "duplicate-param", "trunk.weight"),
        ("bad_entry_not_mapping_list", "bad-entry", "trunk.bias"),
        ("bad_entry_moment_not_tensor", "bad-entry", "trunk.weight"),
        ("shape_mismatch", "shape-mismatch", "trunk.weight"),
    ],
)
def test_malformed_inspect_exits_3_and_fix_writes_nothing(
    root: Path, tmp_path: Path, name: str, code: str, param: str
) -> None:
    built = defects.MALFORMED[name](root)
    document = inspect_json(built.path, code=3)
    assert document["verdict"] == "malformed"
    assert [(m["code"], m["param"]) for m in document["optimizers"][0]["malformed"]] == [(code, param)]
    out = tmp_path / "out.pt"
    result = fix_cli(built.path, out, "--json", code=3)
    line = one_error_line(result, code, repr(param), "malformed")
    assert json.loads(result.stdout) == error_document("not-repairable", 3, line, None)
    assert_nothing_written(out)


def test_inspect_human_report_goes_to_stdout(hf_checkpoint: Built) -> None:
    result = run_cli(["inspect", hf_checkpoint.path], code=0)
    assert "healthy" in result.stdout and "optimizer.pt" in result.stdout
    assert "skipped training_args.bin" in result.stdout
    assert result.stderr == ""


# ---------------------------------------------------------------- fix


def test_fix_json_document(petrainer_checkpoint: Built, tmp_path: Path) -> None:
    built = petrainer_checkpoint
    out = tmp_path / "fixed"
    result = fix_cli(built.path, out, "--json", code=0)
    document = json.loads(result.stdout)
    assert set(document) >= FIX_FIELDS
    assert document["out"] == str(out) and document["schema_version"] == 2
    assert sorted((a["file"], a["location"], a["param"]) for a in document["added"]) == sorted(
        (s.file, s.location, p) for s, missing in built.missing.items() for p in missing
    )
    for added in document["added"]:
        assert set(added) >= {"file", "location", "param"}
    verification = document["verification"]
    assert set(verification) == {"tensors", "bytes", "linked", "proof"}
    assert verification["proof"] == "read back through the file system"
    assert verification["tensors"] == 36 and verification["bytes"] > 0
    assert "writing" in result.stderr, "progress goes to stderr"
    assert document["fill"] == "fresh" and document["fill_notes"] == [], "the weights beside give the shapes"
    assert_fixed_copy(built, out, fill="fresh")


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
    assert_fixed_copy(unirl_checkpoint, out, fill="fresh")


def test_fix_nested_out_exits_5(unirl_checkpoint: Built, tmp_path: Path) -> None:
    nested = unirl_checkpoint.path / "fixed"
    result = fix_cli(unirl_checkpoint.path, nested, code=5)
    one_error_line(result, "must not be the input or inside it")
    assert not nested.exists()
    result = fix_cli(unirl_checkpoint.path, unirl_checkpoint.path.parent, "--force", code=5)
    one_error_line(result, "must not contain the input")


# ---------------------------------------------------------------- bad input: exit 4


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    built = defects.healthy(tmp_path / "src")
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
    built = hostile.unsafe_legacy_pickle(root, marker) if legacy else hostile.unsafe_pickle(root, marker)
    result = run_cli(["inspect", built.path], code=4)
    one_error_line(result, f"{built.path}: refuses to load global {os.name}.system")
    out = tmp_path / "out.pt"
    result = fix_cli(built.path, out, code=4)
    one_error_line(result, f"refuses to load global {os.name}.system")
    assert not marker.exists()
    assert_nothing_written(out)


def test_hf_training_args_file_is_refused_naming_the_class(hf_checkpoint: Built) -> None:
    result = run_cli(["inspect", hf_checkpoint.path / "training_args.bin"], code=4)
    one_error_line(result, "training_args.bin: refuses to load global tests.factories.trainers.TrainingArguments")


def test_directory_without_optimizer_exits_4(hf_checkpoint: Built) -> None:
    (hf_checkpoint.path / "optimizer.pt").unlink()
    result = run_cli(["inspect", "--json", hf_checkpoint.path], code=4)
    line = one_error_line(result, "no optimizer state found")
    assert json.loads(result.stdout) == error_document("input", 4, line, str(hf_checkpoint.path))


# ---------------------------------------------------------------- usage: exit 2


@pytest.mark.parametrize(
    "args",
    [
        ["inspect"],
        ["fix", "x.pt"],
        ["fix", "x.pt", "--out", "y.pt", "--fill", "zeros"],
        ["inspect", "--bogus", "x"],
        ["frobnicate"],
    ],
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


def test_optimizer_alone_asks_for_its_fresh_state(unirl_checkpoint: Built, tmp_path: Path) -> None:
    """Naming the optimizer only matters for fresh state: without --fill it implies --fill fresh."""
    out = tmp_path / "out"
    document = json.loads(fix_cli(unirl_checkpoint.path, out, "--optimizer", "adamw", "--json", code=0).stdout)
    assert document["fill"] == "fresh"
    assert {tuple(added["keys"]) for added in document["added"]} == {("step", "exp_avg", "exp_avg_sq")}


def test_remedies_name_the_flags_library_errors_name_keyword_arguments(root: Path, tmp_path: Path) -> None:
    """The library says ``pass model=PATH``; the CLI says ``pass --model PATH``, for the same error."""
    r = models.run()
    alone = root / "optimizer.pt"
    torch.save({"optimizer": get_optimizer_state_dict(r.model, r.optimizer)}, alone)
    hf = trainers.hf_trainer(root / "hf")
    cases = [
        ([alone, "--out", tmp_path / "a.pt", "--fill", "fresh"], 3, "; pass --model PATH with the model's weights"),
        ([hf.path, "--out", tmp_path / "b", "--fill", "fresh"], 3, "; pass --fill empty: optimizer.load_state_dict"),
        (
            [alone, "--out", tmp_path / "c.pt", "--fill", "fresh", "--optimizer", "lion"],
            2,
            "invalid value 'lion' for --optimizer: choose adam, adamw,",
        ),
        ([alone, "--out", alone], 5, "--out must not be the input or inside it"),
        ([alone, "--out", tmp_path / "absent" / "d.pt"], 5, "no such directory for --out"),
    ]
    for args, code, fragment in cases:
        one_error_line(run_cli(["fix", *args], code=code), fragment)
    for args, _, _ in cases:
        with pytest.raises(optim_repair.OptimRepairError) as caught:
            optim_repair.fix(
                args[0], args[2], fill=args[4] if len(args) > 4 else None, optimizer=args[6] if len(args) > 6 else None
            )
        assert "--" not in str(caught.value), "library messages name keyword arguments, not flags"


# ---------------------------------------------------------------- the installed command


def test_the_installed_command_runs_in_a_subprocess(hf_checkpoint: Built, tmp_path: Path) -> None:
    command = installed_command()
    inspected = subprocess.run(
        [*command, "inspect", "--json", str(hf_checkpoint.path)], capture_output=True, text=True, timeout=120
    )
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["optimizers"][0]["missing"] == [4, 5]
    out = tmp_path / "fixed"
    with untouched(hf_checkpoint.path):
        fixed = subprocess.run(
            [*command, "fix", str(hf_checkpoint.path), "--out", str(out), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["verification"]["tensors"] > 0
    assert_fixed_copy(hf_checkpoint, out)
    refused = subprocess.run(
        [*command, "inspect", str(tmp_path / "absent.pt")], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 4 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"optim-repair: error: {tmp_path / 'absent.pt'}: no such file or directory"
    ]


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


# ---------------------------------------------------------------- conventions users expect


def test_version_help_and_quiet(unirl_checkpoint: Built, tmp_path: Path) -> None:
    version = run_cli(["--version"]).stdout
    assert version == f"optim-repair {optim_repair.__version__} (torch {TORCH_PACKAGE}, {SCANNER} scanner)\n"
    assert run_cli(["-V"]).stdout == version
    assert run_cli(["fix", "-h"]).stdout.startswith("Usage: ")
    out = tmp_path / "fixed"
    loud = fix_cli(unirl_checkpoint.path, out, code=0)
    assert "writing" in loud.stderr
    quiet = fix_cli(unirl_checkpoint.path, tmp_path / "quiet", "-q", code=0)
    assert quiet.stderr == "" and "verified" in quiet.stdout, "results only"
    failed = fix_cli(unirl_checkpoint.path, out, "--quiet", code=5)
    one_error_line(failed, "already exists"), "errors are still shown"


def test_color_choices_and_plain_tables(unirl_checkpoint: Built) -> None:
    always = run_cli(["inspect", unirl_checkpoint.path, "--color", "always"], code=1).stdout
    never = run_cli(["inspect", unirl_checkpoint.path, "--color", "never"], code=1, env={"FORCE_COLOR": "1"}).stdout
    assert "\x1b[" in always and "\x1b[" not in never
    dumb = run_cli(["inspect", unirl_checkpoint.path], code=1, env={"TERM": "dumb"}).stdout
    assert "+--" in dumb and "━" not in dumb and "┃" not in dumb
    assert "┃" in run_cli(["inspect", unirl_checkpoint.path], code=1, env={"TERM": "xterm"}).stdout
    bad = run_cli(["inspect", unirl_checkpoint.path, "--color", "sometimes"], code=2)
    one_error_line(bad, "invalid value 'sometimes' for --color: choose auto, always or never")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["fix", "x.pt", "--out", "y.pt", "--fill", "zero"],
            "invalid value 'zero' for --fill: choose auto, empty or fresh",
        ),
        (["inspect", "--bogus", "x"], "no such option: --bogus; see '"),
        (["frobnicate"], "no such command 'frobnicate'; see '"),
    ],
)
def test_usage_errors_are_one_line_and_a_json_document(args: list[str], fragment: str) -> None:
    plain = run_cli(args, code=2)
    line = one_error_line(plain, fragment)
    assert plain.stdout == "" and "Usage:" not in plain.stderr
    as_json = run_cli([*args, "--json"], code=2)
    assert json.loads(as_json.stdout) == error_document("usage", 2, line, None)


def test_mistakes_users_make_get_messages_that_say_what_to_do(hf_checkpoint: Built, tmp_path: Path) -> None:
    weights = hf_checkpoint.path / "model.safetensors"
    trainers.save_safetensors({"w": torch.zeros(2)}, weights)
    one_error_line(
        run_cli(["inspect", weights], code=4),
        "model weights, not optimizer state; the optimizer is in optimizer.pt beside it",
    )
    torch.save(models.TwoHeadNet().state_dict(), tmp_path / "pytorch_model.bin")
    one_error_line(
        run_cli(["inspect", tmp_path / "pytorch_model.bin"], code=4),
        "model weights, not optimizer state; the optimizer is usually in optimizer.pt",
    )
    typo = hf_checkpoint.path.parent / "checkpont-3"
    one_error_line(run_cli(["inspect", typo], code=4), f"did you mean {hf_checkpoint.path}?")
    far = hf_checkpoint.path.parent / "zzz"
    assert "did you mean" not in one_error_line(run_cli(["inspect", far], code=4), "no such file or directory")


def test_out_with_a_trailing_slash_writes_into_that_directory(unirl_checkpoint: Built, tmp_path: Path) -> None:
    """As ``cp``: for a file, ``--out DIR/`` writes ``DIR/<its name>``."""
    source = unirl_checkpoint.path / "checkpoint.pt"
    target = tmp_path / "newdir"
    target.mkdir()
    result = run_cli(["fix", source, "--out", f"{target}/", "--json"], code=0)
    written = target / "checkpoint.pt"
    assert json.loads(result.stdout)["out"] == str(written) and sorted(target.iterdir()) == [written]
    (opt,) = optim_repair.inspect(written).optimizers
    assert opt.missing == () and opt.empty == (), "fresh state, the default where the weights give the shapes"
    absent = run_cli(["fix", source, "--out", f"{tmp_path / 'absent'}/"], code=5)
    one_error_line(absent, "no such directory for --out")


def test_dry_run_shows_the_plan_and_writes_nothing(unirl_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "fixed"
    report = fix_cli(unirl_checkpoint.path, out, "--dry-run", code=0).stdout
    assert "dry run" in report and "nothing was written" in report and "free there" in report
    document = json.loads(fix_cli(unirl_checkpoint.path, out, "--dry-run", "--json", "--fill", "fresh", code=0).stdout)
    assert document["dry_run"] is True and document["fill"] == "fresh" and document["out"] == str(out)
    fresh = sum(math.prod(p.shape) * 4 * 2 + 4 for p in models.TwoHeadNet().head_unused.parameters())  # moments, step
    size = sum(path.stat().st_size for path in unirl_checkpoint.path.rglob("*") if path.is_file())
    assert document["bytes_to_write"] == size + fresh
    assert 0 < document["free_bytes"] <= shutil.disk_usage(tmp_path).total
    assert sorted((a["param"], a["keys"]) for a in document["added"]) == sorted(
        (p, ["step", "exp_avg", "exp_avg_sq"]) for s in unirl_checkpoint.missing for p in unirl_checkpoint.missing[s]
    )
    assert_nothing_written(out)
    refused = fix_cli(unirl_checkpoint.path, out, "--dry-run", "--fill", "fresh", "--optimizer", "lion", code=2)
    one_error_line(refused, "--optimizer")


def test_fix_refuses_up_front_when_the_disk_is_too_small(unirl_checkpoint: Built, tmp_path: Path) -> None:
    """A tmpfs smaller than the copy, mounted in a user namespace of its own (nothing outside sees it)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a user namespace to mount a small file system (unshare -rm)")
    command = " ".join(installed_command())
    assert (unirl_checkpoint.path / "checkpoint.pt").stat().st_size > 4096
    script = (
        f"mount -t tmpfs -o size=4k tmpfs {small} && {command} fix {unirl_checkpoint.path} "
        f"--out {small}/fixed.pt --json; code=$?; ls -A {small}; exit $code"
    )
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 5, result.stderr
    document, listing = result.stdout.split("\n}\n")
    error = json.loads(document + "\n}")["error"]
    assert error["code"] == "output" and "only" in error["message"] and "are free there" in error["message"]
    assert listing.strip() == "", "nothing was written"


def test_a_dry_run_refuses_what_the_run_would_refuse(unirl_checkpoint: Built, tmp_path: Path) -> None:
    """An ``--out`` that exists (without ``--force``), a read-only or too small file system, a missing directory:
    ``fix`` refuses each before it writes, so its dry run does too, in the same words, leaving nothing behind."""
    ckpt = unirl_checkpoint.path
    taken = tmp_path / "taken"
    fix_cli(ckpt, taken, "-q", code=0)
    one_error_line(fix_cli(ckpt, taken, "--dry-run", code=5), str(taken), "already exists", "--force")
    assert "enough room" in fix_cli(ckpt, taken, "--dry-run", "--force", code=0).stdout
    one_error_line(fix_cli(ckpt, tmp_path / "none" / "out", "--dry-run", code=5), "no such directory for --out")
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a user namespace to mount a file system (unshare -rm)")
    command = " ".join(installed_command())
    for options, words in (("ro", "cannot write (Read-only file system)"), ("size=4k", "are free there")):
        mounted = tmp_path / options.replace("=", "-")
        mounted.mkdir()
        script = (
            f"mount -t tmpfs -o {options} tmpfs {mounted} && {command} fix {ckpt} --out {mounted}/fixed --dry-run; "
            f"code=$?; ls -A {mounted}; exit $code"
        )
        result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
        assert result.returncode == 5 and words in result.stderr, result.stderr
        assert "dry run" not in result.stdout and result.stdout.strip() == "", "nothing reported, nothing left"


def test_a_deepspeed_zero_checkpoint_is_healthy_and_copied(root: Path, tmp_path: Path) -> None:
    """HF + DeepSpeed ZeRO: no per-parameter entries to judge; a pre-resume script must not refuse it (exit 4)."""
    built = trainers.deepspeed_zero(root)
    document = inspect_json(built.path, code=0)
    assert document["verdict"] == "healthy" and document["optimizers"] == []
    assert [(n["code"], n["severity"]) for n in document["notices"]] == [("deepspeed-zero", "info")]
    out = tmp_path / "copy"
    fixed = json.loads(fix_cli(built.path, out, "--json", code=0).stdout)
    assert fixed["added"] == [] and fixed["verification"]["bytes"] > 0
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == sorted(
        p.relative_to(built.path) for p in built.path.rglob("*")
    )


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_the_shell_completion_completes_commands_and_options(shell: str) -> None:
    """The script --show-completion prints calls the installed command back, which completes what was typed."""
    assert "--install-completion" in run_cli(["--help"]).stdout
    named = {**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}  # the shell named, not detected
    script = subprocess.run(
        [*installed_command(), "--show-completion", shell], capture_output=True, text=True, env=named
    )
    assert script.returncode == 0 and "_OPTIM_REPAIR_COMPLETE" in script.stdout, script.stderr
    typed = {"COMP_WORDS": "optim-repair fix --fi", "COMP_CWORD": "2", "_TYPER_COMPLETE_ARGS": "optim-repair fix --fi"}
    asked = {**typed, "_TYPER_COMPLETE_FISH_ACTION": "get-args", "_OPTIM_REPAIR_COMPLETE": f"complete_{shell}"}
    completed = subprocess.run(installed_command(), capture_output=True, text=True, env={**os.environ, **asked})
    assert completed.returncode == 0 and "--fill" in completed.stdout, completed.stderr
