"""``optim-repair diff`` as a user runs it: exit 0 for the same state and 1 for a difference, one JSON document,
an 80-column report that names who is not training, and one-line errors."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
from pathlib import Path

import torch

from tests.checkpoint.test_diffing import _run, _saved_state
from tests.conftest import run_cli
from tests.factories.support import installed_command
from tests.factories.terminal import run_in_terminal


def test_the_same_state_is_exit_0_and_a_difference_exit_1(tmp_path: Path) -> None:
    first, second = _run(tmp_path, (5, 6))
    copy = tmp_path / "copy.pt"
    shutil.copyfile(first, copy)
    same = run_cli(["diff", first, copy], code=0)
    assert "same; " in same.stdout and not same.stderr
    run_cli(["diff", first, second], code=1)


def test_json_is_one_document_with_every_step_and_every_difference(tmp_path: Path) -> None:
    first, second = _run(tmp_path, (5, 6))
    document = json.loads(run_cli(["diff", first, second, "--json"], code=1).stdout)
    assert document["schema_version"] == 2 and document["same"] is False and document["metadata_only"] is False
    (optimizer,) = document["optimizers"]
    assert optimizer["steps"] == {"advanced": 2, "same": 4, "went_back": 0, "unknown": 0}
    moved = {change["param"]: (change["a"], change["b"], change["movement"]) for change in optimizer["step_changes"]}
    assert moved["body.weight"] == (5.0, 6.0, "advanced") and moved["head.bias"] == (0, 0, "same")
    assert len(document["differences"]) == 8 and document["leaves"]["bytes_compared"] > 0
    assert all(leaf["what"] == "bytes" and leaf["elements"] >= 1 for leaf in document["differences"])


def test_on_an_80_column_terminal_the_report_names_who_is_not_training(tmp_path: Path) -> None:
    first, second = _run(tmp_path, (5, 6))
    code, lines = run_in_terminal(["diff", str(first), str(second), "--color", "never"])
    assert code == 1
    assert all(len(line) <= 80 for line in lines), lines
    at = lines.index("optimizer optimizer: step 2 advanced, 4 stood still")
    assert lines[at + 1].startswith("  not training: ") and lines[at + 2].startswith("  ")
    said = " ".join(" ".join(lines[at + 1 : at + 3]).split())
    assert (
        said == "not training: head.weight (step 0), head.bias (step 0), expert.weight (step 2), expert.bias (step 2)"
    )
    assert lines[-1].startswith("differ: 8 leaves; 36 in both, 28 identical; ") and len(lines) <= 24  # one screen


def test_metadata_only_reads_no_tensor_bytes_but_steps(tmp_path: Path) -> None:
    first, second = _run(tmp_path, (5, 6))
    document = json.loads(run_cli(["diff", first, second, "--json", "--metadata-only"], code=1).stdout)
    assert document["metadata_only"] is True
    assert {leaf["name"] for leaf in document["differences"]} == {
        "optimizer.state.body.weight.step", "optimizer.state.body.bias.step"
    }  # fmt: skip
    assert document["leaves"]["bytes_compared"] == 4 * 4  # one float32 step a parameter with state


def test_a_missing_side_is_one_line_and_exit_4(tmp_path: Path) -> None:
    (first,) = _run(tmp_path, (2,))
    result = run_cli(["diff", first, tmp_path / "nowhere.pt"], code=4)
    assert result.stderr.count("\n") == 1 and "nowhere.pt" in result.stderr
    document = json.loads(run_cli(["diff", first, tmp_path / "nowhere.pt", "--json"], code=4).stdout)
    assert document["error"]["exit_code"] == 4


def test_an_expanded_tensor_is_exit_1_where_its_one_element_differs(tmp_path: Path) -> None:
    count = 10**8
    a = _saved_state(tmp_path / "a.pt", exp_avg=torch.zeros(1).expand(count))
    b = _saved_state(tmp_path / "b.pt", exp_avg=torch.ones(1).expand(count))
    document = json.loads(run_cli(["diff", a, b, "--json"], code=1).stdout)
    (leaf,) = document["differences"]
    assert (leaf["what"], leaf["elements"], leaf["numel"], leaf["largest_abs_diff"]) == ("bytes", count, count, 1.0)


def test_a_tensor_expanded_along_another_dimension_on_each_side_is_exit_2_naming_metadata_only(
    tmp_path: Path,
) -> None:
    """Pairing the elements of ``zeros(1, n).expand(n, n)`` with those of ``zeros(n, 1).expand(n, n)`` would
    read n * n elements where each side stores n: refused in one line, the way to compare the rest said."""
    side = 10**4
    a = _saved_state(tmp_path / "a.pt", exp_avg=torch.zeros(1, side).expand(side, side))
    b = _saved_state(tmp_path / "b.pt", exp_avg=torch.zeros(side, 1).expand(side, side))
    result = run_cli(["diff", a, b], code=2)
    assert result.stderr.count("\n") == 1 and "--metadata-only" in result.stderr, result.stderr
    document = json.loads(run_cli(["diff", a, b, "--json", "--metadata-only"], code=1).stdout)
    assert [(leaf["name"], leaf["what"]) for leaf in document["differences"]] == [
        ("optimizer.state.0.exp_avg", "stride")
    ]


def test_an_expanded_tensor_against_a_whole_one_is_read_once_under_a_gib(tmp_path: Path) -> None:
    """The expanded side's one element is read once and repeated in memory, a block at a time, as the whole side
    is read (one read and one object an element took 19 s and passed 1 GiB at ten million elements)."""
    count = 10**7
    expanded, whole = torch.full((1,), 0.5).expand(count), torch.arange(count, dtype=torch.float32) / 4
    a = _saved_state(tmp_path / "a.pt", exp_avg=expanded)
    b = _saved_state(tmp_path / "b.pt", exp_avg=whole)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    result = subprocess.run(
        [*installed_command(), "diff", str(a), str(b), "--json"], capture_output=True, text=True, preexec_fn=limited
    )
    assert result.returncode == 1, result.stderr[-2000:]
    (stride, leaf) = json.loads(result.stdout)["differences"]
    assert (stride["what"], stride["a"], stride["b"]) == ("stride", "[0]", "[1]")
    assert (leaf["what"], leaf["elements"], leaf["numel"]) == ("bytes", int(expanded.ne(whole).sum()), count)
    assert leaf["largest_abs_diff"] == float((expanded.double() - whole.double()).abs().max())
