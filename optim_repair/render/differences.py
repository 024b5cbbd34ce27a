"""What ``diff`` shows: on a terminal short, in JSON whole.

The terminal gets what ``git diff --stat`` gives: a line an optimizer and a leaf, and a line of totals.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TypedDict

from optim_repair.records.difference import (
    Difference,
    FileChange,
    How,
    LeafDifference,
    Movement,
    OptimizerDifference,
    StepChange,
)
from optim_repair.render.schema import SCHEMA_VERSION, VersionsDoc, versions_doc
from optim_repair.render.terminal import SHOWN, Screen, Shown, escaped, human_bytes, listed, print_line

MOVEMENTS: tuple[tuple[Movement, str], ...] = (
    ("advanced", "advanced"),
    ("same", "stood still"),
    ("went back", "went back"),
    ("unknown", "not read"),
)


class StepDoc(TypedDict):
    param: str
    a: float | int | None
    b: float | int | None
    movement: str


class OptionChangeDoc(TypedDict):
    group: int
    key: str
    a: str | None
    b: str | None


class KeyDoc(TypedDict):
    param: str
    key: str


class OptimizerDiffDoc(TypedDict):
    location: str
    file_a: str
    file_b: str
    only_in_a: list[str]
    only_in_b: list[str]
    appeared: list[str]
    vanished: list[str]
    keys_appeared: list[KeyDoc]
    keys_vanished: list[KeyDoc]
    steps: dict[str, int]
    step_changes: list[StepDoc]
    options: list[OptionChangeDoc]


class LeafDiffDoc(TypedDict):
    name: str
    what: str
    a: str | None
    b: str | None
    elements: int | None
    numel: int | None
    largest_abs_diff: float | None
    non_finite: bool


class FileDoc(TypedDict):
    file: str
    how: str
    bytes: int


class LeafTallyDoc(TypedDict):
    tensors: int
    values: int
    raw: int
    identical: int
    bytes_compared: int


class DiffDoc(TypedDict):
    schema_version: int
    versions: VersionsDoc
    a: str
    b: str
    same: bool
    metadata_only: bool
    seconds: float
    optimizers: list[OptimizerDiffDoc]
    optimizers_only_in_a: list[str]
    optimizers_only_in_b: list[str]
    leaves: LeafTallyDoc
    differences: list[LeafDiffDoc]
    files: list[FileDoc]


def _step_doc(step: StepChange) -> StepDoc:
    return {"param": step.param, "a": step.a, "b": step.b, "movement": step.movement.replace(" ", "_")}


def _optimizer_doc(opt: OptimizerDifference) -> OptimizerDiffDoc:
    return {
        "location": opt.location,
        "file_a": opt.file_a,
        "file_b": opt.file_b,
        "only_in_a": list(opt.only_in_a),
        "only_in_b": list(opt.only_in_b),
        "appeared": list(opt.appeared),
        "vanished": list(opt.vanished),
        "keys_appeared": [{"param": param, "key": key} for param, key in opt.keys_appeared],
        "keys_vanished": [{"param": param, "key": key} for param, key in opt.keys_vanished],
        "steps": {movement.replace(" ", "_"): len(opt.moved(movement)) for movement, _ in MOVEMENTS},
        "step_changes": [_step_doc(step) for step in opt.steps],
        "options": [{"group": o.group, "key": o.key, "a": o.a, "b": o.b} for o in opt.options],
    }


def _leaf_doc(leaf: LeafDifference) -> LeafDiffDoc:
    largest = leaf.largest if leaf.largest is not None and math.isfinite(leaf.largest) else None
    return {
        "name": leaf.name,
        "what": leaf.what,
        "a": leaf.a,
        "b": leaf.b,
        "elements": leaf.elements,
        "numel": leaf.numel,
        "largest_abs_diff": largest,
        "non_finite": leaf.non_finite,
    }


def diff_document(difference: Difference) -> DiffDoc:
    tally = difference.tally
    return {
        "schema_version": SCHEMA_VERSION,
        "versions": versions_doc(),
        "a": difference.a,
        "b": difference.b,
        "same": difference.same,
        "metadata_only": difference.metadata_only,
        "seconds": round(difference.seconds, 3),
        "optimizers": [_optimizer_doc(opt) for opt in difference.optimizers],
        "optimizers_only_in_a": list(difference.optimizers_only_in_a),
        "optimizers_only_in_b": list(difference.optimizers_only_in_b),
        "leaves": {
            "tensors": tally.tensors,
            "values": tally.values,
            "raw": tally.raw,
            "identical": tally.identical,
            "bytes_compared": tally.bytes_compared,
        },
        "differences": [_leaf_doc(leaf) for leaf in difference.leaves],
        "files": file_docs(difference.files),
    }


def file_docs(files: tuple[FileChange, ...]) -> list[FileDoc]:
    return [{"file": change.file, "how": change.how, "bytes": change.bytes} for change in files]


def _names(names: tuple[str, ...]) -> str:
    return listed([escaped(name) for name in names[:SHOWN]], len(names))


def _step(value: float | int | None) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _optimizer_lines(opt: OptimizerDifference) -> list[str]:
    where = f"{opt.file_b}:{opt.location}" if opt.file_b else opt.location
    moved = [f"{len(opt.moved(m))} {word}" for m, word in MOVEMENTS if opt.moved(m)]
    lines = [f"optimizer {where}: step " + (", ".join(moved) if moved else "held by no parameter")]
    worst = sorted(opt.moved("same") + opt.moved("went back"), key=lambda step: step.b or 0)
    if worst and opt.moved("advanced"):
        lines.append("  not training: " + _names(tuple(f"{step.param} (step {_step(step.b)})" for step in worst)))
    for label, names in (
        ("only in A", opt.only_in_a),
        ("only in B", opt.only_in_b),
        ("state added", opt.appeared),
        ("state gone", opt.vanished),
        ("keys added", tuple(f"{param}.{key}" for param, key in opt.keys_appeared)),
        ("keys gone", tuple(f"{param}.{key}" for param, key in opt.keys_vanished)),
    ):
        if names:
            lines.append(f"  {label}: {_names(names)}")
    lines.extend(f"  group {o.group} {o.key}: {o.a or '(none)'} -> {o.b or '(none)'}" for o in opt.options)
    return lines


def _leaf_line(leaf: LeafDifference) -> str:
    if leaf.what == "bytes" and leaf.elements is not None:
        unit = "elements" if leaf.a and not leaf.a.endswith("bytes") else "bytes"
        largest = f", largest |a-b| {leaf.largest:.3g}" if leaf.largest is not None else ""
        odd = ", NaN or inf on one side" if leaf.non_finite else ""
        return f"{leaf.name}  {leaf.elements:,} of {leaf.numel:,} {unit} differ{largest}{odd}"
    if leaf.what in ("only in A", "only in B"):
        return f"{leaf.name}  {leaf.what} ({leaf.a or leaf.b})"
    return f"{leaf.name}  {leaf.what}: {leaf.a} -> {leaf.b}"


_ORDER: tuple[How, ...] = (
    "rewritten", "added", "differs", "only in A", "only in B", "copied", "downloaded", "hard-linked", "link"
)  # fmt: skip


def file_lines(files: tuple[FileChange, ...], whole: str) -> list[str]:
    """One line a file (``whole`` names a file argument's one file), as ``git diff --stat`` gives them: the files
    a comparison found the same are left out, and past ``SHOWN`` lines, the rest are counted by how they came."""
    shown = sorted((f for f in files if f.how != "same"), key=lambda f: (_ORDER.index(f.how), f.file))
    width = min(max((len(escaped(f.file or whole)) for f in shown[:SHOWN]), default=0), 40)
    lines = [f"{escaped(f.file or whole):<{width}}  {f.how:<11}  {human_bytes(f.bytes):>10}" for f in shown[:SHOWN]]
    rest = shown[SHOWN:]
    if rest:
        count = Counter(f.how for f in rest)
        sizes = human_bytes(sum(f.bytes for f in rest))
        lines.append(f"… {len(rest)} more: " + ", ".join(f"{n} {how}" for how, n in count.items()) + f" ({sizes})")
    return lines


def files_total(files: tuple[FileChange, ...], seconds: float) -> str:
    """The line of totals under the file lines: how many files came how, their bytes, and the time taken."""
    count = Counter(f.how for f in files)
    parts = [f"{count[how]} {how}" for how in (*_ORDER, "same") if count[how]]
    return f"{len(files)} file(s): {', '.join(parts)}; {human_bytes(sum(f.bytes for f in files))} in {seconds:.1f} s"


def print_diff(difference: Difference, screen: Screen) -> None:
    """The comparison, short: each optimizer's story, the first differing leaves, one line of totals."""
    console = screen.stdout()
    print_line(console, Shown(f"A: {difference.a}"), indent=0)
    print_line(console, Shown(f"B: {difference.b}"), indent=0)
    for opt in difference.optimizers:
        for index, line in enumerate(_optimizer_lines(opt)):
            print_line(console, Shown(line.strip()), indent=0 if index == 0 else 2)
    for label, places in (("A", difference.optimizers_only_in_a), ("B", difference.optimizers_only_in_b)):
        if places:
            print_line(console, Shown(f"optimizers only in {label}: {_names(places)}"), indent=0)
    if any(change.file for change in difference.files):  # directories: a line a file that is not the same
        for line in file_lines(difference.files, ""):
            print_line(console, Shown(line), indent=1)
    for leaf in difference.leaves[:SHOWN]:
        print_line(console, Shown(_leaf_line(leaf)), indent=2)
    if len(difference.leaves) > SHOWN:
        print_line(console, Shown(f"… {len(difference.leaves) - SHOWN} more (--json lists them all)"), indent=2)
    tally = difference.tally
    compared = tally.tensors + tally.values + tally.raw
    how = "metadata only" if difference.metadata_only else f"{human_bytes(tally.bytes_compared)} a side read"
    verdict = "same" if difference.same else f"differ: {len(difference.leaves)} leaves"
    totals = f"{verdict}; {compared:,} in both, {tally.identical:,} identical; {how}, {difference.seconds:.1f} s"
    print_line(console, Shown(totals, style="bold green" if difference.same else "bold yellow"), indent=0)
