"""The ``optim-repair`` command: parse, call one library function, render, pick the exit code."""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from optim_repair import api, render
from optim_repair.errors import ExitCode, OptimRepairError, Remedy, Terminated

app = typer.Typer(
    help="Find and repair missing optimizer state in PyTorch checkpoints, without touching the original.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help and one-line usage errors
)



class FillChoice(str, enum.Enum):
    empty = "empty"
    fresh = "fresh"


_VERDICT_EXIT = {"healthy": ExitCode.OK, "repairable": ExitCode.REPAIRABLE, "malformed": ExitCode.MALFORMED}

Checkpoint = Annotated[
    Path, typer.Argument(help="A torch file, a checkpoint directory, or a DCP directory.", show_default=False)
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document (schema_version 1) instead.")]


def _as_flag(remedy: Remedy) -> str:
    """A remedy in the CLI's words: the flag that has the name of the library's keyword argument."""
    flag = "--" + remedy.option.replace("_", "-")
    return f"pass {flag}{f' {remedy.value}' if remedy.value else ''}{remedy.note}"


def _run(command: Callable[[], int]) -> None:
    """The boundary around everything a command does, rendering included: the one place library errors
    become a message on stderr and an exit code."""
    try:
        code = command()
    except OptimRepairError as exc:
        argument = "--" + exc.argument.replace("_", "-") if exc.argument else ""
        code = _fail(exc.describe(argument, _as_flag(exc.remedy) if exc.remedy else ""), exc.exit_code)
    except KeyboardInterrupt:
        code = _fail("interrupted; nothing was written", ExitCode.INTERRUPTED)
    except Terminated:
        code = _fail("terminated; nothing was written", ExitCode.TERMINATED)
    except Exception as exc:  # a bug, not an input problem: one line, its own exit code
        code = _fail(f"internal error ({type(exc).__name__}: {exc}); please report it", ExitCode.INTERNAL)
    raise typer.Exit(code)


def _fail(message: str, code: int) -> int:
    render.print_error(" ".join(message.split()) if "\n" in message else message)
    return code


@app.command()
def inspect(checkpoint: Checkpoint, json: JsonFlag = False) -> None:
    """Report every optimizer, every parameter without state, and every malformed entry.

    Exit 0 healthy, 1 missing entries (repairable), 2 usage error, 3 malformed, 4 nothing readable.
    """


    def command() -> int:
        diagnosis = api.inspect(checkpoint)
        if json:
            render.print_json(render.inspect_document(diagnosis))
        else:
            render.print_inspect(diagnosis)
        return _VERDICT_EXIT[diagnosis.verdict]

    _run(command)


@app.command()
def fix(
    checkpoint: Checkpoint,
    out: Annotated[Path, typer.Option("--out", help="Where to write the repaired copy (a new path).")],
    fill: Annotated[
        FillChoice | None,
        typer.Option(help="empty: add {} (default for torch files); fresh: the optimizer's exact first-step state "
                     "(default for DCP)."),
    ] = None,
    optimizer: Annotated[
        str | None, typer.Option(help="Which optimizer wrote the state, for --fill fresh (e.g. adamw).")
    ] = None,
    model: Annotated[
        Path | None, typer.Option(help="Model weights for parameter shapes: safetensors, torch file or DCP directory.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    link: Annotated[
        bool, typer.Option("--link", help="Hard-link the files the repair does not change instead of copying them.")
    ] = False,
    no_sync: Annotated[
        bool, typer.Option("--no-sync", help="Do not sync the copy to the disk before verifying it (a scratch copy).")
    ] = False,
    json: JsonFlag = False,
) -> None:
    """Write a repaired, verified copy; the input is never modified.

    Exit 0 written and verified, 2 usage error, 3 malformed or not repairable as asked (nothing written),
    4 bad input, 5 output refused or failed.
    """


    def command() -> int:
        with render.progress_bar(show=not json) as progress:
            result = api.fix(
                checkpoint,
                out,
                fill=fill.value if fill else None,
                optimizer=optimizer,
                model=model,
                force=force,
                link=link,
                sync=not no_sync,
                progress=progress,
                notice=render.print_message,
            )
        if json:
            render.print_json(render.fix_document(result))
        else:
            render.print_fix(result)
        return ExitCode.OK

    _run(command)


@app.command()
def demo(
    keep: Annotated[bool, typer.Option("--keep", help="Keep the demo's files instead of removing them.")] = False,
) -> None:
    """Train a tiny model whose aux head never gets a gradient, then inspect, fix and resume it."""


    def command() -> int:
        from optim_repair.demo import run_demo

        report = run_demo(keep=keep, progress=render.print_message)
        render.print_demo(report, kept=keep)
        fresh = [outcome for outcome in report.outcomes if outcome.fill == "fresh"]
        if not all(outcome.identical for outcome in fresh):
            return _fail("the fresh-state copy did not continue bit-identically; please report it", ExitCode.INTERNAL)
        return ExitCode.OK

    _run(command)


def run() -> None:
    """Run the command line; ``optim_repair.console.main`` calls it once interrupts are handled."""
    # torch warns on import when numpy is absent; nothing optim-repair does needs numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        app(prog_name="optim-repair")
    except SystemExit as exc:
        # Ctrl-C while typer still parses the command line: it exits 130 silently (Exit from KeyboardInterrupt).
        if isinstance(exc.__context__, typer.Exit) and isinstance(exc.__context__.__cause__, KeyboardInterrupt):
            _fail("interrupted; nothing was written", ExitCode.INTERRUPTED)
        raise
