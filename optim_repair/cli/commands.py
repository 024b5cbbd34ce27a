"""The ``optim-repair`` commands: each parses, calls one library function, renders, and picks the exit code."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer

from optim_repair import api, render, signals
from optim_repair.cli.boundary import (
    FILLS,
    MODEL_CHANGES,
    STORAGE,
    AccountOption,
    Checkpoint,
    ColorOption,
    Command,
    DereferenceFlag,
    EndpointOption,
    ForTorchOption,
    Group,
    JsonFlag,
    LatestFlag,
    ProfileOption,
    QuietFlag,
    choice,
    exit_codes,
    fail,
    make_screen,
    on_stderr,
    rename_pair,
    run_command,
    writes_to,
)
from optim_repair.decisions.optimizers import OPTIMIZERS
from optim_repair.errors import ClosedPipe, ExitCode, Stopped
from optim_repair.formats.pickle_limits import SCANNER
from optim_repair.storage.schemes import StoreArgs, is_remote
from optim_repair.version import versions

app = typer.Typer(
    cls=Group,
    help="Find and repair missing optimizer state in PyTorch checkpoints, without touching the original.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        found = versions()
        typer.echo(f"optim-repair {found.optim_repair} (torch {found.torch or 'not installed'}, {SCANNER} scanner)")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Find and repair missing optimizer state in PyTorch checkpoints, without touching the original."""


def _step(checkpoint: str, latest: bool, screen: render.Screen, store: StoreArgs) -> str | Path:
    """The checkpoint a command works on: ``checkpoint``, or with ``--latest`` its run's newest complete step."""
    if not latest:
        return checkpoint if is_remote(checkpoint) else Path(checkpoint)
    say = on_stderr(render.message_printer(screen))
    step = api.latest_checkpoint(checkpoint, notice=say, **store)
    say(f"newest complete step: {step}")
    return step


_VERDICT_EXIT = {"healthy": ExitCode.OK, "repairable": ExitCode.REPAIRABLE, "malformed": ExitCode.MALFORMED}


@app.command(
    cls=Command,
    epilog=exit_codes(
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
        str | None,
        typer.Option(
            metavar="PATH",
            help="Compare each optimizer with this model: safetensors (a file or a directory of shards), torch file "
            "or DCP directory, here or in s3://, gs:// or az://. Default: the weights beside the optimizer, when "
            "there are some.",
        ),
    ] = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Count every absent entry as repairable, also those optimizer.load_state_dict resumes exactly.",
        ),
    ] = False,
    latest: LatestFlag = False,
    dereference: DereferenceFlag = False,
    profile: ProfileOption = None,
    endpoint_url: EndpointOption = None,
    account: AccountOption = None,
    for_torch: ForTorchOption = None,
    json: JsonFlag = False,
    quiet: QuietFlag = False,
    color: ColorOption = "auto",
) -> None:
    """Report every optimizer, every parameter without state, and every malformed entry."""
    screen = make_screen(color, quiet)
    store = StoreArgs(profile=profile, endpoint_url=endpoint_url, account=account)
    given = {"--model": model, "--for-torch": for_torch, "--profile": profile, "--endpoint-url": endpoint_url}
    given["--account"] = account
    carried = (*(["--dereference"] if dereference else []), *(w for o, v in given.items() if v for w in (o, v)))

    def command() -> int:
        diagnosis = api.inspect(
            _step(checkpoint, latest, screen, store), strict=strict, model=model,
            dereference=dereference, for_torch=for_torch, **store,
        )  # fmt: skip
        with writes_to("stdout"):
            if json:
                render.print_json(render.inspect_document(diagnosis))
            else:
                render.print_inspect(diagnosis, screen, carried)
        return _VERDICT_EXIT[diagnosis.verdict]

    run_command(command, screen, json=json)


@app.command(
    cls=Command,
    epilog=exit_codes(
        {
            ExitCode.OK: "copy written and verified (with --dry-run: planned, nothing written)",
            ExitCode.MALFORMED: "malformed, or not repairable as asked; nothing written",
        },
        examples=(
            "optim-repair fix ckpt/ --out fixed/ --dry-run",
            "optim-repair fix ckpt/ --out fixed/ --rename '^_orig_mod\\.='",
            "optim-repair fix s3://bucket/run/ --latest --out s3://bucket/fixed/",
        ),
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
            metavar="auto|empty|fresh",
            parser=choice("--fill", ["auto", "empty", "fresh"]),
            help="fresh: the optimizer's exact first-step state, which resumes exactly through every loader; "
            "empty: add {} (torch files only); auto (the default): fresh where it can be built, else {}, saying why.",
        ),
    ] = None,
    optimizer: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            parser=choice("--optimizer", list(OPTIMIZERS)),
            help=f"Which optimizer wrote the state, for --fill fresh (implied): {', '.join(OPTIMIZERS)}.",
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            metavar="PATH",
            help="Model weights for parameter shapes: safetensors (a file or a directory of shards), torch file "
            "or DCP directory, here or in s3://, gs:// or az://.",
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
            rich_help_panel=MODEL_CHANGES,
        ),
    ] = None,
    drop: Annotated[
        list[str] | None,
        typer.Option(
            metavar="PATTERN",
            help="Drop the parameters whose name matches (repeatable).",
            rich_help_panel=MODEL_CHANGES,
        ),
    ] = None,
    drop_not_in_model: Annotated[
        bool,
        typer.Option(
            "--drop-not-in-model", help="Drop every parameter the model does not have.", rich_help_panel=MODEL_CHANGES
        ),
    ] = False,
    add_from_model: Annotated[
        bool,
        typer.Option(
            "--add-from-model",
            help="Add every model parameter no param group holds (to --to-group), filled as --fill says.",
            rich_help_panel=MODEL_CHANGES,
        ),
    ] = False,
    to_group: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="The param group (0-based) --add-from-model adds to; default: the only one.",
            rich_help_panel=MODEL_CHANGES,
        ),
    ] = None,
    reset_phantom_step: Annotated[
        bool,
        typer.Option(
            "--reset-phantom-step",
            help="Also turn entries with step=1 and all-zero moments (a phantom step) back into the state the "
            "optimizer would have: {}, or with --fill fresh its exact fresh state.",
            rich_help_panel=MODEL_CHANGES,
        ),
    ] = False,
    latest: LatestFlag = False,
    dereference: DereferenceFlag = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Show what would be added and written, and the free space; write nothing."),
    ] = False,
    verify: Annotated[
        str,
        typer.Option(
            metavar="store|download",
            parser=choice("--verify", ["store", "download"]),
            help="For a store: prove server-side copies by its checksums (store; az:// copies are pinned, not proven), "
            "or read them back.",
            rich_help_panel=STORAGE,
        ),
    ] = "store",
    profile: ProfileOption = None,
    endpoint_url: EndpointOption = None,
    account: AccountOption = None,
    for_torch: ForTorchOption = None,
    json: JsonFlag = False,
    quiet: QuietFlag = False,
    color: ColorOption = "auto",
) -> None:
    """Write a repaired, verified copy; the input is never modified."""
    screen = make_screen(color, quiet)
    filled = FILLS[fill] if fill is not None else None

    def command() -> int:
        store = StoreArgs(profile=profile, endpoint_url=endpoint_url, account=account)
        step = _step(checkpoint, latest, screen, store)
        changes = api.model_changes(
            rename=[rename_pair(text) for text in rename or ()],
            drop=drop or (),
            drop_not_in_model=drop_not_in_model,
            add_from_model=add_from_model,
            to_group=to_group,
        )
        if dry_run:
            planned = api.dry_run(
                step,
                out,
                fill=filled,
                optimizer=optimizer,
                model=model,
                link=link,
                force=force,
                dereference=dereference,
                reset_phantom_step=reset_phantom_step,
                operations=changes,
                **store,
                for_torch=for_torch,
            )
            with writes_to("stdout"):
                if json:
                    render.print_json(render.dry_run_document(planned))
                else:
                    render.print_dry_run(planned, screen)
            return ExitCode.OK
        with render.progress_bar(screen, show=not json) as progress:
            result = api.fix(
                step,
                out,
                fill=filled,
                optimizer=optimizer,
                model=model,
                force=force,
                link=link,
                dereference=dereference,
                sync=not no_sync,
                reset_phantom_step=reset_phantom_step,
                operations=changes,
                progress=on_stderr(progress),
                notice=on_stderr(render.message_printer(screen)),
                verify="download" if verify == "download" else "store",
                **store,
                for_torch=for_torch,
            )
        with writes_to("stdout"):
            if json:
                render.print_json(render.fix_document(result))
            else:
                render.print_fix(result, screen)
        return ExitCode.OK

    run_command(command, screen, json=json)


@app.command(
    cls=Command,
    epilog=exit_codes({ExitCode.OK: "A and B hold the same state", ExitCode.REPAIRABLE: "A and B differ"}),
)
def diff(
    a: Annotated[
        str, typer.Argument(metavar="A", help="A checkpoint, as inspect takes it (a file, a directory, a store URL).")
    ],
    b: Annotated[str, typer.Argument(metavar="B", help="The checkpoint to compare A with, in any format.")],
    metadata_only: Annotated[
        bool,
        typer.Option(
            "--metadata-only",
            help="Compare names, dtypes, shapes and steps without reading tensor bytes.",
        ),
    ] = False,
    profile: ProfileOption = None,
    endpoint_url: EndpointOption = None,
    account: AccountOption = None,
    json: JsonFlag = False,
    quiet: QuietFlag = False,
    color: ColorOption = "auto",
) -> None:
    """Compare two checkpoints: optimizers by what they hold, every tensor bit for bit."""
    screen = make_screen(color, quiet)

    def command() -> int:
        store = StoreArgs(profile=profile, endpoint_url=endpoint_url, account=account)
        difference = api.diff(a, b, metadata_only=metadata_only, **store)
        with writes_to("stdout"):
            if json:
                render.print_json(render.diff_document(difference))
            else:
                render.print_diff(difference, screen)
        return ExitCode.OK if difference.same else ExitCode.REPAIRABLE

    run_command(command, screen, json=json)


@app.command(cls=Command, epilog=exit_codes({ExitCode.OK: "demo completed"}))
def demo(
    keep: Annotated[bool, typer.Option("--keep", help="Keep the demo's files instead of removing them.")] = False,
    quiet: QuietFlag = False,
    color: ColorOption = "auto",
) -> None:
    """Train a tiny model whose aux head never gets a gradient, then inspect, fix and resume it."""
    screen = make_screen(color, quiet)

    def command() -> int:
        from optim_repair.demo import run_demo

        report = run_demo(keep=keep, progress=on_stderr(render.message_printer(screen)))
        with writes_to("stdout"):
            render.print_demo(report, screen, kept=keep)
        fresh = [outcome for outcome in report.outcomes if outcome.fill == "fresh"]
        if not all(outcome.identical for outcome in fresh):
            message = "the fresh-state copy did not continue bit-identically; please report it"
            return fail(message, ExitCode.INTERNAL, "internal", None, False, screen)
        return ExitCode.OK

    run_command(command, screen, json=False)


def run() -> None:
    """Run the command line; ``optim_repair.console.main`` calls it once it handles the ending signals."""
    # torch warns on import when numpy is absent; nothing optim-repair does needs numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        app(prog_name="optim-repair")
    except Stopped as exc:  # while typer still parses the command line, before run_command
        signals.settle()
        kind, words = signals.ENDING[exc.signum]
        json = "--json" in sys.argv[1:]  # not parsed yet: asked for all the same
        fail(f"{words}; nothing was written", exc.exit_code, kind, None, json, render.Screen())
        raise SystemExit(exc.exit_code) from None
    except SystemExit as exc:
        if not isinstance(exc.__context__, BrokenPipeError):
            raise
        # click's answer to a closed pipe while it prints the help: exit 1, which would read as "repairable"
        signals.settle()
        raise SystemExit(ClosedPipe.exit_code) from None
