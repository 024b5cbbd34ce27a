"""Names from the input never reach the terminal raw: controls, bidi overrides and newlines in parameter names,
file names, dict keys and --model paths are shown escaped, as ``repr`` writes them; ``--json`` keeps them exact."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from optim_repair.errors import shown_name
from optim_repair.render.terminal import escaped
from tests.factories import dcp, models, trainers
from tests.factories.support import installed_command

TITLE = "head\x1b]0;PWNED\x07.weight"
"""Retitles the terminal (OSC 0), ended by BEL."""
FORGED = "x\n  healthy FORGED\u202e\x9b2J"
"""A newline that would forge a report line, a right-to-left override and the C1 CSI clearing the screen."""
HOSTILE = {"head_unused.weight": TITLE, "head_unused.bias": FORGED}
CHECKPOINT = "ck\x1b[2J\u2066.pt"


def _renamed(name: str) -> str:
    return HOSTILE.get(name, name)


def _hostile_checkpoint(root: Path, file: str = CHECKPOINT) -> Path:
    """A real run's name-keyed optimizer state and model weights, saved with torch.save under hostile names:
    the two parameters the optimizer has no state for (so reports list them) and the file itself."""
    r = models.run(optimizer="adamw", steps=2)
    state = get_optimizer_state_dict(r.model, r.optimizer)
    optimizer = {
        "state": {_renamed(name): entry for name, entry in state["state"].items()},
        "param_groups": [{**g, "params": [_renamed(p) for p in g["params"]]} for g in state["param_groups"]],
    }
    weights = {_renamed(name): value for name, value in get_model_state_dict(r.model).items()}
    root.mkdir()
    torch.save({"model": weights, "optimizer": optimizer}, root / file)
    (root / "notes\x1b]0;T\x07\nhealthy").write_text("a file with a hostile name, copied as it is\n")
    return root


def _run(*args: str | Path, code: int) -> subprocess.CompletedProcess[str]:
    """The installed command, as wide as its longest line, so that each line of the report stays whole."""
    result = subprocess.run(
        [*installed_command(), *map(str, args)], capture_output=True, text=True, errors="surrogateescape",
        timeout=120, env={**os.environ, "COLUMNS": "1000"},
    )  # fmt: skip
    assert result.returncode == code, (result.stdout, result.stderr)
    return result


def _assert_shown_escaped(text: str) -> None:
    """No character a terminal acts on or hides: every line is printable (rich's colour is off)."""
    lines = text.split("\n")
    assert lines[-1] == ""
    for line in lines[:-1]:
        assert line.isprintable(), ascii(line)
        assert not line.lstrip().startswith("healthy FORGED"), line


def test_escaped_writes_controls_and_bidi_as_repr_does_and_keeps_other_unicode() -> None:
    hidden = "\x1b\x9b\x00\x7f\n\r\t\u200e\u200f\u202a\u202e\u2066\u2069\u2028\ufeff\udc80"
    assert escaped(f"é中{hidden}") == "é中" + repr(hidden)[1:-1]
    assert escaped("naïve 参数.weight") == "naïve 参数.weight"


def test_a_name_with_a_backslash_is_shown_apart_from_one_with_the_control() -> None:
    assert shown_name("a\\x1b") == "'a\\\\x1b'"
    assert shown_name("a\x1b") == "'a\\x1b'"
    assert shown_name("trunk.weight") == "trunk.weight"


def test_inspect_and_fix_show_hostile_names_escaped(tmp_path: Path) -> None:
    path = _hostile_checkpoint(tmp_path / "checkpoint-2")
    inspected = _run("inspect", path, "--color", "never", code=1)
    _assert_shown_escaped(inspected.stdout)
    assert f"missing in {CHECKPOINT!r}:optimizer: {TITLE!r}, {FORGED!r}" in inspected.stdout
    fixed = _run("fix", path, "--out", tmp_path / "fixed", "--fill", "empty", "--color", "never", code=0)
    _assert_shown_escaped(fixed.stdout)
    _assert_shown_escaped(fixed.stderr)
    assert f"writing {CHECKPOINT!r}" in fixed.stderr
    assert f"{{}} for {TITLE!r}, {FORGED!r}" in fixed.stdout
    assert (tmp_path / "fixed" / "notes\x1b]0;T\x07\nhealthy").is_file()


def test_json_keeps_hostile_names_exact(tmp_path: Path) -> None:
    path = _hostile_checkpoint(tmp_path / "checkpoint-2")
    document = json.loads(_run("inspect", path, "--json", code=1).stdout)
    [optimizer] = document["optimizers"]
    assert (optimizer["file"], optimizer["missing"]) == (CHECKPOINT, [TITLE, FORGED])


def _utf8_only(value: object) -> None:
    """Every string in a parsed JSON document is UTF-8 text: no lone surrogate, which strict readers refuse."""
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, list):
        for item in value:
            _utf8_only(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _utf8_only(key)
            _utf8_only(item)


def test_json_gives_a_file_name_that_is_no_utf8_escaped_with_its_bytes(tmp_path: Path) -> None:
    """``b'\\xff.pt'`` is ``"\\\\xff.pt"`` (every JSON reader takes it) with ``file_bytes``, its bytes in base64; a
    name that is UTF-8 text has no such field."""
    root = tmp_path / "run"
    root.mkdir()
    r = models.run(optimizer="adamw", steps=2)
    name = os.fsdecode(b"\xff\xfe.pt")
    torch.save({"optimizer": get_optimizer_state_dict(r.model, r.optimizer)}, root / name)
    out = tmp_path / os.fsdecode(b"fixed-\xff")
    for args, code in ((("inspect", root), 1), (("fix", root, "--out", out, "--no-sync"), 0)):
        document = json.loads(_run(*args, "--json", code=code).stdout)
        _utf8_only(document)
        [optimizer] = document["optimizers"]
        assert optimizer["file"] == "\\xff\\xfe.pt"
        assert base64.b64decode(optimizer["file_bytes"]) == b"\xff\xfe.pt"
        assert "path_bytes" not in document
    assert base64.b64decode(document["out_bytes"]) == os.fsencode(out)
    assert [added["file"] for added in document["added"]] == ["\\xff\\xfe.pt"] * len(document["added"])
    gone = tmp_path / os.fsdecode(b"gone-\x80")
    error = json.loads(_run("inspect", gone, "--json", code=4).stdout)["error"]
    _utf8_only(error)
    assert base64.b64decode(error["path_bytes"]) == os.fsencode(gone)


def test_a_model_path_with_a_newline_is_shown_escaped(tmp_path: Path) -> None:
    path = _hostile_checkpoint(tmp_path / "checkpoint-2")
    weights = torch.load(path / CHECKPOINT, weights_only=True)["model"]
    model = tmp_path / "model\n  healthy FORGED\u202e.safetensors"
    trainers.save_safetensors(weights, model)
    found = _run("inspect", path, "--model", model, "--color", "never", code=1)
    _assert_shown_escaped(found.stdout)
    assert f"6 in the model ({str(model)!r})" in found.stdout
    gone = tmp_path / "gone\x1b[2J\n.safetensors"
    absent = _run("inspect", path, "--model", gone, code=4)
    _assert_shown_escaped(absent.stderr)
    assert absent.stderr.startswith(f"optim-repair: error: {str(gone)!r}: ")


def _rename_shard(directory: Path, name: str) -> None:
    """Point every storage entry of the DCP checkpoint's metadata at the shard file ``name`` (absent)."""
    metadata = directory / ".metadata"
    with metadata.open("rb") as stream:
        meta: Any = pickle.load(stream)  # the test's own checkpoint, written by torch just before
    for info in meta.storage_data.values():
        info.relative_path = name
    with metadata.open("wb") as stream:
        pickle.dump(meta, stream)


def test_a_damaged_inner_file_name_is_shown_escaped(tmp_path: Path) -> None:
    built = dcp.unirl_dcp(tmp_path)
    _rename_shard(built.path, "__0_0\x1b]0;x\x07\n  healthy.distcp")
    failed = _run("inspect", built.path, code=4)
    _assert_shown_escaped(failed.stderr)
    assert "__0_0\\x1b]0;x\\x07\\n  healthy.distcp" in failed.stderr
    assert failed.stderr.count("\n") == 1


@pytest.mark.parametrize("argument", ["--bogus\x1b]0;x\x07", "--color=\x1b[2J\u202e"])
def test_usage_errors_show_the_argument_escaped(tmp_path: Path, argument: str) -> None:
    failed = _run("inspect", tmp_path, argument, code=2)
    _assert_shown_escaped(failed.stderr)
    assert "\\x1b" in failed.stderr
