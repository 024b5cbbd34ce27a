"""The reports people read, as rich tables and lines on stdout (``terminal``):

what inspect found, what fix changed and proved, what a dry run would write, and the demo.

With ``terminal`` and ``progress_bar``, the only modules that import rich.
"""

from __future__ import annotations

from rich.console import Console

from optim_repair.api import DryRun, FixResult
from optim_repair.decisions.comparison import ModelComparison
from optim_repair.decisions.diagnose import Diagnosis, OptimizerDiagnosis
from optim_repair.decisions.difference import index_names
from optim_repair.decisions.notices import Notice, fsdp1_after_fill
from optim_repair.demo import DemoReport
from optim_repair.records.repair_plan import Addition, RepairPlan
from optim_repair.records.traffic import Traffic
from optim_repair.render.differences import file_lines, files_total
from optim_repair.render.documents import proof
from optim_repair.render.terminal import (
    SHOWN,
    Screen,
    Shown,
    human_bytes,
    listed,
    name,
    new_table,
    print_command,
    print_line,
    print_table,
    shown_names,
)


def _optimizer_label(opt: OptimizerDiagnosis) -> str:
    location = name(opt.location) if opt.location else "<root>"
    return f"{name(opt.file)}:{location}" if opt.file else location


_VERDICT_STYLE = {"healthy": "bold green", "repairable": "bold yellow", "malformed": "bold red"}
_NOTICE_STYLE = {"info": "cyan", "warning": "magenta"}


def _notice_code(notice: Notice) -> tuple[str, str]:
    return notice.code, _NOTICE_STYLE[notice.severity]


_FINDINGS = ("missing", "empty", "malformed")
"""The table's columns of findings, each left out where it is zero in every row."""


def _print_optimizer_table(console: Console, diagnosis: Diagnosis) -> None:
    counts = [{"missing": opt.missing, "empty": opt.empty, "malformed": opt.malformed} for opt in diagnosis.optimizers]
    found = [column for column in _FINDINGS if any(count[column] for count in counts)]
    table = new_table(console)
    for column in ("optimizer", "keys", "groups", "params", "states", *found):
        table.add_column(column, justify="right" if column in ("groups", "params", "states") else "left")
    rows = []
    styles = {"missing": "yellow", "malformed": "red"}
    for opt, count in zip(diagnosis.optimizers, counts, strict=True):
        rows.append([_optimizer_label(opt), opt.key_style, str(opt.groups), str(opt.params), str(opt.states)])
        rows[-1] += [str(len(count[column])) for column in found]
        cells = [Shown(value) for value in rows[-1][:5]]
        cells += [Shown(str(len(count[c])), style=styles.get(c, "") if count[c] else "") for c in found]
        table.add_row(*cells)
    print_table(console, table, rows)


def _findings(opt: OptimizerDiagnosis) -> list[tuple[str, str, str]]:
    """The parameters without state and the notices of ``opt``: code, style, detail."""
    missing = [("missing", "yellow", shown_names(opt.missing))] if opt.missing else []
    return missing + [(notice.code, _NOTICE_STYLE[notice.severity], notice.detail) for notice in opt.notices]


def _print_details(console: Console, diagnosis: Diagnosis) -> None:
    """Each optimizer's findings; one that several optimizers share (the steps of a run) said once, naming each."""
    sharing: dict[tuple[str, str], list[str]] = {}
    for opt in diagnosis.optimizers:
        for code, _, detail in _findings(opt):
            sharing.setdefault((code, detail), []).append(_optimizer_label(opt))
    for opt in diagnosis.optimizers:
        where = _optimizer_label(opt)
        for finding in opt.malformed:
            detail = f" in {where}: {finding.param!r}: {finding.detail}"
            print_line(console, Shown.assemble((finding.code, "red"), detail))
        for code, style, detail in _findings(opt):
            places = sharing[(code, detail)]
            if places[0] == where:
                print_line(
                    console, Shown.assemble((code, style), f" in {listed(places[:SHOWN], len(places))}: {detail}")
                )
        if opt.model is not None:
            _print_model(console, where, opt.model)
    for notice in diagnosis.notices:
        print_line(console, Shown.assemble(_notice_code(notice), f": {notice.detail}"))
    for skipped in diagnosis.inventory.skipped:
        print_line(console, Shown(f"skipped {name(skipped.file)}: {skipped.reason}", style="dim"))


def _print_model(console: Console, where: str, found: ModelComparison) -> None:
    counts = f"{found.optimizer_params} parameters in the optimizer, {found.model_params} in the model"
    if found.by_index:
        verdict = "fits" if found.matches else "does not fit"
        print_line(console, Shown(f"model for {where}: {counts}: {verdict} (index keys: compared by counts only)"))
        return
    print_line(console, Shown(f"model for {where}: {counts} ({', '.join(name(source) for source in found.sources)})"))
    if found.not_in_model:
        print_line(console, Shown.assemble(("not-in-model", "yellow"), f": {shown_names(found.not_in_model)}"))
    if found.rename is not None:
        print_line(console, Shown(f"every such name maps onto the model's with the rename {found.rename}"))
    for mismatch in found.shape_mismatches:
        shapes = f"{list(mismatch.state_shape)} but the model's parameter has {list(mismatch.model_shape)}"
        detail = f": {name(mismatch.param)} {name(mismatch.key)} is {shapes}"
        print_line(console, Shown.assemble(("shape-mismatch-model", "red"), detail))
    if found.not_in_optimizer:
        names = f" (frozen on purpose, or forgotten): {shown_names(found.not_in_optimizer)}"
        print_line(console, Shown.assemble(("not-in-optimizer", "cyan"), names))


def print_inspect(diagnosis: Diagnosis, screen: Screen, carried: tuple[str, ...] = ()) -> None:
    """The report; a repairable one ends with the fix to run, ``carried`` the options it takes over from inspect's."""
    console = screen.stdout()
    verdict = diagnosis.verdict
    path, fmt = name(diagnosis.inventory.path), diagnosis.inventory.format
    print_line(console, Shown.assemble((path, "bold"), f" ({fmt}): ", (verdict, _VERDICT_STYLE[verdict])), indent=0)
    _print_optimizer_table(console, diagnosis)
    _print_details(console, diagnosis)
    if diagnosis.inventory.traffic is not None:
        print_line(console, Shown(_traffic(diagnosis.inventory.traffic)), indent=0)
    if verdict == "repairable":
        print_command(console, "next: ", _fix_command(diagnosis, carried))


def _fix_command(diagnosis: Diagnosis, carried: tuple[str, ...]) -> list[str]:
    """``optim-repair fix CKPT --out CKPT-fixed``, with the renames that map the names onto the model's."""
    path = name(diagnosis.inventory.path)
    if diagnosis.inventory.is_directory or path.endswith("/"):
        slash = "/" if path.endswith("/") else ""
        out = f"{path.rstrip('/')}-fixed{slash}"
    else:
        stem, dot, suffix = path.rpartition(".")
        out = f"{stem}-fixed.{suffix}" if dot and "/" not in suffix else f"{path}-fixed"
    renames = dict.fromkeys(str(opt.model.rename) for opt in diagnosis.optimizers if opt.model and opt.model.rename)
    return [
        "optim-repair",
        "fix",
        path,
        "--out",
        out,
        *carried,
        *(w for rename in renames for w in ("--rename", rename)),
    ]


def _contents(addition: Addition) -> str:
    """An added entry's keys, sorted, each tensor's with its dtype (``exp_avg (bfloat16), step (float32)``), or
    ``{}``."""
    dtypes = dict(addition.dtypes)
    return ", ".join(f"{key} ({dtypes[key]})" if key in dtypes else key for key in sorted(addition.keys)) or "{}"


def _print_additions(console: Console, diagnosis: Diagnosis, plan: RepairPlan) -> None:
    table = new_table(console)
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
        names = index_names(inv, diagnosis.inventory) if mine else {}  # an index keyed entry named by its model
        for replacing, verb in ((False, ""), (True, "in place of phantom step=1 entries: ")):
            alike: dict[str, list[Addition]] = {}  # the entries of one content, said once
            for addition in mine:
                if addition.replaces is replacing:
                    alike.setdefault(_contents(addition), []).append(addition)
            for what, group in alike.items():
                params = [f"{name(a.param)} ({name(names[a.param])})" if a.param in names else name(a.param)
                          for a in group]  # fmt: skip
                parts.append(f"{verb}{what} for {listed(params[:SHOWN], len(params))}")
        replaced = sum(a.replaces for a in mine)
        count = f"{len(mine)} ({replaced} replaced)" if replaced else str(len(mine))
        rows.append([label, count, "; ".join(parts) or "—"])
        table.add_row(*(Shown(value) for value in rows[-1]))
    print_table(console, table, rows)


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
        print_line(console, Shown(note), indent=0)
    for opt in diagnosis.optimizers:
        inv = opt.optimizer
        empty = [a for a in plan.additions if (a.file, a.address) == (inv.file, inv.address) and not a.state]
        if empty and opt.loader == "set_optimizer_state_dict":
            print_line(console, Shown(f"{_optimizer_label(opt)}: {fsdp1_after_fill(len(empty))}"), indent=0)


def _print_changes(console: Console, plan: RepairPlan) -> None:
    renamed = [(c.old, c.new) for c in plan.changes if c.new is not None]
    dropped = [c.old for c in plan.changes if c.new is None]
    joined = [a.param for a in plan.additions if a.group is not None]
    if renamed:
        shown = listed([f"{name(old)} → {name(new)}" for old, new in renamed[:SHOWN]], len(renamed))
        print_line(console, Shown(f"renamed {len(renamed)} parameters: {shown}"), indent=0)
    if dropped:
        print_line(console, Shown(f"dropped {len(dropped)} parameters: {shown_names(tuple(dropped))}"), indent=0)
    if joined:
        added = f"added {len(joined)} model parameters to their param group: {shown_names(tuple(joined))}"
        print_line(console, Shown(added), indent=0)
    for option in plan.options:  # what the loading torch asks for (decoupled_weight_decay, since 2.8)
        where = ".".join(str(part) for part in (*option.address, "param_groups", option.group, option.key))
        print_line(console, Shown(f"added the param-group option {where} = {option.value!r}"), indent=0)
    for file in plan.older_forms:  # what a torch before 2.15 reads (newer-torch-metadata)
        older = (
            f"{file or '.'}/.metadata written in the form a torch before 2.15 reads (TensorProperties without strides)"
        )
        print_line(console, Shown(older), indent=0)


def _traffic(traffic: Traffic) -> str:
    return (
        f"object storage: {traffic.requests} requests, {human_bytes(traffic.read)} read, "
        f"{human_bytes(traffic.written)} written, {human_bytes(traffic.copied)} copied inside the store"
    )


def print_fix(result: FixResult, screen: Screen) -> None:
    console = screen.stdout()
    title = Shown.assemble(
        (name(result.diagnosis.inventory.path), "bold"), " → ", (name(str(result.out)), "bold"),
        f" (fill: {result.plan.fill})",
    )  # fmt: skip
    print_line(console, title, indent=0)
    for line in file_lines(result.files, name(str(result.out))):
        print_line(console, Shown(line), indent=1)
    _print_changes(console, result.plan)
    _print_additions(console, result.diagnosis, result.plan)
    _print_fill_notes(console, result.diagnosis, result.plan)
    v = result.verification
    verified = Shown.assemble(
        ("verified", "bold green"),
        f": {v.tensors} existing tensors and {human_bytes(v.bytes)} {proof(v)}, "
        f"bit-identical; the only changes are the {_changes(result.plan)}",
    )
    print_line(console, verified, indent=0)
    if result.traffic is not None:
        print_line(console, Shown(_traffic(result.traffic)), indent=0)
    if v.linked and not result.files:  # a copy on a disk says so file by file
        print_line(console, Shown(f"hard-linked to the original's, not copied: {shown_names(v.linked)}"), indent=0)
    if result.files:
        print_line(console, Shown(files_total(result.files, result.seconds)), indent=0)


def print_dry_run(planned: DryRun, screen: Screen) -> None:
    console = screen.stdout()
    title = Shown.assemble(
        ("dry run", "bold yellow"), ": ", (name(planned.diagnosis.inventory.path), "bold"), " → ",
        (name(str(planned.out)), "bold"), f" (fill: {planned.plan.fill}); nothing was written",
    )  # fmt: skip
    print_line(console, title, indent=0)
    _print_changes(console, planned.plan)
    _print_additions(console, planned.diagnosis, planned.plan)
    _print_fill_notes(console, planned.diagnosis, planned.plan)
    sizes = f"would write about {human_bytes(planned.bytes_to_write)}"
    if planned.free_bytes is None:
        print_line(console, Shown(f"{sizes} into the store"), indent=0)
        return
    # a dry run that would not fit is refused, as the run is: what is printed fits
    print_line(console, Shown(f"{sizes}; {human_bytes(planned.free_bytes)} free there: enough room"), indent=0)


def print_demo(report: DemoReport, screen: Screen, *, kept: bool) -> None:
    """The demo's story in one screen: each step in a line or two, and the resumes in a table."""
    console = screen.stdout()
    console.rule("1. A real run saved a checkpoint; torch refuses to resume from it")
    refused = report.stock_error.split(". ")[0].rstrip(".") + "."  # its first sentence
    print_line(console, Shown.assemble("stock set_optimizer_state_dict: ", (refused, "red")), indent=0)
    console.rule("2. optim-repair inspect")
    (opt,) = report.diagnosis.optimizers
    verdict = report.diagnosis.verdict
    found = f": {len(opt.missing)} of {opt.params} parameters have no state: {shown_names(opt.missing)}"
    print_line(console, Shown.assemble((verdict, _VERDICT_STYLE[verdict]), found), indent=0)
    console.rule("3. optim-repair fix: a copy for each fill, proved against the original")
    for fix in report.fixes:
        keys = sorted({key for addition in fix.plan.additions for key in addition.keys}) or ["{}"]
        added = f"--fill {fix.plan.fill}: added {', '.join(keys)} for {len(fix.plan.additions)} parameters; "
        proved = f"{fix.verification.tensors} existing tensors bit-identical"
        print_line(console, Shown.assemble(added, ("verified", "bold green"), f": {proved}"), indent=0)
    console.rule("4. Resume each copy, every head in use; compare with a run never stopped")
    table = new_table(console)
    for column in ("fill", "loader", "continues bit-identically", "max |Δ|"):
        table.add_column(column)
    rows = []
    for outcome in report.outcomes:
        same = "yes" if outcome.identical else "no: phantom step=1"
        rows.append([outcome.fill, outcome.loader, same, f"{outcome.max_difference:.3g}"])
        table.add_row(*rows[-1][:2], Shown(same, style="green" if outcome.identical else "red"), rows[-1][3])
    print_table(console, table, rows)
    closing = (
        "{} entries resume exactly through optim_repair.set_optimizer_state_dict (a drop-in for torch's); "
        "--fill fresh resumes exactly through torch's own loader, with no code change."
    )
    print_line(console, Shown(closing), indent=0)
    if kept:
        print_line(console, Shown(f"files kept in {name(str(report.checkpoint.parent))}"), indent=0)
