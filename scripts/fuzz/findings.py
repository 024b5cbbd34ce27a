"""Findings: a case's outcome classified, reproducers saved, the summary tabled."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.cases import Case
from fuzz.corpus import Outside
from fuzz.supervisor import Raw
from fuzz.trees import Link, Node, Tree, materialize, under
from fuzz.worker import EXIT_CODES

OUTCOMES = ("ok", *(f"error-{code}" for code in EXIT_CODES), "finding")


@dataclass(frozen=True)
class Finding:
    kind: str
    phase: str
    detail: str
    where: str = ""
    traceback: str = ""

    @property
    def signature(self) -> str:
        return f"{self.kind} | {self.phase} | {self.where}"


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _where_from_log(log: str, package_dir: str) -> str:
    """The innermost optim_repair frame (and the innermost frame) of a faulthandler dump."""
    frames = _FRAME.findall(log)
    if not frames:
        return ""
    first = f"{os.path.basename(frames[0][0])}:{frames[0][2]}"
    ours = next((f for f in frames if f[0].startswith(package_dir)), None)
    if ours is None:
        return first
    return f"{os.path.relpath(ours[0], os.path.dirname(package_dir))}:{ours[2]} > {first}"


def _call_findings(phase: str, record: Mapping[str, Any] | None) -> list[Finding]:
    if not record or record["status"] == "ok":
        return []
    where = record["where"] + (f" > {record['innermost']}" if record.get("innermost") else "")
    tb = record.get("traceback", "")
    detail = f"{record['type']}: {record['message']}"[:500]
    if record["status"] == "exception":
        return [Finding(f"exception-{record['type']}", phase, detail, where, tb)]
    found = []
    if "\n" in record["message"]:
        found.append(Finding("multi-line-message", phase, detail, where, tb))
    if record["exit_code"] not in EXIT_CODES:
        found.append(Finding("bad-exit-code", phase, detail, where, tb))
    for cause in record["causes"][1:]:
        if cause in ("MemoryError", "RecursionError"):
            found.append(Finding(f"swallowed-{cause}", phase, detail, where, tb))
        if cause.endswith(f"[errno {errno.EFBIG}]"):
            found.append(Finding("runaway-write", phase, detail, where, tb))
    return found


def classify(case: Case, raw: Raw, changed: list[str], out_left: list[str], rss_mib: int, package_dir: str,
             workdir: str) -> list[Finding]:  # fmt: skip
    """Every finding of a case, from the worker's response (or death) and the supervisor's checks."""
    found: list[Finding] = []
    if raw.response is None:
        found.append(Finding(raw.death or "death", "worker", raw.death or "", _where_from_log(raw.log, package_dir),
                             raw.log))  # fmt: skip
    else:
        response = raw.response
        for phase in ("inspect", "render", "fix", "reinspect", "diff", "rediff"):
            found += _call_findings(phase, response.get(phase))
        found += [Finding("diff-disagrees", "diff", unlike[:1000]) for unlike in response.get("unlike", ())]
        inspected, again = response["inspect"], response.get("reinspect")
        if again and again["status"] == "error" and inspected["status"] == "ok":
            found.append(Finding("fixed-copy-rejected", "reinspect", again["message"][:500], again["where"]))
        for event in response["events"]:
            path = event["path"]
            shown = "<work>" + path[len(workdir) :] if under(path, workdir) else path
            found.append(Finding(event["kind"], event["event"], path, f"{event['where']} [{shown}]"))
        for kind, detail in response.get("torch", ()):
            found.append(Finding(kind, "fix", detail))
        if response.get("summary"):
            found.append(Finding("summary-disagrees", "inspect", response["summary"][:1000]))
        if response["leaked_fds"]:
            found.append(Finding("fd-leak", "inspect/fix", ", ".join(response["leaked_fds"])))
        if response["hwm_mib"] > rss_mib:
            found.append(Finding("memory-peak", "inspect/fix", f"{response['hwm_mib']:.0f} MiB"))
    if changed:
        found.append(Finding("input-changed", "fix" if case.fix else "inspect", "; ".join(changed)[:1000]))
    if out_left:
        found.append(Finding("output-left", "fix" if case.fix else "inspect", ", ".join(out_left)[:1000]))
    return found


def output_left(case: Case, raw: Raw, out_dir: Path, out_name: str) -> list[str]:
    """What is in the output directory that should not be: anything after a failure, extras after success."""
    if raw.response is None:
        return []  # a killed worker cannot clean up
    names = sorted(os.listdir(out_dir))
    fixed = raw.response.get("fix")
    if fixed is not None and fixed["status"] == "ok":
        return [name for name in names if name != out_name]
    return names


@dataclass
class Group:
    """One distinct finding: its signature, how often, in which cases, and where reproducers were saved."""

    kind: str
    signature: str
    detail: str
    count: int = 0
    cases: list[int] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)


@dataclass
class Summary:
    """What a run found; ``findings`` is the number of cases with at least one."""

    seed: int
    cases: int = 0
    seconds: float = 0.0
    by_kind: Counter[tuple[str, str]] = field(default_factory=Counter)
    by_mutator: Counter[tuple[str, str]] = field(default_factory=Counter)
    fix: Counter[str] = field(default_factory=Counter)
    groups: dict[str, Group] = field(default_factory=dict)
    findings: int = 0
    worker_starts: int = 0
    fuzzer_errors: int = 0
    """Cases in which a mutator of this fuzzer failed (another one was used instead)."""
    setup_seconds: float = 0.0
    """Building or loading the seeds and starting the worker, before the first case."""
    slowest: list[tuple[float, int, str]] = field(default_factory=list)
    interrupted: bool = False

    @property
    def rate(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0


def _label(record: Mapping[str, Any] | None) -> str:
    if record is None:
        return "none"
    return "ok" if record["status"] == "ok" else f"error-{record['exit_code']}" if "exit_code" in record else "finding"


def _slug(finding: Finding) -> str:
    digest = hashlib.sha1(finding.signature.encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{finding.kind}-{finding.phase}")[:60] + f"-{digest}"


def _relink(tree: Mapping[str, Node], outside: Outside, saved_outside: Path) -> Tree:
    """The tree with links into the (temporary) outside directory pointing at its saved copy instead."""
    moved: Tree = {}
    for rel, node in tree.items():
        if isinstance(node, Link) and under(node.target, str(outside.root)):
            node = Link(str(saved_outside) + node.target[len(str(outside.root)) :])
        moved[rel] = node
    return moved


def save_reproducer(out: Path, finding: Finding, case: Case, raw: Raw, seed: int, corpus: Path,
                    outside: Outside) -> Path:  # fmt: skip
    """``<out>/<finding>/case-<index>/``: the mutated input under ``input/`` and a ``case.json``."""
    saved_outside = out / "_outside"
    if not saved_outside.exists():
        shutil.copytree(outside.root, saved_outside, symlinks=True)
    directory = out / _slug(finding) / f"case-{case.index}"
    if directory.exists():
        shutil.rmtree(directory)
    materialize(_relink(case.tree, outside, saved_outside), directory / "input")
    path = directory / "input" / case.seed.arg
    call = f"optim_repair.inspect({str(path)!r})"
    if case.fix:
        call += (
            f"; optim_repair.fix({str(path)!r}, OUT, fill={case.fill!r}, link={case.link}, "
            f"dereference={case.dereference}, operations=optim_repair.model_changes(**{case.operations!r}))"
        )
    document = {
        "seed": seed,
        "case": case.index,
        "corpus_seed": case.seed.name,
        "kind": case.seed.kind,
        "mutator": case.mutator,
        "notes": case.notes,
        "fix": {"fill": case.fill, "link": case.link, "dereference": case.dereference, "operations": case.operations}
        if case.fix
        else None,
        "finding": dataclasses.asdict(finding),
        "signature": finding.signature,
        "death": raw.death,
        "response": raw.response,
        "worker_log": raw.log,
        "seconds": raw.seconds,
        "call": call,
        "replay": f"{sys.executable} {Path(__file__).resolve().parent} --seed {seed} --only {case.index} "
        f"--corpus {corpus} --fix-every {1 if case.fix else 0}",
    }
    (directory / "case.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    return directory


def tally(summary: Summary, case: Case, raw: Raw, findings: Sequence[Finding]) -> None:
    summary.cases += 1
    summary.findings += bool(findings)
    summary.fuzzer_errors += any(note.startswith("fuzzer error") for note in case.notes)
    outcome = "finding" if findings else _label(raw.response["inspect"] if raw.response else None)
    summary.by_kind[case.seed.kind, outcome] += 1
    summary.by_mutator[case.mutator, outcome] += 1
    if case.fix:
        summary.fix[raw.death or _label(raw.response.get("fix") if raw.response else None)] += 1
    summary.slowest = sorted([*summary.slowest, (raw.seconds, case.index, case.mutator)])[-3:]


def _table(title: str, counts: Counter[tuple[str, str]]) -> str:
    rows = sorted({row for row, _ in counts})
    width = max([len(title), *(len(row) for row in rows)])
    lines = [f"{title:<{width}} | {'cases':>6} | " + " | ".join(f"{o:>7}" for o in OUTCOMES)]
    lines.append("-" * len(lines[0]))
    for row in rows:
        total = sum(counts[row, o] for o in OUTCOMES)
        lines.append(f"{row:<{width}} | {total:>6} | " + " | ".join(f"{counts[row, o]:>7}" for o in OUTCOMES))
    return "\n".join(lines)


def format_summary(summary: Summary, out: Path) -> str:
    parts = [
        _table("kind", summary.by_kind),
        "",
        _table("mutator", summary.by_mutator),
        "",
        "fix: " + (", ".join(f"{label} {count}" for label, count in sorted(summary.fix.items())) or "not run"),
        "",
    ]
    if summary.groups:
        parts.append(f"{len(summary.groups)} distinct findings in {summary.findings} cases (reproducers under {out}):")
        for group in sorted(summary.groups.values(), key=lambda g: -g.count):
            example = group.saved[0] if group.saved else f"case {group.cases[0]}"
            parts.append(f"  {group.count:>5}x {group.signature}\n         {group.detail[:160]}\n         {example}")
    else:
        parts.append("no findings")
    slow = ", ".join(f"case {index} ({seconds:.2f}s, {m})" for seconds, index, m in sorted(summary.slowest)[::-1][:3])
    parts += [
        "",
        f"slowest: {slow}",
        f"{summary.cases} cases in {summary.seconds:.1f}s: {summary.rate:.1f} cases/s "
        f"(+{summary.setup_seconds:.1f}s setup); worker started {summary.worker_starts}x; "
        f"fuzzer errors {summary.fuzzer_errors}" + ("; interrupted" if summary.interrupted else ""),
    ]
    return "\n".join(parts)


def write_index(out: Path, summary: Summary) -> None:
    groups = [dataclasses.asdict(g) for g in sorted(summary.groups.values(), key=lambda g: -g.count)]
    document = {"seed": summary.seed, "cases": summary.cases, "findings": summary.findings, "groups": groups}
    (out / "findings.json").write_text(json.dumps(document, indent=2) + "\n")
