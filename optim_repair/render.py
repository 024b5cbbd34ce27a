"""Everything the user sees: rich reports on stdout, one JSON document for scripts, messages on stderr.

The only module that imports rich. JSON never passes through rich: it is ``json.dumps`` of a
``TypedDict`` with a ``schema_version``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import IO, TextIO, TypedDict, cast

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, TaskID, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

from optim_repair.api import FixResult
from optim_repair.demo import DemoReport
from optim_repair.diagnose import Diagnosis, OptimizerDiagnosis
from optim_repair.inventory import ParamKey
from optim_repair.progress import Progress, Step, ignore

SCHEMA_VERSION = 1
_SHOWN = 8


class MalformedDoc(TypedDict):
    param: ParamKey | None
    code: str
    detail: str


class NoticeDoc(TypedDict):
    code: str
    detail: str


class OptimizerDoc(TypedDict):
    file: str
    location: str
    key_style: str
    groups: int
    params: int
    states: int
    missing: list[ParamKey]
    empty: list[ParamKey]
    malformed: list[MalformedDoc]
    warnings: list[NoticeDoc]
    cold: bool


class SkippedDoc(TypedDict):
    file: str
    reason: str


class InspectDoc(TypedDict):
    schema_version: int
    path: str
    format: str
    verdict: str
    optimizers: list[OptimizerDoc]
    warnings: list[NoticeDoc]
    skipped: list[SkippedDoc]


class AddedDoc(TypedDict):
    file: str
    location: str
    param: ParamKey
    keys: list[str]


class VerificationDoc(TypedDict):
    tensors: int
    bytes: int
    equal: bool
    linked: list[str]


class FixDoc(InspectDoc):
    out: str
    fill: str
    added: list[AddedDoc]
    verification: VerificationDoc


def _optimizer_doc(opt: OptimizerDiagnosis) -> OptimizerDoc:
    return {
        "file": opt.file,
        "location": opt.location,
        "key_style": opt.key_style,
        "groups": opt.groups,
        "params": opt.params,
        "states": opt.states,
        "missing": list(opt.missing),
        "empty": list(opt.empty),
        "malformed": [{"param": m.param, "code": m.code, "detail": m.detail} for m in opt.malformed],
        "warnings": [{"code": w.code, "detail": w.detail} for w in opt.warnings],
        "cold": opt.cold,
    }


def inspect_document(diagnosis: Diagnosis) -> InspectDoc:
    inventory = diagnosis.inventory
    return {
        "schema_version": SCHEMA_VERSION,
        "path": inventory.path,
        "format": inventory.format,
        "verdict": diagnosis.verdict,
        "optimizers": [_optimizer_doc(opt) for opt in diagnosis.optimizers],
        "warnings": [{"code": w.code, "detail": w.detail} for w in diagnosis.warnings],
        "skipped": [{"file": s.file, "reason": s.reason} for s in inventory.skipped],
    }


def fix_document(result: FixResult) -> FixDoc:
    base = inspect_document(result.diagnosis)
    return {
        **base,
        "out": str(result.out),
        "fill": result.plan.fill,
        "added": [
            {"file": a.file, "location": a.location, "param": a.param, "keys": [key for key, _ in a.state]}
            for a in result.plan.additions
        ],
        "verification": {
            "tensors": result.verification.tensors,
            "bytes": result.verification.bytes,
            "equal": True,
            "linked": list(result.verification.linked),
        },
    }


def print_json(document: InspectDoc | FixDoc) -> None:
    # ASCII with escapes (a name may hold a lone surrogate), and never NaN, which JSON does not have.
    sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")


class _Escaping:
    """A text stream that writes what its encoding cannot hold (a lone surrogate in a parameter name,
    an undecodable file name) as backslash escapes instead of failing."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.encoding = getattr(stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        return self._stream.write(text.encode(self.encoding, "backslashreplace").decode(self.encoding))

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()


def _stdout() -> Console:
    # Piped reports are not cut at rich's default 80 columns, so that names stay greppable.
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    stream = cast("IO[str]", _Escaping(sys.stdout))
    return Console(file=stream, highlight=False, soft_wrap=True, width=200 if piped else None)


def _stderr() -> Console:
    return Console(file=cast("IO[str]", _Escaping(sys.stderr)), highlight=False, soft_wrap=True)


def _shown_names(params: tuple[ParamKey, ...]) -> str:
    shown = ", ".join(str(p) for p in params[:_SHOWN])
    return shown + (f", … (+{len(params) - _SHOWN} more)" if len(params) > _SHOWN else "")


def _optimizer_label(opt: OptimizerDiagnosis) -> str:
    location = opt.location or "<root>"
    return f"{opt.file}:{location}" if opt.file else location


_VERDICT_STYLE = {"healthy": "bold green", "repairable": "bold yellow", "malformed": "bold red"}


def _optimizer_table(diagnosis: Diagnosis) -> Table:
    table = Table(show_lines=False, pad_edge=False)
    for column in ("optimizer", "keys", "groups", "params", "states", "missing", "empty", "malformed"):
        table.add_column(
            column, justify="right" if column in ("groups", "params", "states") else "left", overflow="fold"
        )
    for opt in diagnosis.optimizers:
        table.add_row(
            Text(_optimizer_label(opt)),
            opt.key_style,
            str(opt.groups),
            str(opt.params),
            str(opt.states),
            Text(str(len(opt.missing)), style="yellow" if opt.missing else ""),
            str(len(opt.empty)),
            Text(str(len(opt.malformed)), style="red" if opt.malformed else ""),
        )
    return table


def _print_details(console: Console, diagnosis: Diagnosis) -> None:
    for opt in diagnosis.optimizers:
        where = _optimizer_label(opt)
        if opt.missing:
            console.print(Text.assemble("  ", ("missing", "yellow"), f" in {where}: {_shown_names(opt.missing)}"))
        for finding in opt.malformed:
            detail = f" in {where}: {finding.param!r}: {finding.detail}"
            console.print(Text.assemble("  ", (finding.code, "red"), detail))
        for notice in opt.warnings:
            console.print(Text.assemble("  ", (notice.code, "cyan"), f" in {where}: {notice.detail}"))
    for notice in diagnosis.warnings:
        console.print(Text.assemble("  ", (notice.code, "cyan"), f": {notice.detail}"))
    for skipped in diagnosis.inventory.skipped:
        console.print(Text(f"  skipped {skipped.file}: {skipped.reason}", style="dim"))


def print_inspect(diagnosis: Diagnosis) -> None:
    console = _stdout()
    verdict = diagnosis.verdict
    console.print(
        Text.assemble(
            (diagnosis.inventory.path, "bold"), f" ({diagnosis.inventory.format}): ", (verdict, _VERDICT_STYLE[verdict])
        )
    )
    console.print(_optimizer_table(diagnosis))
    _print_details(console, diagnosis)


def _human_bytes(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    size = count / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def print_fix(result: FixResult) -> None:
    console = _stdout()
    console.print(
        Text.assemble(
            (result.diagnosis.inventory.path, "bold"), " → ", (str(result.out), "bold"), f" (fill: {result.plan.fill})"
        )
    )
    table = Table(pad_edge=False)
    table.add_column("optimizer", overflow="fold")
    table.add_column("added", justify="right")
    table.add_column("entries", overflow="fold")
    kinds = {(file, location): kind for file, location, kind in result.plan.optimizers}
    for opt in result.diagnosis.optimizers:
        inv = opt.optimizer
        added = [a for a in result.plan.additions if (a.file, a.address) == (inv.file, inv.address)]
        keys = sorted({key for a in added for key, _ in a.state})
        what = "{}" if not keys else ", ".join(keys)
        kind = kinds.get((inv.file, inv.location))
        label = _optimizer_label(opt) + (f" ({kind})" if kind else "")
        entries = f"{what} for {_shown_names(tuple(a.param for a in added))}" if added else "—"
        table.add_row(Text(label), str(len(added)), Text(entries))
    console.print(table)
    v = result.verification
    console.print(
        f"[bold green]verified[/]: {v.tensors} existing tensors and {_human_bytes(v.bytes)} "
        f"read back through the file system, bit-identical; the only changes are the "
        f"{len(result.plan.additions)} added entries"
    )
    if v.linked:
        console.print(Text(f"hard-linked to the original's, not copied: {_shown_names(v.linked)}"))


def print_demo(report: DemoReport, *, kept: bool) -> None:
    console = _stdout()
    console.rule("1. A real run saved a checkpoint; torch refuses to resume from it")
    console.print(Text(str(report.checkpoint / "checkpoint.pt")))
    console.print(Text.assemble("stock set_optimizer_state_dict: ", (report.stock_error, "red")))
    console.rule("2. optim-repair inspect")
    print_inspect(report.diagnosis)
    console.rule("3. optim-repair fix, both fills")
    for fix in report.fixes:
        print_fix(fix)
    console.rule("4. Resume from each copy and train on with every head in use")
    table = Table(pad_edge=False)
    for column in ("fill", "loader", "loads", "continues bit-identically", "max |Δ| vs uninterrupted run"):
        table.add_column(column, overflow="fold")
    for outcome in report.outcomes:
        same = "[green]yes[/]" if outcome.identical else "[red]no[/]: phantom step=1 from torch's loader"
        loads = "yes" if outcome.loaded else "no"
        table.add_row(outcome.fill, outcome.loader, loads, same, f"{outcome.max_difference:.3g}")
    console.print(table)
    console.print(
        "{} entries resume exactly through optim_repair.set_optimizer_state_dict (a drop-in for torch's); "
        "--fill fresh resumes exactly through torch's own loader, with no code change."
    )
    if kept:
        console.print(Text(f"files kept in {report.checkpoint.parent}"))


SHOW_PROGRESS_FROM = 256 << 20
"""Copies smaller than this are over too soon for a progress bar to help."""


@contextlib.contextmanager
def progress_bar(*, show: bool) -> Iterator[Progress]:
    """A progress callback drawing a bar on stderr for writing and verifying (bytes, rate, time left),
    when ``show``, stderr is a terminal and the copy is long enough to matter; else one that draws nothing."""
    if not (show and sys.stderr.isatty()):
        yield ignore
        return
    bars: list[RichProgress] = []
    tasks: dict[str, TaskID] = {}

    def draw(step: Step) -> None:
        if not bars:
            if step.total < SHOW_PROGRESS_FROM:
                return
            bar = RichProgress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                TransferSpeedColumn(), TimeRemainingColumn(), console=_stderr(), transient=True,
            )  # fmt: skip
            bar.start()
            bars.append(bar)
            for stage in ("write", "verify"):
                tasks[stage] = bar.add_task(f"{stage:<6}", total=step.total)
        bars[0].update(tasks[step.stage], completed=step.done)

    try:
        yield draw
    finally:
        for bar in bars:
            bar.stop()


def print_error(message: str) -> None:
    _stderr().print(Text(f"optim-repair: error: {message}", style="bold red"))


def print_message(message: str) -> None:
    _stderr().print(Text(message, style="dim"))
