"""Everything the user sees: rich reports, a progress bar, and one JSON document for scripts.

``reports`` and ``progress_bar`` draw with rich; ``documents`` builds the JSON.

Results go to stdout; messages, progress and errors to stderr.
"""

from optim_repair.render.differences import (
    DiffDoc,
    FileDoc,
    KeyDoc,
    LeafDiffDoc,
    OptionChangeDoc,
    StepDoc,
    diff_document,
    print_diff,
)
from optim_repair.render.documents import (
    AddedDoc,
    AddedOptionDoc,
    ChangedDoc,
    DryRunDoc,
    ErrorDoc,
    FixDoc,
    InspectDoc,
    MalformedDoc,
    NoticeDoc,
    OptionDoc,
    ShapeMismatchDoc,
    SkippedDoc,
    dry_run_document,
    error_document,
    fix_document,
    inspect_document,
    print_json,
)
from optim_repair.render.progress_bar import progress_bar
from optim_repair.render.reports import print_demo, print_dry_run, print_fix, print_inspect
from optim_repair.render.schema import SCHEMA_VERSION
from optim_repair.render.terminal import Color, Screen, message_printer, print_error

__all__ = [
    "SCHEMA_VERSION",
    "AddedDoc",
    "AddedOptionDoc",
    "ChangedDoc",
    "Color",
    "DiffDoc",
    "DryRunDoc",
    "ErrorDoc",
    "FileDoc",
    "FixDoc",
    "InspectDoc",
    "KeyDoc",
    "LeafDiffDoc",
    "MalformedDoc",
    "NoticeDoc",
    "OptionChangeDoc",
    "OptionDoc",
    "Screen",
    "ShapeMismatchDoc",
    "SkippedDoc",
    "StepDoc",
    "diff_document",
    "dry_run_document",
    "error_document",
    "fix_document",
    "inspect_document",
    "message_printer",
    "print_demo",
    "print_diff",
    "print_dry_run",
    "print_error",
    "print_fix",
    "print_inspect",
    "print_json",
    "progress_bar",
]
