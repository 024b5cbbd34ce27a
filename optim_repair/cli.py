"""The ``optim-repair`` command: parse, call one library function, render, pick the exit code."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from optim_repair import api, render
from optim_repair.decisions.optimizers import OPTIMIZERS
from optim_repair.errors import ExitCode, OptimRepairError, Remedy, Terminated, UsageError
from optim_repair.records.repair_plan import Fill

_COMMON_EXITS = {
    ExitCode.USAGE: "usage error",
    ExitCode.INPUT: "input missing, unreadable, unsafe to load, or without optimizer state",
    ExitCode.OUTPUT: "output refused or failed",
    ExitCode.INTERNAL: "internal error (a bug in optim-repair: please report it)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C); nothing was written",
    ExitCode.TERMINATED: "terminated (SIGTERM); nothing was written",
}


def _exit_codes(own: dict[ExitCode, str]) -> str:
    """A command's exit codes, for the end of its help: its own, then those every command shares."""
    rows = sorted({**_COMMON_EXITS, **own}.items())
    return "\b\nExit codes:\n" + "\n".join(f"  {int(code):>3}  {meaning}" for code, meaning in rows)


_click_errors: Any = importlib.import_module(typer.BadParameter.__module__)
"""The exceptions of the click typer runs on: its own vendored copy (typer 0.29+) or the click package."""
_SHOWS_HELP = getattr(_click_errors, "NoArgsIsHelpError", ())
"""What click (8.2+) raises for a bare command that shows its help instead."""


Parsed = TypeVar("Parsed")


def _parse_with_one_line_errors(parse: Callable[[Any, list[str]], Parsed], ctx: Any, args: list[str]) -> Parsed:
    """Click's usage errors as one line on stderr, as optim-repair's own errors are (and, with ``--json``,
    one JSON document on stdout), exit 2; ``--help`` and a bare command still show the help."""
    json = "--json" in args  # before click consumes them
    try:
        return parse(ctx, args)
    except _SHOWS_HELP:
        raise
    except _click_errors.UsageError as exc:
        text = exc.format_message().rstrip(".")
        message = f"{text[:1].lower()}{text[1:]}; see '{ctx.command_path} --help'"
        _fail(message, ExitCode.USAGE, "usage", None, json, render.Screen())
        raise typer.Exit(ExitCode.USAGE) from None


class _Command(TyperCommand):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return _parse_with_one_line_errors(super().parse_args, ctx, args)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        # "optim-repair fix [OPTIONS] CKPT", as the docs write it, not typer's "{CKPT}"
        return [piece.strip("{}") for piece in super().collect_usage_pieces(ctx)]


class _Group(TyperGroup):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return _parse_with_one_line_errors(super().parse_args, ctx, args)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        return _parse_with_one_line_errors(super().resolve_command, ctx, args)


app = typer.Typer(
    cls=_Group,
    help="Find and repair missing optimizer state in PyTorch checkpoints, without touching the original.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _choice(option: str, choices: list[str]) -> Callable[[str], str]:
    """A parser for an option with a few valid values, whose error says what to choose:
    "invalid value 'zero' for --fill: choose empty or fresh"."""

    def parse(value: str) -> str:
        if value in choices:
            return value
        raise _click_errors.UsageError(
            f"invalid value {value!r} for {option}: choose {', '.join(choices[:-1])} or {choices[-1]}"
        )

    return parse


_FILLS: dict[str, Fill] = {"empty": "empty", "fresh": "fresh"}
_COLORS: dict[str, render.Color] = {"auto": "auto", "always": "always", "never": "never"}
"""The values ``_choice`` admitted, as the types the library takes."""


def _screen(color: str, quiet: bool) -> render.Screen:
    return render.Screen(_COLORS[color], quiet)


def _rename(text: str) -> tuple[str, str]:
    """``--rename OLD=NEW``: split at the first ``=`` (a replacement may hold one; a pattern rarely does)."""
    old, equals, new = text.partition("=")
    if not equals or not old:
        raise UsageError(f"{{argument}} takes OLD=NEW, not {text!r}", argument="rename")
    return old, new


def _version(value: bool) -> None:
    if value:
        found = api.versions()
        typer.echo(f"optim-repair {found.optim_repair} (torch {found.torch or 'not installed'})")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Find and repair missing optimizer state in PyTorch checkpoints, without touching the original."""


Checkpoint = Annotated[
    Path,
    typer.Argument(
        metavar="CKPT", help="A torch file, a checkpoint directory, or a DCP directory.", show_default=False
    ),
]
JsonFlag = Annotated[
    bool, typer.Option("--json", help="Print one JSON document (schema_version 2) instead, errors included.")
]
QuietFlag = Annotated[bool, typer.Option("--quiet", "-q", help="Show results only: no progress, no messages.")]
ColorOption = Annotated[
    str,
    typer.Option(
        "--color",
        metavar="auto|always|never",
        parser=_choice("--color", ["auto", "always", "never"]),
        help="Colour: auto (a terminal, unless NO_COLOR), always, or never.",
    ),
]


def _as_flag(remedy: Remedy) -> str:
    """A remedy in the CLI's words: the flag that has the name of the library's keyword argument."""
    flag = "--" + remedy.option.replace("_", "-")
    return f"pass {flag}{f' {remedy.value}' if remedy.value else ''}{remedy.note}"


def _run(command: Callable[[], int], screen: render.Screen, *, json: bool) -> None:
    """The boundary around everything a command does, rendering included: the one place library errors
    become a message on stderr (and a JSON document on stdout with ``--json``) and an exit code."""
    try:
        code = command()
    except OptimRepairError as exc:
        argument = "--" + exc.argument.replace("_", "-") if exc.argument else ""
        message = exc.describe(argument, _as_flag(exc.remedy) if exc.remedy else "")
        code = _fail(message, exc.exit_code, exc.code, exc.path, json, screen)
    except KeyboardInterrupt:
        code = _fail("interrupted; nothing was written", ExitCode.INTERRUPTED, "interrupted", None, json, screen)
    except Terminated:
        code = _fail("terminated; nothing was written", ExitCode.TERMINATED, "terminated", None, json, screen)
    except Exception as exc:  # a bug, not an input problem: one line, its own exit code
        message = f"internal error ({type(exc).__name__}: {exc}); please report it"
        code = _fail(message, ExitCode.INTERNAL, "internal", None, json, screen)
    raise typer.Exit(code)


def _fail(message: str, code: int, kind: str, path: str | None, json: bool, screen: render.Screen) -> int:
    line = " ".join(message.split()) if "\n" in message else message
    render.print_error(line, screen)
    if json:
        render.print_json(render.error_document(kind, code, line, path))
    return code


_VERDICT_EXIT = {"healthy": ExitCode.OK, "repairable": ExitCode.REPAIRABLE, "malformed": ExitCode.MALFORMED}


@app.command(
    cls=_Command,
    epilog=_exit_codes(
        {
            ExitCode.OK: "healthy: a resume through the loader the layout implies works and continues exactly",
            ExitCode.REPAIRABLE: "repairable: absent entries that loader rejects or would mistrain",
            ExitCode.MALFORMED: "malformed",
        }
    ),
)
def inspect(
    checkpoint: Checkpoint,
    model: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="Compare each optimizer with this model: safetensors (a file or a directory of shards), torch file "
            "or DCP directory. Default: the weights beside the optimizer, when there are some.",
        ),
    ] = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Count every absent entry as repairable, also those optimizer.load_state_dict resumes exactly.",
        ),
    ] = False,
    json: JsonFlag = False,
    quiet: QuietFlag = False,
    color: ColorOption = "auto",
) -> None:
    """Report every optimizer, every parameter without state, and every malformed entry."""
    screen = _screen(color, quiet)

    def command() -> int:
        diagnosis = api.inspect(checkpoint, strict=strict, model=model)
        if json:
            render.print_json(render.inspect_document(diagnosis))
        else:
            render.print_inspect(diagnosis, screen)
        return _VERDICT_EXIT[diagnosis.verdict]

    _run(command, screen, json=json)


@app.command(
    cls=_Command,
    epilog=_exit_codes(
        {
            ExitCode.OK: "copy written and verified (with --dry-run: planned, nothing written)",
            ExitCode.MALFORMED: "malformed, or not repairable as asked; nothing written",
        }
    ),
)
def fix(
    checkpoint: Checkpoint,
    out: Annotated[
        str,
        typer.Option(
            "--out", metavar="FIXED", help="Where to write the repaired copy (a new path; DIR/ for a file: DIR/CKPT)."
        ),
    ],
    fill: Annotated[
        str | None,
        typer.Option(
            metavar="empty|fresh",
            parser=_choice("--fill", ["empty", "fresh"]),
            help="empty: add {} (default for torch files); fresh: the optimizer's exact first-step state "
            "(default for DCP).",
        ),
    ] = None,
    optimizer: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            parser=_choice("--optimizer", list(OPTIMIZERS)),
            help=f"Which optimizer wrote the state, for --fill fresh: {', '.join(OPTIMIZERS)}.",
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH",
            help="Model weights for parameter shapes: safetensors (a file or a directory of shards), torch file "
            "or DCP directory.",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    link: Annotated[
        bool, typer.Option("--link", help="Hard-link the files the repair does not change instead of copying them.")
    ] = False,
    no_sync: Annotated[
        bool, typer.Option("--no-sync", help="Do not sync the copy to the disk before verifying it (a scratch copy).")
    ] = False,
    rename: Annotated[
        list[str] | None,
        typer.Option(
            metavar="OLD=NEW",
            help="Rename parameters: a Python regular expression and its replacement, applied to every name in "
            "state and param_groups (repeatable; before --drop and --add-from-model).",
        ),
    ] = None,
    drop: Annotated[
        list[str] | None,
        typer.Option(metavar="PATTERN", help="Drop the parameters whose name matches (repeatable)."),
    ] = None,
    drop_not_in_model: Annotated[
        bool, typer.Option("--drop-not-in-model", help="Drop every parameter the model does not have.")
    ] = False,
    add_from_model: Annotated[
        bool,
        typer.Option(
            "--add-from-model",
            help="Add every model parameter no param group holds (to --to-group), filled as --fill says.",
        ),
    ] = False,
    to_group: Annotated[
        int | None,
        typer.Option(metavar="N", help="The param group (0-based) --add-from-model adds to; default: the only one."),
    ] = None,
    reset_phantom_step: Annotated[
        bool,
        typer.Option(
            "--reset-phantom-step",
            help="Also turn entries with step=1 and all-zero moments (a phantom step) back into the state the "
            "optimizer would have: {}, or with --fill fresh its exact fresh state.",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Show what would be added and written, and the free space; write nothing."),
    ] = False,
    json: JsonFlag = False,
    quiet: QuietFlag = False,
    color: ColorOption = "auto",
) -> None:
    """Write a repaired, verified copy; the input is never modified."""
    screen = _screen(color, quiet)
    filled = _FILLS[fill] if fill is not None else None

    def command() -> int:
        changes = api.model_changes(
            rename=[_rename(text) for text in rename or ()],
            drop=drop or (),
            drop_not_in_model=drop_not_in_model,
            add_from_model=add_from_model,
            to_group=to_group,
        )
        if dry_run:
            planned = api.dry_run(
                checkpoint,
                out,
                fill=filled,
                optimizer=optimizer,
                model=model,
                link=link,
                reset_phantom_step=reset_phantom_step,
                operations=changes,
            )
            if json:
                render.print_json(render.dry_run_document(planned))
            else:
                render.print_dry_run(planned, screen)
            return ExitCode.OK
        with render.progress_bar(screen, show=not json) as progress:
            result = api.fix(
                checkpoint,
                out,
                fill=filled,
                optimizer=optimizer,
                model=model,
                force=force,
                link=link,
                sync=not no_sync,
                reset_phantom_step=reset_phantom_step,
                operations=changes,
                progress=progress,
                notice=render.message_printer(screen),
            )
        if json:
            render.print_json(render.fix_document(result))
        else:
            render.print_fix(result, screen)
        return ExitCode.OK

    _run(command, screen, json=json)


@app.command(cls=_Command, epilog=_exit_codes({ExitCode.OK: "demo completed"}))
def demo(
    keep: Annotated[bool, typer.Option("--keep", help="Keep the demo's files instead of removing them.")] = False,
    quiet: QuietFlag = False,
    color: ColorOption = "auto",
) -> None:
    """Train a tiny model whose aux head never gets a gradient, then inspect, fix and resume it."""
    screen = _screen(color, quiet)

    def command() -> int:
        from optim_repair.demo import run_demo

        report = run_demo(keep=keep, progress=render.message_printer(screen))
        render.print_demo(report, screen, kept=keep)
        fresh = [outcome for outcome in report.outcomes if outcome.fill == "fresh"]
        if not all(outcome.identical for outcome in fresh):
            message = "the fresh-state copy did not continue bit-identically; please report it"
            return _fail(message, ExitCode.INTERNAL, "internal", None, False, screen)
        return ExitCode.OK

    _run(command, screen, json=False)


def run() -> None:
    """Run the command line; ``optim_repair.console.main`` calls it once interrupts are handled."""
    # torch warns on import when numpy is absent; nothing optim-repair does needs numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        app(prog_name="optim-repair")
    except SystemExit as exc:
        # Ctrl-C while typer still parses the command line: it exits 130 silently (Exit from KeyboardInterrupt).
        if isinstance(exc.__context__, typer.Exit) and isinstance(exc.__context__.__cause__, KeyboardInterrupt):
            _fail("interrupted; nothing was written", ExitCode.INTERRUPTED, "interrupted", None, False, render.Screen())
        raise
