"""The one exception tree of optim-repair, whose classes carry the exit code and structured fields.

Every error a user can cause is an ``OptimRepairError``. It says *what* is wrong (``reason``),
*where* (``path``: a file, or a file and a place inside it), which argument it is about
(``argument``) and, when one argument would resolve it, *which* (``remedy``); foreign errors
(``OSError``, ``zipfile.BadZipFile``, ...) are translated where they are caught and kept as
``__cause__``. ``str(error)`` names arguments as Python keyword arguments; the CLI names them as
flags, in the one place that maps errors to messages.
"""

from __future__ import annotations

import enum
import errno
import os
import reprlib
from dataclasses import dataclass
from typing import Any, ClassVar


class ExitCode(enum.IntEnum):
    """Exit codes are part of the interface: documented in the README and docs/."""

    OK = 0
    REPAIRABLE = 1
    USAGE = 2
    MALFORMED = 3
    INPUT = 4
    OUTPUT = 5
    INTERNAL = 70
    """A bug in optim-repair (EX_SOFTWARE), never an input problem."""
    HUNG_UP = 129
    """SIGHUP (the terminal closed); nothing was written, or the copy was finished and is kept. Each signal's code
    is 128 plus its number."""
    INTERRUPTED = 130
    """Interrupted (Ctrl-C, SIGINT); nothing was written, or the copy was finished and is kept."""
    QUIT = 131
    """SIGQUIT (Ctrl-\\); nothing was written, or the copy was finished and is kept."""
    BROKEN_PIPE = 141
    """stdout or stderr is a pipe its reader closed (the exit code of SIGPIPE);
    nothing was written, or the copy was finished and is kept."""
    TERMINATED = 143
    """Terminated (SIGTERM); nothing was written, or the copy was finished and is kept."""


@dataclass(frozen=True)
class Remedy:
    """The argument of ``optim_repair.fix`` that would resolve an error, and how to give it.

    Library messages name it as a keyword argument (``pass optimizer=NAME``); the CLI names it as
    the flag of the same name (``pass --optimizer NAME``).
    """

    option: str
    """The keyword argument: ``optimizer``, ``model``, ``fill``, ``force``."""
    value: str = ""
    """What to pass (``fresh``); empty for a switch such as ``force``."""
    placeholder: bool = False
    """Whether ``value`` stands for what the user must supply (``NAME``, ``PATH``) rather than a literal."""
    note: str = ""
    """What follows, in words that fit either vocabulary: `` (one of: adam, adamw, ...)``."""

    def as_python(self) -> str:
        value = self.value if self.placeholder else repr(self.value) if self.value else "True"
        return f"pass {self.option}={value}{self.note}"


class _Bounded(reprlib.Repr):
    """``repr`` that stops after a few levels and items, and names objects of other types by type alone
    (their own ``repr`` could expand a structure of 2**60 shared parts)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 80, 80, 40
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = self.maxfrozenset = 6

    def repr_instance(self, x: Any, level: int) -> str:
        if x is None or isinstance(x, (bool, float, complex)):
            return repr(x)
        if isinstance(x, (bytes, bytearray)):
            return repr(x[: self.maxstring]) + ("..." if len(x) > self.maxstring else "")
        return f"<{type(x).__name__}>"


_BOUNDED = _Bounded()


def shown(value: object) -> str:
    """A value from the input, for a message: ``repr``, bounded in length and work, on one line."""
    text = _BOUNDED.repr(value)
    return text if text.isprintable() else text.encode("ascii", "backslashreplace").decode("ascii")


def shown_name(name: str) -> str:
    r"""A name from the input (a file, a parameter, a key), for a message: as it is, or its ``repr`` where it
    holds a character a terminal would act on or hide (a control, a bidi override, a newline) or a backslash.

    A name shown with a backslash is therefore always a ``repr``: in ``'a\\x1b'`` the name holds a backslash,
    in ``'a\x1b'`` an escape character.
    """
    return name if name.isprintable() and "\\" not in name else repr(name)


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun``, plural where the number is not one (``1 object``, ``2 objects``)."""
    return f"{number:,} {noun}" if number == 1 else f"{number:,} {noun}s"


def os_error_reason(exc: OSError) -> str:
    """What an OSError says, in the one wording every message uses (a full disk is said as such)."""
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return "the disk is full"
    return exc.strerror or str(exc)


class Stopped(BaseException):
    """A signal that ends the run came (``signals.ENDING``): raised by the console's handler as
    ``KeyboardInterrupt`` is, so that what the run began is undone on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode(128 + self.signum)


class OptimRepairError(Exception):
    """Base of every error optim-repair reports to a user."""

    exit_code: ClassVar[ExitCode] = ExitCode.INPUT
    code: ClassVar[str] = "input"
    """A stable name for the kind of error, for scripts (the JSON ``error.code``)."""

    def __init__(
        self,
        reason: str,
        *,
        path: str | os.PathLike[str] | None = None,
        argument: str | None = None,
        remedy: Remedy | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path = None if path is None else os.fspath(path)
        self.argument = argument
        """The keyword argument the reason is about (``optimizer``); ``{argument}`` in the reason names it."""
        self.remedy = remedy

    def __str__(self) -> str:
        return self.describe(self.argument or "", self.remedy.as_python() if self.remedy else "")

    def describe(self, argument: str, remedy: str) -> str:
        """The one-line message, with the argument's name and the remedy already worded."""
        text = self.reason.replace("{argument}", argument) if self.argument else self.reason
        text = f"{shown_name(self.path)}: {text}" if self.path else text
        text = f"{text}; {remedy}" if remedy else text
        return " ".join(text.splitlines())


class UsageError(OptimRepairError):
    """The call asks for something contradictory or impossible."""

    exit_code = ExitCode.USAGE
    code = "usage"


class InputError(OptimRepairError):
    """The input is missing, unreadable, not a checkpoint, or holds no optimizer state."""

    exit_code = ExitCode.INPUT
    code = "input"


class NotATorchFile(InputError):
    """The file is not a torch file at all (no zip archive with data.pkl, no legacy magic number)."""

    code = "not-a-torch-file"


class TorchRefuses(InputError):
    """torch's own loader (``torch.load(weights_only=True)``, ``dcp.load``) would refuse the input, as its metadata
    shows: no verdict is given on a checkpoint that cannot be resumed from."""

    code = "torch-refuses"

    def __init__(self, reason: str, **fields: Any) -> None:
        super().__init__(f"torch will refuse this file: {reason}", **fields)


class OutOfMemory(InputError):
    """Reading the input needs more memory than the process has left (under ``ulimit -v``, in a container): a
    file too large for the limit, never a bug. What a small file can make the tool allocate is bounded besides."""

    code = "out-of-memory"

    def __init__(self, **fields: Any) -> None:
        super().__init__("needs more memory than is left", **fields)


class UnsafeInputError(InputError):
    """The input would run code (or import a non-allowlisted global) if loaded."""

    code = "unsafe-input"

    def __init__(self, reason: str, *, global_name: str | None = None, **fields: Any) -> None:
        super().__init__(reason, **fields)
        self.global_name = global_name
        """The global refused (``deepspeed.runtime.fp16.loss_scaler.LossScaler``), when one was."""


class RepairRefused(OptimRepairError):
    """The checkpoint cannot be repaired as asked: it is malformed, or a fill cannot be built."""

    exit_code = ExitCode.MALFORMED
    code = "not-repairable"


class OutputError(OptimRepairError):
    """The output was refused or could not be written or verified; nothing was left behind."""

    exit_code = ExitCode.OUTPUT
    code = "output"


class StreamError(OutputError):
    """stdout or stderr is closed or cannot be written (a full disk, a terminal gone): the result did not
    reach the user, so a copy was not kept."""

    code = "stream"

    def __init__(self, stream: str, reason: str) -> None:
        super().__init__(f"cannot write to {stream} ({reason})")
        self.stream = stream


class ClosedPipe(StreamError):
    """stdout or stderr is a pipe whose reader closed it (``| head``): exit 141, as SIGPIPE would give."""

    exit_code = ExitCode.BROKEN_PIPE
    code = "broken-pipe"

    def __init__(self, stream: str) -> None:
        super().__init__(stream, "its reader closed the pipe")


class ObjectExists(OutputError):
    """A write that may replace nothing found an object where it was to write (another writer put it first)."""

    code = "exists"


class VerificationError(OutputError):
    """The written copy does not match the original where it must."""

    code = "verification-failed"
