"""The documentation is tested: every command, option, exit code and JSON field is documented."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
import torch
import typer.main

from optim_repair import render
from optim_repair.cli import app
from optim_repair.errors import ExitCode
from tests import factories
from tests.conftest import run_cli
from tests.factories import trainers

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()
JSON_DOC = (ROOT / "docs" / "json.md").read_text()
COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help_and_is_documented(name: str) -> None:
    command = COMMANDS[name]
    assert command.help and len(command.help.strip()) > 20
    assert f"## `optim-repair {name}" in CLI_DOC
    assert f"optim-repair {name}" in README


@pytest.mark.parametrize(
    ("name", "option"),
    [
        (name, opt)
        for name, cmd in sorted(COMMANDS.items())
        for param in cmd.params
        for opt in param.opts
        if opt.startswith("--")
    ],
)
def test_every_option_is_documented(name: str, option: str) -> None:
    assert f"`{option}" in CLI_DOC, f"{name} {option} is not in docs/cli.md"


@pytest.mark.parametrize("code", [v for k, v in vars(ExitCode).items() if k.isupper()])
def test_every_exit_code_is_documented(code: int) -> None:
    row = re.compile(rf"^\| {code} \|", re.MULTILINE)
    assert row.search(README), f"exit code {code} is not in the README"
    assert row.search(CLI_DOC), f"exit code {code} is not in docs/cli.md"


def _fields(doc_type: type, prefix: str = "") -> list[str]:
    fields = []
    for name, hint in typing.get_type_hints(doc_type).items():
        fields.append(prefix + name)
        origin = typing.get_origin(hint)
        inner = typing.get_args(hint)[0] if origin is list else hint
        if typing.is_typeddict(inner) and inner in _BY_REFERENCE:
            continue  # documented in its own section
        if typing.is_typeddict(inner) and inner in _SMALL:
            fields.extend(f"{prefix}{name}[]{{{key}}}" for key in typing.get_type_hints(inner))
        elif typing.is_typeddict(inner):
            fields.extend(_fields(inner, f"{prefix}{name}{'[]' if origin is list else ''}."))
    return fields


_SMALL = (
    render.MalformedDoc, render.NoticeDoc, render.SkippedDoc, render.AddedDoc, render.ShapeMismatchDoc,
    render.ChangedDoc, render.OptionDoc, render.AddedOptionDoc, render.KeyDoc, render.StepDoc, render.OptionChangeDoc,
    render.LeafDiffDoc, render.FileDoc,
)  # fmt: skip
"""Documented in one row each, as ``{a, b, c}``."""
_BY_REFERENCE = (render.DiffDoc,)
"""Documents nested in another (fix's ``diff``), documented in their own section."""


@pytest.mark.parametrize(
    "field",
    sorted({*_fields(render.FixDoc), *_fields(render.DryRunDoc), *_fields(render.ErrorDoc), *_fields(render.DiffDoc)}),
)
def test_every_json_field_is_documented(field: str) -> None:
    if "{" in field:
        row_name, key = field.split("[]{")
        row = next((line for line in JSON_DOC.splitlines() if line.startswith(f"| `{row_name}[]`")), "")
        assert re.search(rf"[{{ ]{key.rstrip('}')}[,}}]", row), field
        return
    top = field.split(".")[0].removesuffix("[]")
    assert f"`{field}" in JSON_DOC or (field == top and f"`{top}[]`" in JSON_DOC), field


@pytest.mark.parametrize(
    "code",
    [
        "partial-state",
        "orphan-state",
        "duplicate-param",
        "bad-entry",
        "shape-mismatch",
        "phantom-step",
        "stock-loader-phantom-step",
        "fsdp1-loader",
        "dcp-missing-key",
        "flattened-missing-state",
        "phantom-step-entries",
        "cold",
        "lagging-steps",
        "skipped-unsafe",
        "deepspeed-zero",
        "universal-missing-state",
        "sparse-ok-for-load-state-dict",
        "whole-optimizer-state",
        "lbfgs-loader",
        "differing-state-keys",
        "lightning-sharded",
        "dcp-missing-option",
        "newer-torch-metadata",
    ],
)
def test_every_finding_code_is_documented(code: str) -> None:
    assert f"`{code}`" in CLI_DOC


def _help(name: str) -> str:
    return run_cli([name, "--help"], code=0).stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_the_usage_the_docs_show_and_every_exit_code(name: str) -> None:
    """docs/cli.md is tested against --help: the usage line, the argument's name, and the exit codes."""
    text = _help(name)
    usage = re.search(rf"Usage: \S+ {name} \[OPTIONS\](.*)", text)
    assert usage is not None, text
    assert f"## `optim-repair {name}{usage.group(1).rstrip()}" in CLI_DOC, usage.group(0)
    assert "{" not in usage.group(1), "the argument is named CKPT, as in the docs"
    codes = [int(code) for code in re.findall(r"^\s+(\d+)  ", text.split("Exit codes:")[1], re.MULTILINE)]
    for code in (
        ExitCode.USAGE,
        ExitCode.INPUT,
        ExitCode.OUTPUT,
        ExitCode.INTERNAL,
        ExitCode.INTERRUPTED,
        ExitCode.TERMINATED,
        ExitCode.OK,
    ):
        assert code in codes, (name, code)
        assert re.search(rf"^\| {int(code)} \|", CLI_DOC, re.MULTILINE)


def test_the_exit_codes_every_command_shares_read_alike_in_the_help_and_the_docs() -> None:
    """docs/cli.md's table starts each shared code's meaning with the help's own words, then says more."""
    from optim_repair.cli.boundary import _COMMON_EXITS

    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", CLI_DOC, re.MULTILINE))
    for code, words in _COMMON_EXITS.items():
        meaning = rows[str(int(code))].replace("`", "").replace("\\|", "|").replace("\\\\", "\\")
        assert meaning.startswith(words), (int(code), words, meaning)


def test_optimizer_help_lists_every_name() -> None:
    from optim_repair.decisions.optimizers import OPTIMIZERS

    text = " ".join(_help("fix").split())
    assert all(name in text for name in OPTIMIZERS)
    assert "-h, --help" in text and "-q, --quiet" in text and "--color" in text


@pytest.mark.parametrize("command", ["inspect", "fix"])
def test_the_ckpt_help_says_a_store_holds_any_checkpoint(command: str) -> None:
    """Torch files are read and repaired in s3:// as DCP checkpoints are."""
    text = " ".join(_help(command).split())
    assert "A torch file, a checkpoint directory, or a DCP directory, on this machine or in s3://" in text


@pytest.mark.parametrize("factory", ["hf_trainer", "unirl_torch", "unirl_dcp"])
def test_the_readme_python_example(tmp_path: Path, factory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's library example, as written, on an HF Trainer step (index keys), a UniRL torch file and a DCP
    checkpoint: each a checkpoint-1000/ of its own."""
    from tests.factories import dcp

    block = README.split("```python\n", 1)[1].split("```", 1)[0]
    built = (dcp.unirl_dcp if factory == "unirl_dcp" else factories.FACTORIES[factory])(tmp_path / "run")
    (tmp_path / "checkpoint-1000").symlink_to(built.path)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    assert (tmp_path / "checkpoint-1000-fixed").exists()


def _resume_script() -> str:
    block = README.split("## Before resuming", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    assert block.startswith("#!/bin/sh")
    return block


@pytest.mark.parametrize("factory", ["hf_trainer", "unirl_torch"])
def test_the_readme_resume_script(tmp_path: Path, factory: str) -> None:
    """Run directories (``--latest``): HF Trainer (index keys, absent entries) resumes from its newest step itself,
    copying nothing; UniRL (names) from a verified repaired copy with exact fresh state, written beside the run
    directory, where the next run does not take it for a step. An older step and a step still being written
    (a DCP directory without its ``.metadata``) are passed over."""
    import os
    import subprocess
    import sys

    import optim_repair

    run = tmp_path / "run"
    factories.FACTORIES[factory](run / "older")
    older = next((run / "older").iterdir())
    built = factories.FACTORIES[factory](run)
    number = int(built.path.name.rsplit("-", 1)[1])
    older.rename(run / f"checkpoint-{number - 1}")
    (run / "older").rmdir()
    unfinished = run / f"checkpoint-{number + 1}" / "optimizer"
    unfinished.mkdir(parents=True)
    (unfinished / "__0_0.distcp").write_bytes(b"still being written")
    script = tmp_path / "resume.sh"
    script.write_text(_resume_script())
    (tmp_path / "train.py").write_text("import sys\nprint('resuming from', sys.argv[2])\n")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    before = sorted(p.name for p in run.iterdir())
    done = subprocess.run(["sh", str(script), f"{run}/"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PATH": path}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in run.iterdir()) == before, "nothing was written inside the run directory"
    fixed = tmp_path / "run.fixed" / built.path.name
    if factory == "hf_trainer":
        assert done.stdout == f"resuming from {built.path}\n"
        assert not fixed.parent.exists(), "nothing was copied"
    else:
        assert done.stdout == f"resuming from {fixed}\n"
        assert optim_repair.inspect(fixed).verdict == "healthy"
        assert optim_repair.plan(fixed).additions == ()


def _shape(value: object) -> object:
    """The keys of every mapping in ``value``, nested, with a list's first item standing for all of it."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return None


def test_the_readme_json_example_is_a_real_document(tmp_path: Path) -> None:
    """The README's example has every field, and only the fields, that inspect --json writes for its checkpoint."""
    built = trainers.unirl_torch(tmp_path / "ckpt")
    torch.save({"f": eval}, built.path / "extra.pt")
    example = json.loads(re.search(r"```json\n(.*?)```", README, re.S).group(1))  # type: ignore[union-attr]
    document = json.loads(run_cli(["inspect", tmp_path / "ckpt", "--json"], code=1).stdout)
    assert _shape(example) == _shape(document)
    for key in ("verdict", "format", "strict"):
        assert example[key] == document[key], key
    shown, real = example["optimizers"][0], document["optimizers"][0]
    assert [n["code"] for n in shown["notices"]] == [n["code"] for n in real["notices"]]
    assert {k: v for k, v in shown.items() if k != "notices"} == {k: v for k, v in real.items() if k != "notices"}


def test_fix_help_groups_its_options_and_ends_with_examples_the_docs_show() -> None:
    text = _help("fix")
    sections = dict(re.findall(r"^(\w[\w ]*):\n((?:  .*\n|\n(?=  ))+)", text, re.MULTILINE))
    panels = {
        "Model changes": ["--rename", "--drop", "--drop-not-in-model", "--add-from-model", "--to-group"],
        "Object storage": ["--verify", "--profile", "--endpoint-url"],
        "Output": ["--json", "--quiet", "--color"],
    }
    for panel, options in panels.items():
        assert panel in sections, (panel, text)
        assert all(re.search(rf"^  (-\w, )?{option}\b", sections[panel], re.MULTILINE) for option in options), panel
        assert not any(re.search(rf"^  (-\w, )?{option}\b", sections["Options"], re.MULTILINE) for option in options)
    examples = re.findall(r"^\s+(optim-repair fix .+)$", text.split("Examples:")[1].split("Exit codes:")[0], re.M)
    assert 2 <= len(examples) <= 3
    for example in examples:
        assert example in CLI_DOC, example
