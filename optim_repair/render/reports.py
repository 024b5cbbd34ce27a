"""The reports people read: rich tables on stdout, messages, progress and errors on stderr.

The only module that imports rich.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal, TextIO, cast

from rich import box
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, TaskID, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

from optim_repair.api import DryRun, FixResult
from optim_repair.decisions.comparison import ModelComparison
from optim_repair.decisions.diagnose import Diagnosis, OptimizerDiagnosis
from optim_repair.decisions.notices import Notice, fsdp1_after_fill
from optim_repair.demo import DemoReport
from optim_repair.progress import Progress, Step, ignore
from optim_repair.records.inventory import ParamKey
from optim_repair.records.repair_plan import RepairPlan

_SHOWN = 8


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


Color = Literal["auto", "always", "never"]


@dataclass(frozen=True)
class Screen:
    """How the report is shown: ``color`` (``auto`` follows the terminal, NO_COLOR and FORCE_COLOR), and
    ``quiet``: results only, no progress and no messages (errors are always shown)."""

    color: Color = "auto"
    quiet: bool = False

    def _console(self, stream: TextIO, width: int | None = None) -> Console:
        file = cast("IO[str]", _Escaping(stream))
        if self.color == "auto":
            return Console(file=file, highlight=False, soft_wrap=True, width=width)
        if self.color == "never":
            return Console(file=file, highlight=False, soft_wrap=True, width=width, no_color=True)
        # always: colour even into a pipe and on a dumb terminal, which rich would otherwise leave plain
        return Console(
            file=file, highlight=False, soft_wrap=True, width=width, force_terminal=True, no_color=False,
            color_system="standard",
        )  # fmt: skip

    def stdout(self) -> Console:
        # Piped reports are not cut at rich's default 80 columns, so that names stay greppable.
        piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        return self._console(sys.stdout, 200 if piped else None)

    def stderr(self) -> Console:
        return self._console(sys.stderr)


def _table(console: Console, **options: Any) -> Table:
    """A table drawn in ASCII where the terminal cannot draw boxes (TERM=dumb, a non-UTF-8 encoding)."""
    plain = os.environ.get("TERM") == "dumb" or not console.encoding.lower().startswith("utf")
    return Table(box=box.ASCII if plain else box.HEAVY_HEAD, pad_edge=False, **options)


def _shown_names(params: tuple[ParamKey, ...]) -> str:
    shown = ", ".join(str(p) for p in params[:_SHOWN])
    return shown + (f", … (+{len(params) - _SHOWN} more)" if len(params) > _SHOWN else "")


def _optimizer_label(opt: OptimizerDiagnosis) -> str:
    location = opt.location or "<root>"
    return f"{opt.file}:{location}" if opt.file else location


_VERDICT_STYLE = {"healthy": "bold green", "repairable": "bold yellow", "malformed": "bold red"}
_NOTICE_STYLE = {"info": "cyan", "warning": "magenta"}


def _notice_code(notice: Notice) -> tuple[str, str]:
    return notice.code, _NOTICE_STYLE[notice.severity]


def _optimizer_table(console: Console, diagnosis: Diagnosis) -> Table:
    table = _table(console)
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
        for notice in opt.notices:
            console.print(Text.assemble("  ", _notice_code(notice), f" in {where}: {notice.detail}"))
        if opt.model is not None:
            _print_model(console, where, opt.model)
    for notice in diagnosis.notices:
        console.print(Text.assemble("  ", _notice_code(notice), f": {notice.detail}"))
    for skipped in diagnosis.inventory.skipped:
        console.print(Text(f"  skipped {skipped.file}: {skipped.reason}", style="dim"))


def _print_model(console: Console, where: str, found: ModelComparison) -> None:
    counts = f"{found.optimizer_params} parameters in the optimizer, {found.model_params} in the model"
    if found.by_index:
        verdict = "fits" if found.matches else "does not fit"
        console.print(Text(f"  model for {where}: {counts}: {verdict} (index keys: compared by counts only)"))
        return
    console.print(Text(f"  model for {where}: {counts} ({', '.join(found.sources)})"))
    if found.not_in_model:
        console.print(Text.assemble("  ", ("not-in-model", "yellow"), f": {_shown_names(found.not_in_model)}"))
    if found.rename is not None:
        console.print(Text(f"  every such name maps onto the model's with: fix --rename '{found.rename}'"))
    for mismatch in found.shape_mismatches:
        shapes = f"{list(mismatch.state_shape)} but the model's parameter has {list(mismatch.model_shape)}"
        detail = f": {mismatch.param} {mismatch.key} is {shapes}"
        console.print(Text.assemble("  ", ("shape-mismatch-model", "red"), detail))
    if found.not_in_optimizer:
        names = _shown_names(found.not_in_optimizer)
        console.print(Text.assemble("  ", ("not-in-optimizer", "cyan"), f" (frozen on purpose, or forgotten): {names}"))


def print_inspect(diagnosis: Diagnosis, screen: Screen) -> None:
    console = screen.stdout()
    verdict = diagnosis.verdict
    console.print(
        Text.assemble(
            (diagnosis.inventory.path, "bold"), f" ({diagnosis.inventory.format}): ", (verdict, _VERDICT_STYLE[verdict])
        )
    )
    console.print(_optimizer_table(console, diagnosis))
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


def _additions_table(console: Console, diagnosis: Diagnosis, plan: RepairPlan) -> Table:
    table = _table(console)
    table.add_column("optimizer", overflow="fold")
    table.add_column("added", justify="right")
    table.add_column("entries", overflow="fold")
    kinds = {(file, location): kind for file, location, kind in plan.optimizers}
    for opt in diagnosis.optimizers:
        inv = opt.optimizer
        mine = [a for a in plan.additions if (a.file, a.address) == (inv.file, inv.address)]
        kind = kinds.get((inv.file, inv.location))
        label = _optimizer_label(opt) + (f" ({kind})" if kind else "")
        parts = []
        for replacing, verb in ((False, ""), (True, "in place of phantom step=1 entries: ")):
            group = [a for a in mine if a.replaces is replacing]
            if group:
                keys = sorted({key for a in group for key in a.keys})
                what = ", ".join(keys) if keys else "{}"
                parts.append(f"{verb}{what} for {_shown_names(tuple(a.param for a in group))}")
        replaced = sum(a.replaces for a in mine)
        count = f"{len(mine)} ({replaced} replaced)" if replaced else str(len(mine))
        table.add_row(Text(label), count, Text("; ".join(parts) or "—"))
    return table


def _changes(plan: RepairPlan) -> str:
    replaced = sum(addition.replaces for addition in plan.additions)
    added = len(plan.additions) - replaced
    parts = [f"{added} added entries"]
    if replaced:
        parts.append(f"the {replaced} replaced phantom-step entries")
    renamed = sum(change.new is not None for change in plan.changes)
    dropped = len(plan.changes) - renamed
    if renamed:
        parts.append(f"{renamed} renamed parameters")
    if dropped:
        parts.append(f"{dropped} dropped parameters")
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def _print_fill_notes(console: Console, diagnosis: Diagnosis, plan: RepairPlan) -> None:
    """What FSDP1's loader, which a name-keyed torch file may be meant for, does with the ``{}`` entries added."""
    for opt in diagnosis.optimizers:
        inv = opt.optimizer
        empty = [a for a in plan.additions if (a.file, a.address) == (inv.file, inv.address) and not a.state]
        if empty and opt.loader == "set_optimizer_state_dict":
            console.print(Text(f"{_optimizer_label(opt)}: {fsdp1_after_fill(len(empty))}"))


def _print_changes(console: Console, plan: RepairPlan) -> None:
    renamed = [c for c in plan.changes if c.new is not None]
    dropped = [c.old for c in plan.changes if c.new is None]
    joined = [a.param for a in plan.additions if a.group is not None]
    if renamed:
        shown = _shown_names(tuple(f"{c.old} → {c.new}" for c in renamed))
        console.print(Text(f"renamed {len(renamed)} parameters: {shown}"))
    if dropped:
        console.print(Text(f"dropped {len(dropped)} parameters: {_shown_names(tuple(dropped))}"))
    if joined:
        console.print(Text(f"added {len(joined)} model parameters to their param group: {_shown_names(tuple(joined))}"))


def print_fix(result: FixResult, screen: Screen) -> None:
    console = screen.stdout()
    console.print(
        Text.assemble(
            (result.diagnosis.inventory.path, "bold"), " → ", (str(result.out), "bold"), f" (fill: {result.plan.fill})"
        )
    )
    _print_changes(console, result.plan)
    console.print(_additions_table(console, result.diagnosis, result.plan))
    _print_fill_notes(console, result.diagnosis, result.plan)
    v = result.verification
    console.print(
        f"[bold green]verified[/]: {v.tensors} existing tensors and {_human_bytes(v.bytes)} "
        f"read back through the file system, bit-identical; the only changes are the {_changes(result.plan)}"
    )
    if v.linked:
        console.print(Text(f"hard-linked to the original's, not copied: {_shown_names(v.linked)}"))


def print_dry_run(planned: DryRun, screen: Screen) -> None:
    console = screen.stdout()
    console.print(
        Text.assemble(
            ("dry run", "bold yellow"), ": ", (planned.diagnosis.inventory.path, "bold"), " → ",
            (str(planned.out), "bold"), f" (fill: {planned.plan.fill}); nothing was written",
        )
    )  # fmt: skip
    _print_changes(console, planned.plan)
    console.print(_additions_table(console, planned.diagnosis, planned.plan))
    _print_fill_notes(console, planned.diagnosis, planned.plan)
    room = "enough room" if planned.bytes_to_write <= planned.free_bytes else "[bold red]not enough room[/]"
    console.print(
        f"would write about {_human_bytes(planned.bytes_to_write)}; {_human_bytes(planned.free_bytes)} free there: "
        f"{room}"
    )


def print_demo(report: DemoReport, screen: Screen, *, kept: bool) -> None:
    console = screen.stdout()
    console.rule("1. A real run saved a checkpoint; torch refuses to resume from it")
    console.print(Text(str(report.checkpoint / "checkpoint.pt")))
    console.print(Text.assemble("stock set_optimizer_state_dict: ", (report.stock_error, "red")))
    console.rule("2. optim-repair inspect")
    print_inspect(report.diagnosis, screen)
    console.rule("3. optim-repair fix, both fills")
    for fix in report.fixes:
        print_fix(fix, screen)
    console.rule("4. Resume from each copy and train on with every head in use")
    table = _table(console)
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
def progress_bar(screen: Screen, *, show: bool) -> Iterator[Progress]:
    """A progress callback drawing a bar on stderr for writing and verifying (bytes, rate, time left),
    when ``show``, not quiet, stderr is a terminal and the copy is long enough to matter; else one that
    draws nothing."""
    if not (show and not screen.quiet and sys.stderr.isatty()):
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
                TransferSpeedColumn(), TimeRemainingColumn(), console=screen.stderr(), transient=True,
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


def print_error(message: str, screen: Screen) -> None:
    screen.stderr().print(Text(f"optim-repair: error: {message}", style="bold red"))


def message_printer(screen: Screen) -> Callable[[str], None]:
    """What prints lines of text for the user on stderr: nothing when quiet."""

    def show(message: str) -> None:
        if not screen.quiet:
            screen.stderr().print(Text(message, style="dim"))

    return show
