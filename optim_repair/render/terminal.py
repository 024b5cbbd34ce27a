"""The terminal every report prints through: names from the input escaped, lines and tables wrapped whole.

With ``reports`` and ``progress_bar``, the only modules that import rich.
"""

from __future__ import annotations

import os
import shlex
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

from optim_repair.errors import shown_name
from optim_repair.records.inventory import ParamKey

SHOWN = 8


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


def new_table(console: Console, **options: Any) -> Table:
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


def print_table(console: Console, table: Table, rows: list[list[str]]) -> None:
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
        print_line(console, Shown(f"{row[0]}: {pairs}"), indent=0)


HANG = 2
"""How much further than its first line the later lines of a wrapped line are indented."""


def print_line(console: Console, text: Text, indent: int = 2) -> None:
    """One line of the report, indented; on a terminal wrapped between words, its later lines hanging ``HANG``
    columns further in than its first."""
    if console.soft_wrap:
        console.print(Shown(" " * indent) + text)
        return
    first = text.wrap(console, max(console.width - indent, 20))[0]
    rest = _after(text, len(first.plain))
    first.rstrip()
    console.print(Shown(" " * indent) + first)
    for line in rest.wrap(console, max(console.width - indent - HANG, 20)) if rest.plain else ():
        line.rstrip()
        console.print(Shown(" " * (indent + HANG)) + line)


def _after(text: Text, offset: int) -> Text:
    """What of ``text`` follows ``offset``, without the blanks it starts with, styles kept."""
    skipped = offset + len(text.plain[offset:]) - len(text.plain[offset:].lstrip())
    return text.divide([skipped])[-1] if skipped < len(text.plain) else Shown()


def print_command(console: Console, label: str, words: list[str]) -> None:
    """A command to run, after ``label``, quoted for the shell; on a terminal wrapped between its words, a
    backslash ending each line but the last and the later lines hanging, so that it still pastes whole."""
    first, *rest = [escaped(shlex.quote(word)) for word in words]  # a name from the input, as every name is shown
    lines = [Shown(label, style="bold") + Shown(first)]
    for word in rest:
        if console.soft_wrap or len(lines[-1]) + len(word) + 3 <= console.width:  # a blank, and room for " \\"
            lines[-1].append(f" {word}")
        else:
            lines[-1].append(" \\")
            lines.append(Shown(" " * (len(label) + HANG) + word))
    for line in lines:
        console.print(line, soft_wrap=True)


def name(key: ParamKey) -> str:
    """A name from the input as the reports show it (``shown_name``); an index as it is."""
    return shown_name(key) if isinstance(key, str) else str(key)


def listed(shown: list[str], count: int) -> str:
    """The first names of ``count``, already shown, and how many more there are."""
    return ", ".join(shown) + (f", … (+{count - SHOWN} more)" if count > SHOWN else "")


def shown_names(params: tuple[ParamKey, ...]) -> str:
    return listed([name(p) for p in params[:SHOWN]], len(params))


def human_bytes(count: int) -> str:
    """A size as people read it: ``512 B``, ``1.5 KiB``, ``2.0 GiB``."""
    if count < 1024:
        return f"{count} B"
    size = count / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def print_error(message: str, screen: Screen) -> None:
    print_line(screen.stderr(), Shown(f"optim-repair: error: {message}", style="bold red"), indent=0)


def message_printer(screen: Screen) -> Callable[[str], None]:
    """What prints lines of text for the user on stderr: nothing when quiet."""

    def show(message: str) -> None:
        if not screen.quiet:
            print_line(screen.stderr(), Shown(message, style="dim"), indent=0)

    return show
