"""The reports people read: rich tables on stdout, messages and errors on stderr.

With ``progress_bar``, the only modules that import rich.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, Literal, TextIO, cast

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.style import Style
from rich.table import Table
from rich.text import Text

from optim_repair.api import DryRun, FixResult
from optim_repair.decisions.comparison import ModelComparison
from optim_repair.decisions.diagnose import Diagnosis, OptimizerDiagnosis
from optim_repair.decisions.notices import Notice, fsdp1_after_fill
from optim_repair.demo import DemoReport
from optim_repair.errors import shown_name
from optim_repair.records.inventory import ParamKey
from optim_repair.records.repair_plan import RepairPlan
from optim_repair.records.traffic import Traffic
from optim_repair.render.documents import proof

_SHOWN = 8


def escaped(text: str) -> str:
    r"""``text`` with every character a terminal would act on or hide written as Python's ``repr`` writes it:
    controls (ESC as ``\x1b``, a newline as ``\n``, the C1 CSI as ``\x9b``), bidi overrides and other format
    characters (``\u202e``), line separators and lone surrogates. Accents, CJK and the like stay as they are."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class Shown(Text):
    """A rich ``Text`` that escapes every string it is given (``escaped``): the reports build their text from
    names in the input, which must not retitle or clear the terminal, nor forge a line of the report."""

    def __init__(self, text: str = "", style: str | Style = "", **options: Any) -> None:
        super().__init__(escaped(text), style, **options)

    def append(self, text: Text | str, style: str | Style | None = None) -> Text:
        return super().append(escaped(text) if isinstance(text, str) else text, style)


class _Escaping:
    """A text stream that writes what its encoding cannot hold (an accent or CJK on an ASCII terminal) as
    backslash escapes instead of failing."""

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
        # A terminal gets lines wrapped between words; a pipe gets each line whole, for grep.
        soft = not stream.isatty()
        if self.color == "auto":
            return Console(file=file, highlight=False, soft_wrap=soft, width=width)
        if self.color == "never":
            return Console(file=file, highlight=False, soft_wrap=soft, width=width, no_color=True)
        # always: colour even into a pipe and on a dumb terminal, which rich would otherwise leave plain
        return Console(
            file=file, highlight=False, soft_wrap=soft, width=width, force_terminal=True, no_color=False,
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


def _column_widths(console: Console, table: Table, rows: list[list[str]]) -> list[int] | None:
    """Widths for the columns of ``table`` that keep every word of every cell whole (rich, squeezing a table,
    cuts the widest column first, mid-word), or None when the console is too narrow for that."""
    wide = console.options.update(width=1 << 20)
    shortest, longest = [], []
    for column, cells in zip(table.columns, zip(*rows, strict=True), strict=True):
        measured = [Measurement.get(console, wide, Shown(cell)) for cell in (str(column.header), *cells)]
        shortest.append(max(m.minimum for m in measured))
        longest.append(max(m.maximum for m in measured))
    columns = len(shortest)
    room = console.width - (2 * columns - 2) - (columns + 1)  # the padding inside, and the rules
    if sum(shortest) > room:
        return None
    if sum(longest) <= room:
        return longest
    widths, spare = list(shortest), room - sum(shortest)
    wanting = sorted(range(columns), key=lambda i: longest[i] - shortest[i])
    for place, i in enumerate(wanting):  # the room left, shared: a column that wants little gets all it wants
        given = min(longest[i] - shortest[i], spare // (columns - place))
        widths[i] += given
        spare -= given
    return widths


def _print_table(console: Console, table: Table, rows: list[list[str]]) -> None:
    """``table`` where its words fit whole; else each row as one line of ``header=value`` pairs, wrapped
    between words."""
    widths = _column_widths(console, table, rows) if rows else None
    if not rows or widths is not None:
        for column, width in zip(table.columns, widths or (), strict=False):
            column.width = width
        console.print(table)
        return
    headers = [str(column.header) for column in table.columns]
    for row in rows:
        pairs = " ".join(f"{header}={value}" for header, value in zip(headers[1:], row[1:], strict=True))
        _print_line(console, Shown(f"{row[0]}: {pairs}"), indent=0)


def _print_line(console: Console, text: Text, indent: int = 2) -> None:
    """One line of the report, indented; on a terminal wrapped between words, its later lines under its first."""
    if console.soft_wrap:
        console.print(Shown(" " * indent) + text)
        return
    for line in text.wrap(console, max(console.width - indent, 20)):
        line.rstrip()
        console.print(Shown(" " * indent) + line)


def _name(key: ParamKey) -> str:
    """A name from the input as the reports show it (``shown_name``); an index as it is."""
    return shown_name(key) if isinstance(key, str) else str(key)


def _listed(shown: list[str], count: int) -> str:
    """The first names of ``count``, already shown, and how many more there are."""
    return ", ".join(shown) + (f", … (+{count - _SHOWN} more)" if count > _SHOWN else "")


def _shown_names(params: tuple[ParamKey, ...]) -> str:
    return _listed([_name(p) for p in params[:_SHOWN]], len(params))


def _optimizer_label(opt: OptimizerDiagnosis) -> str:
    location = _name(opt.location) if opt.location else "<root>"
    return f"{_name(opt.file)}:{location}" if opt.file else location


_VERDICT_STYLE = {"healthy": "bold green", "repairable": "bold yellow", "malformed": "bold red"}
_NOTICE_STYLE = {"info": "cyan", "warning": "magenta"}


def _notice_code(notice: Notice) -> tuple[str, str]:
    return notice.code, _NOTICE_STYLE[notice.severity]


def _print_optimizer_table(console: Console, diagnosis: Diagnosis) -> None:
    table = _table(console)
    for column in ("optimizer", "keys", "groups", "params", "states", "missing", "empty", "malformed"):
        table.add_column(column, justify="right" if column in ("groups", "params", "states") else "left")
    rows = []
    for opt in diagnosis.optimizers:
        row = [
            _optimizer_label(opt), opt.key_style, str(opt.groups), str(opt.params), str(opt.states),
            str(len(opt.missing)), str(len(opt.empty)), str(len(opt.malformed)),
        ]  # fmt: skip
        rows.append(row)
        styles = {5: "yellow" if opt.missing else "", 7: "red" if opt.malformed else ""}
        table.add_row(*(Shown(value, style=styles.get(i, "")) for i, value in enumerate(row)))
    _print_table(console, table, rows)


def _print_details(console: Console, diagnosis: Diagnosis) -> None:
    for opt in diagnosis.optimizers:
        where = _optimizer_label(opt)
        if opt.missing:
            _print_line(console, Shown.assemble(("missing", "yellow"), f" in {where}: {_shown_names(opt.missing)}"))
        for finding in opt.malformed:
            detail = f" in {where}: {finding.param!r}: {finding.detail}"
            _print_line(console, Shown.assemble((finding.code, "red"), detail))
        for notice in opt.notices:
            _print_line(console, Shown.assemble(_notice_code(notice), f" in {where}: {notice.detail}"))
        if opt.model is not None:
            _print_model(console, where, opt.model)
    for notice in diagnosis.notices:
        _print_line(console, Shown.assemble(_notice_code(notice), f": {notice.detail}"))
    for skipped in diagnosis.inventory.skipped:
        _print_line(console, Shown(f"skipped {_name(skipped.file)}: {skipped.reason}", style="dim"))


def _print_model(console: Console, where: str, found: ModelComparison) -> None:
    counts = f"{found.optimizer_params} parameters in the optimizer, {found.model_params} in the model"
    if found.by_index:
        verdict = "fits" if found.matches else "does not fit"
        _print_line(console, Shown(f"model for {where}: {counts}: {verdict} (index keys: compared by counts only)"))
        return
    _print_line(console, Shown(f"model for {where}: {counts} ({', '.join(_name(source) for source in found.sources)})"))
    if found.not_in_model:
        _print_line(console, Shown.assemble(("not-in-model", "yellow"), f": {_shown_names(found.not_in_model)}"))
    if found.rename is not None:
        _print_line(console, Shown(f"every such name maps onto the model's with: fix --rename '{found.rename}'"))
    for mismatch in found.shape_mismatches:
        shapes = f"{list(mismatch.state_shape)} but the model's parameter has {list(mismatch.model_shape)}"
        detail = f": {_name(mismatch.param)} {_name(mismatch.key)} is {shapes}"
        _print_line(console, Shown.assemble(("shape-mismatch-model", "red"), detail))
    if found.not_in_optimizer:
        names = f" (frozen on purpose, or forgotten): {_shown_names(found.not_in_optimizer)}"
        _print_line(console, Shown.assemble(("not-in-optimizer", "cyan"), names))


def print_inspect(diagnosis: Diagnosis, screen: Screen) -> None:
    console = screen.stdout()
    verdict = diagnosis.verdict
    path, fmt = _name(diagnosis.inventory.path), diagnosis.inventory.format
    _print_line(console, Shown.assemble((path, "bold"), f" ({fmt}): ", (verdict, _VERDICT_STYLE[verdict])), indent=0)
    _print_optimizer_table(console, diagnosis)
    _print_details(console, diagnosis)
    if diagnosis.inventory.traffic is not None:
        _print_line(console, Shown(_traffic(diagnosis.inventory.traffic)), indent=0)


def _human_bytes(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    size = count / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _print_additions(console: Console, diagnosis: Diagnosis, plan: RepairPlan) -> None:
    table = _table(console)
    table.add_column("optimizer")
    table.add_column("added", justify="right")
    table.add_column("entries")
    rows = []
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
        rows.append([label, count, "; ".join(parts) or "—"])
        table.add_row(*(Shown(value) for value in rows[-1]))
    _print_table(console, table, rows)


def _changes(plan: RepairPlan) -> str:
    replaced = sum(addition.replaces for addition in plan.additions)
    added = len(plan.additions) - replaced
    parts = [f"{added} added entries"]
    if replaced:
        parts.append(f"the {replaced} replaced phantom-step entries")
    renamed = sum(change.new is not None for change in plan.changes)
    counted = [
        (renamed, "renamed parameters"),
        (len(plan.changes) - renamed, "dropped parameters"),
        (len(plan.options), "added param-group options"),
        (len(plan.older_forms), "DCP .metadata files in an older torch's form"),
    ]
    parts += [f"{n} {what}" for n, what in counted if n]
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def _print_fill_notes(console: Console, diagnosis: Diagnosis, plan: RepairPlan) -> None:
    """Why the default fill gave ``{}`` where it did, and what FSDP1's loader does with ``{}`` in name-keyed state."""
    for note in plan.fill_notes:
        _print_line(console, Shown(note), indent=0)
    for opt in diagnosis.optimizers:
        inv = opt.optimizer
        empty = [a for a in plan.additions if (a.file, a.address) == (inv.file, inv.address) and not a.state]
        if empty and opt.loader == "set_optimizer_state_dict":
            _print_line(console, Shown(f"{_optimizer_label(opt)}: {fsdp1_after_fill(len(empty))}"), indent=0)


def _print_changes(console: Console, plan: RepairPlan) -> None:
    renamed = [(c.old, c.new) for c in plan.changes if c.new is not None]
    dropped = [c.old for c in plan.changes if c.new is None]
    joined = [a.param for a in plan.additions if a.group is not None]
    if renamed:
        shown = _listed([f"{_name(old)} → {_name(new)}" for old, new in renamed[:_SHOWN]], len(renamed))
        _print_line(console, Shown(f"renamed {len(renamed)} parameters: {shown}"), indent=0)
    if dropped:
        _print_line(console, Shown(f"dropped {len(dropped)} parameters: {_shown_names(tuple(dropped))}"), indent=0)
    if joined:
        added = f"added {len(joined)} model parameters to their param group: {_shown_names(tuple(joined))}"
        _print_line(console, Shown(added), indent=0)
    for option in plan.options:  # what the loading torch asks for (decoupled_weight_decay, since 2.8)
        where = ".".join(str(part) for part in (*option.address, "param_groups", option.group, option.key))
        _print_line(console, Shown(f"added the param-group option {where} = {option.value!r}"), indent=0)
    for file in plan.older_forms:  # what a torch before 2.15 reads (newer-torch-metadata)
        older = (
            f"{file or '.'}/.metadata written in the form a torch before 2.15 reads (TensorProperties without strides)"
        )
        _print_line(console, Shown(older), indent=0)


def _traffic(traffic: Traffic) -> str:
    return (
        f"object storage: {traffic.requests} requests, {_human_bytes(traffic.read)} read, "
        f"{_human_bytes(traffic.written)} written, {_human_bytes(traffic.copied)} copied inside the store"
    )


def print_fix(result: FixResult, screen: Screen) -> None:
    console = screen.stdout()
    title = Shown.assemble(
        (_name(result.diagnosis.inventory.path), "bold"), " → ", (_name(str(result.out)), "bold"),
        f" (fill: {result.plan.fill})",
    )  # fmt: skip
    _print_line(console, title, indent=0)
    _print_changes(console, result.plan)
    _print_additions(console, result.diagnosis, result.plan)
    _print_fill_notes(console, result.diagnosis, result.plan)
    v = result.verification
    verified = Shown.assemble(
        ("verified", "bold green"),
        f": {v.tensors} existing tensors and {_human_bytes(v.bytes)} {proof(v)}, "
        f"bit-identical; the only changes are the {_changes(result.plan)}",
    )
    _print_line(console, verified, indent=0)
    if result.traffic is not None:
        _print_line(console, Shown(_traffic(result.traffic)), indent=0)
    if v.linked:
        _print_line(console, Shown(f"hard-linked to the original's, not copied: {_shown_names(v.linked)}"), indent=0)


def print_dry_run(planned: DryRun, screen: Screen) -> None:
    console = screen.stdout()
    title = Shown.assemble(
        ("dry run", "bold yellow"), ": ", (_name(planned.diagnosis.inventory.path), "bold"), " → ",
        (_name(str(planned.out)), "bold"), f" (fill: {planned.plan.fill}); nothing was written",
    )  # fmt: skip
    _print_line(console, title, indent=0)
    _print_changes(console, planned.plan)
    _print_additions(console, planned.diagnosis, planned.plan)
    _print_fill_notes(console, planned.diagnosis, planned.plan)
    sizes = f"would write about {_human_bytes(planned.bytes_to_write)}"
    if planned.free_bytes is None:
        _print_line(console, Shown(f"{sizes} into the store"), indent=0)
        return
    room = ("enough room", "") if planned.bytes_to_write <= planned.free_bytes else ("not enough room", "bold red")
    _print_line(console, Shown.assemble(f"{sizes}; {_human_bytes(planned.free_bytes)} free there: ", room), indent=0)


def print_demo(report: DemoReport, screen: Screen, *, kept: bool) -> None:
    console = screen.stdout()
    console.rule("1. A real run saved a checkpoint; torch refuses to resume from it")
    _print_line(console, Shown(_name(str(report.checkpoint / "checkpoint.pt"))), indent=0)
    _print_line(console, Shown.assemble("stock set_optimizer_state_dict: ", (report.stock_error, "red")), indent=0)
    console.rule("2. optim-repair inspect")
    print_inspect(report.diagnosis, screen)
    console.rule("3. optim-repair fix, both fills")
    for fix in report.fixes:
        print_fix(fix, screen)
    console.rule("4. Resume from each copy and train on with every head in use")
    table = _table(console)
    for column in ("fill", "loader", "loads", "continues bit-identically", "max |Δ| vs uninterrupted run"):
        table.add_column(column)
    rows = []
    for outcome in report.outcomes:
        same = "yes" if outcome.identical else "no: phantom step=1 from torch's loader"
        rows.append([outcome.fill, outcome.loader, "yes" if outcome.loaded else "no", same])
        rows[-1].append(f"{outcome.max_difference:.3g}")
        table.add_row(*rows[-1][:3], Shown(same, style="green" if outcome.identical else "red"), rows[-1][4])
    _print_table(console, table, rows)
    closing = (
        "{} entries resume exactly through optim_repair.set_optimizer_state_dict (a drop-in for torch's); "
        "--fill fresh resumes exactly through torch's own loader, with no code change."
    )
    _print_line(console, Shown(closing), indent=0)
    if kept:
        _print_line(console, Shown(f"files kept in {_name(str(report.checkpoint.parent))}"), indent=0)


def print_error(message: str, screen: Screen) -> None:
    _print_line(screen.stderr(), Shown(f"optim-repair: error: {message}", style="bold red"), indent=0)


def message_printer(screen: Screen) -> Callable[[str], None]:
    """What prints lines of text for the user on stderr: nothing when quiet."""

    def show(message: str) -> None:
        if not screen.quiet:
            _print_line(screen.stderr(), Shown(message, style="dim"), indent=0)

    return show
