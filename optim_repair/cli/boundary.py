"""The command line's boundary with click and the library: options, one-line usage errors, and exit codes.

``run_command`` is the one place where a library error becomes a message on stderr (and a JSON document
on stdout with ``--json``) and an exit code; ``Command`` and ``Group`` make click's own usage errors read
the same way. A command's output is part of its run: a write to stdout or stderr that fails is an error
(exit 5, or 141 for a closed pipe). A run that fails before its copy is verified and in place leaves nothing
behind; one that fails after keeps the copy, which is never undone.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TextIO, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from optim_repair import render, signals
from optim_repair.errors import (
    ClosedPipe,
    ExitCode,
    OptimRepairError,
    OutOfMemory,
    Remedy,
    Stopped,
    StreamError,
    UsageError,
    os_error_reason,
)
from optim_repair.records.repair_plan import FillChoice
from optim_repair.storage.disk_staging import recorded_placements

_ENDED = "nothing was written, or the copy was finished and is kept"
"""What a run that ends early leaves: nothing, or its copy, once verified and in place (never undone)."""
_COMMON_EXITS = {
    ExitCode.USAGE: "usage error",
    ExitCode.INPUT: "input missing, unreadable, unsafe to load, or without optimizer state",
    ExitCode.OUTPUT: "output refused or failed, stdout and stderr included",
    ExitCode.INTERNAL: "internal error (a bug in optim-repair: please report it)",
    ExitCode.HUNG_UP: f"hung up (SIGHUP: the terminal closed); {_ENDED}",
    ExitCode.INTERRUPTED: f"interrupted (Ctrl-C, SIGINT); {_ENDED}",
    ExitCode.QUIT: f"quit (SIGQUIT, Ctrl-\\); {_ENDED}",
    ExitCode.BROKEN_PIPE: "stdout or stderr is a pipe its reader closed (| head), as SIGPIPE would give, silently; "
    + _ENDED,
    ExitCode.TERMINATED: f"terminated (SIGTERM); {_ENDED}",
}


def exit_codes(own: dict[ExitCode, str], examples: tuple[str, ...] = ()) -> str:
    """The end of a command's help: its ``examples``, then its exit codes, its own and those every command shares."""
    rows = sorted({**_COMMON_EXITS, **own}.items())
    listed = "".join(f"  {line}\n" for line in examples)
    shown = f"\b\nExamples:\n{listed}\n" if examples else ""
    return shown + "\b\nExit codes:\n" + "\n".join(f"  {int(code):>3}  {meaning}" for code, meaning in rows)


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
        fail(message, ExitCode.USAGE, "usage", None, json, render.Screen())
        raise typer.Exit(ExitCode.USAGE) from None


class Command(TyperCommand):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return _parse_with_one_line_errors(super().parse_args, ctx, args)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        # "optim-repair fix [OPTIONS] CKPT", as the docs write it, not typer's "{CKPT}"
        return [piece.strip("{}") for piece in super().collect_usage_pieces(ctx)]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """The argument, then the options, each under its ``rich_help_panel`` (``Options`` without one): the
        grouping typer gives only in its rich help, in click's plain help."""
        sections: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                panel = "Arguments" if param.param_type_name == "argument" else None
                sections.setdefault(panel or getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for title, records in sections.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


class Group(TyperGroup):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return _parse_with_one_line_errors(super().parse_args, ctx, args)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        return _parse_with_one_line_errors(super().resolve_command, ctx, args)


def choice(option: str, choices: list[str]) -> Callable[[str], str]:
    """A parser for an option with a few valid values, whose error says what to choose:
    "invalid value 'zero' for --fill: choose auto, empty or fresh"."""

    def parse(value: str) -> str:
        if value in choices:
            return value
        raise _click_errors.UsageError(
            f"invalid value {value!r} for {option}: choose {', '.join(choices[:-1])} or {choices[-1]}"
        )

    return parse


FILLS: dict[str, FillChoice] = {"auto": "auto", "empty": "empty", "fresh": "fresh"}
COLORS: dict[str, render.Color] = {"auto": "auto", "always": "always", "never": "never"}
"""The values ``choice`` admitted, as the types the library takes."""


def make_screen(color: str, quiet: bool) -> render.Screen:
    return render.Screen(COLORS[color], quiet)


def rename_pair(text: str) -> tuple[str, str]:
    """``--rename OLD=NEW``: split at the first ``=`` (a replacement may hold one; a pattern rarely does)."""
    old, equals, new = text.partition("=")
    if not equals or not old:
        raise UsageError(f"{{argument}} takes OLD=NEW, not {text!r}", argument="rename")
    return old, new


MODEL_CHANGES, STORAGE, OUTPUT = "Model changes", "Object storage", "Output"
"""The sections of a command's help that group its options, after the ``Options`` every run needs."""
Checkpoint = Annotated[
    str,
    typer.Argument(
        metavar="CKPT",
        help="A torch file, a checkpoint directory, or a DCP directory, on this machine or in s3://, gs:// or az://BUCKET/PREFIX/.",
        show_default=False,
    ),
]
ProfileOption = Annotated[
    str | None,
    typer.Option(
        "--profile",
        metavar="NAME",
        help="For s3://: the AWS profile (default: as the AWS CLI finds it).",
        rich_help_panel=STORAGE,
    ),
]
EndpointOption = Annotated[
    str | None,
    typer.Option(
        "--endpoint-url",
        metavar="URL",
        help="The store's endpoint (default: AWS_ENDPOINT_URL for s3://, STORAGE_EMULATOR_HOST for gs://, the "
        "connection string's BlobEndpoint for az://).",
        rich_help_panel=STORAGE,
    ),
]
AccountOption = Annotated[
    str | None,
    typer.Option(
        "--account",
        metavar="NAME",
        help="For az://: the storage account (default: the URL's, else AZURE_STORAGE_CONNECTION_STRING's, else "
        "AZURE_STORAGE_ACCOUNT).",
        rich_help_panel=STORAGE,
    ),
]
ForTorchOption = Annotated[
    str | None,
    typer.Option(
        "--for-torch",
        metavar="VERSION",
        help="The torch release that will load the checkpoint (2.13), whose loaders judge it: the param-group "
        "options its dcp.load asks for. Default: the installed torch.",
    ),
]
JsonFlag = Annotated[
    bool,
    typer.Option(
        "--json", help="Print one JSON document (schema_version 2) instead, errors included.", rich_help_panel=OUTPUT
    ),
]
LatestFlag = Annotated[
    bool,
    typer.Option(
        "--latest",
        help="CKPT is a run directory: take its newest complete step (checkpoint-N, step-N, global_stepN, iter_N, "
        "epoch=E-step=S.ckpt; a DCP step without .metadata is still being written and is passed over).",
    ),
]
DereferenceFlag = Annotated[
    bool,
    typer.Option(
        "--dereference",
        "-L",
        help="Follow every symbolic link under CKPT, as cp -L does: read and copy what it reaches. By default a "
        "link is kept as a link (one to a file outside CKPT is read through; the copy holds a repaired file).",
    ),
]
QuietFlag = Annotated[
    bool, typer.Option("--quiet", "-q", help="Show results only: no progress, no messages.", rich_help_panel=OUTPUT)
]
ColorOption = Annotated[
    str,
    typer.Option(
        "--color",
        metavar="auto|always|never",
        parser=choice("--color", ["auto", "always", "never"]),
        help="Colour: auto (a terminal, unless NO_COLOR), always, or never.",
        rich_help_panel=OUTPUT,
    ),
]


def _as_flag(remedy: Remedy) -> str:
    """A remedy in the CLI's words: the flag that has the name of the library's keyword argument."""
    flag = "--" + remedy.option.replace("_", "-")
    return f"pass {flag}{f' {remedy.value}' if remedy.value else ''}{remedy.note}"


@contextlib.contextmanager
def writes_to(name: str) -> Iterator[None]:
    """A block that writes to ``name`` (``stdout`` or ``stderr``): a failed write is a ``StreamError`` (a
    ``ClosedPipe`` for a pipe its reader closed), and the stream is sent to ``/dev/null`` from then on, so
    that Python's own flush at exit does not fail again (a warning, and exit 120)."""
    try:
        yield
    except BrokenPipeError as exc:
        _silence(name)
        raise ClosedPipe(name) from exc
    except OSError as exc:
        _silence(name)
        raise StreamError(name, os_error_reason(exc)) from exc
    except SystemExit as exc:  # rich's answer to a broken pipe: exit 1, which would read as "repairable"
        if not isinstance(exc.__context__, BrokenPipeError):
            raise
        _silence(name)
        raise ClosedPipe(name) from exc.__context__


def _stream(name: str) -> TextIO | None:
    stream: TextIO | None = getattr(sys, name)
    return stream


def _silence(name: str) -> None:
    stream = _stream(name)
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError):  # a stream without a descriptor (a test's) stays as it is
        descriptor = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.dup2(descriptor, stream.fileno())
        finally:
            os.close(descriptor)


T = TypeVar("T")


def on_stderr(callback: Callable[[T], None]) -> Callable[[T], None]:
    """``callback``, which writes to stderr (messages, the progress bar), with a failed write raised as a
    ``StreamError``: not as the ``OSError`` the library would take for one of its own files."""

    def guarded(value: T) -> None:
        with writes_to("stderr"):
            callback(value)

    return guarded


def _check_streams() -> None:
    """Refuse to start when stdout or stderr is closed (Python made it None): the result could not be told."""
    for name in ("stdout", "stderr"):
        if _stream(name) is None:
            raise StreamError(name, "it is closed")


def _flush() -> None:
    """Write out what stdout and stderr hold, so that a failure is caught here and not at Python's exit."""
    for name in ("stdout", "stderr"):
        with writes_to(name):
            stream = _stream(name)
            if stream is not None:
                stream.flush()


def run_command(command: Callable[[], int], screen: render.Screen, *, json: bool) -> None:
    """The boundary around everything a command does, rendering included: the one place library errors
    become a message on stderr (and a JSON document on stdout with ``--json``) and an exit code.

    Once the result is written out, the run's signals wait until it exits (``signals.settle``): a finished
    run stays finished. A run that fails after its copy was moved into place, its output or a signal
    included, keeps the copy (verified, and never undone), and says so."""
    try:
        with recorded_placements() as placed:
            _check_streams()
            code = command()
            _flush()
            signals.settle()
    except ClosedPipe as exc:  # | head: exit 141 and silence, as cat and git; a copy in place stays
        signals.settle()
        code = exc.exit_code
    except OptimRepairError as exc:
        signals.settle()
        argument = "--" + exc.argument.replace("_", "-") if exc.argument else ""
        message = exc.describe(argument, _as_flag(exc.remedy) if exc.remedy else "")
        code = fail(_kept(message, placed), exc.exit_code, exc.code, exc.path, json, screen)
    except MemoryError:  # past what reading bounds (a limit of the process, a large file): not a bug
        signals.settle()
        short = OutOfMemory()
        code = fail(_kept(str(short), placed), short.exit_code, short.code, None, json, screen)
    except (KeyboardInterrupt, Stopped) as exc:  # KeyboardInterrupt: the app run without the console's handler
        signals.settle()
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        kind, words = signals.ENDING[signum]
        message = _kept(words, placed) if placed else f"{words}; nothing was written"
        code = fail(message, 128 + signum, kind, None, json, screen)
    except Exception as exc:  # a bug, not an input problem: one line, its own exit code
        signals.settle()
        message = f"internal error ({type(exc).__name__}: {exc}); please report it"
        code = fail(_kept(message, placed), ExitCode.INTERNAL, "internal", None, json, screen)
    raise typer.Exit(code)


def _kept(message: str, placed: list[Path]) -> str:
    """``message``, saying that the copy this run had already moved into place is finished and kept."""
    return f"{message}; {placed[0]} was already written and verified, and is kept" if placed else message


def fail(message: str, code: int, kind: str, path: str | None, json: bool, screen: render.Screen) -> int:
    """Say what failed: one line on stderr (and a JSON document on stdout with ``json``), where they can
    still be written; return ``code``."""
    line = " ".join(message.split()) if "\n" in message else message
    with contextlib.suppress(StreamError), writes_to("stderr"):
        if _stream("stderr") is not None:
            render.print_error(line, screen)
    if json:
        with contextlib.suppress(StreamError), writes_to("stdout"):
            if _stream("stdout") is not None:
                render.print_json(render.error_document(kind, code, line, path))
                sys.stdout.flush()
    return code
