"""The pickle opcodes as ``pickle_limits`` reads them, built from ``pickletools``' descriptions of them.

An ``OpcodeSet`` is the opcodes one reader implements: ``PICKLE``, every opcode of ``pickle`` (what
``pickle.load`` reads: a DCP ``.metadata``, and a DCP bytes entry, which ``dcp.load`` reads with
``weights_only=False``), and ``WEIGHTS_ONLY``, those torch's weights-only unpickler implements (what
``torch.load`` reads a torch file with). Its ``table[byte]`` is ``None`` for a byte it refuses (no opcode, or
one the reader does not implement), else the opcode's kind (what it does to the scan's stack: one of the kinds
below, assigned by the opcode's name), how its argument is encoded (from its ``ArgumentDescriptor``), how many
items it takes (its ``stack_before``) and which of those it hashes.
"""

from __future__ import annotations

import pickletools
from collections.abc import Sequence
from dataclasses import dataclass

(
    SCALAR, EMPTY, EMPTY_TUPLE, TUPLE_N, MARK, PUT, MEMOIZE, GET, STOP,  # handled in the scan's loop
    APPEND, REDUCE, PERSID, BUILD, POP, DUP, NOTHING, FRAME,  # by a method each
    TUPLE, FROM_MARK, EXTEND, POP_MARK,  # by a method each, given the items above the topmost mark
) = range(21)  # fmt: skip
KIND_NAMES = {
    SCALAR: "NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT UNICODE "
    "SHORT_BINUNICODE BINUNICODE BINUNICODE8 STRING BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES "
    "BINBYTES8 BYTEARRAY8 NEXT_BUFFER GLOBAL EXT1 EXT2 EXT4 PERSID",
    EMPTY: "EMPTY_LIST EMPTY_DICT EMPTY_SET",
    EMPTY_TUPLE: "EMPTY_TUPLE",
    TUPLE_N: "TUPLE1 TUPLE2 TUPLE3",
    MARK: "MARK",
    PUT: "PUT BINPUT LONG_BINPUT",
    MEMOIZE: "MEMOIZE",
    GET: "GET BINGET LONG_BINGET",
    STOP: "STOP",
    APPEND: "APPEND SETITEM",
    REDUCE: "REDUCE NEWOBJ NEWOBJ_EX",
    PERSID: "BINPERSID STACK_GLOBAL",
    BUILD: "BUILD",
    POP: "POP",
    DUP: "DUP",
    NOTHING: "PROTO READONLY_BUFFER",
    FRAME: "FRAME",
    TUPLE: "TUPLE",
    FROM_MARK: "LIST DICT FROZENSET OBJ INST",
    EXTEND: "APPENDS SETITEMS ADDITEMS",
    POP_MARK: "POP_MARK",
}
"""The opcodes of each kind (what it does to the scan's stack), by their names in ``pickletools``."""
_KINDS = {name: kind for kind, names in KIND_NAMES.items() for name in names.split()}
KEYS, EVERY = 2, 1
HASHES = {"DICT": KEYS, "SETITEMS": KEYS, "SETITEM": KEYS, "FROZENSET": EVERY, "ADDITEMS": EVERY}
"""The opcodes that hash what they take: every other item (the keys: ``KEYS``), or every one (``EVERY``)."""
LINE, TWO_LINES, NUMBER_LINE = -1, -2, -3
"""An argument of a line, of two (a module and a name), or of a line holding an integer (INT, LONG)."""
SIZED = 100
SHORT_SIZED = SIZED + 1
LONG_SIZED = SIZED + 4
"""An argument of ``SIZED + w``: a ``w``-byte little-endian length, then that many bytes."""
NUMBER = 110
"""An argument of ``NUMBER + w``: a ``w``-byte length, then that many bytes holding an integer (LONG1, LONG4)."""
_NUMBERS = frozenset({"INT", "LONG", "LONG1", "LONG4"})
_LENGTH_WIDTHS = {
    pickletools.TAKEN_FROM_ARGUMENT1: 1,
    pickletools.TAKEN_FROM_ARGUMENT4: 4,  # signed, read unsigned: a negative length is past the data's end
    pickletools.TAKEN_FROM_ARGUMENT4U: 4,
    pickletools.TAKEN_FROM_ARGUMENT8U: 8,
}


def encoding(arg: pickletools.ArgumentDescriptor | None, op_name: str) -> int:
    """How the scan reads the argument of opcode ``op_name``: none (0), ``n`` bytes, a line or two, or a length
    and its bytes (an integer's, which the scan bounds, apart)."""
    if arg is None:
        return 0
    if op_name in _NUMBERS:
        return NUMBER_LINE if arg.n == pickletools.UP_TO_NEWLINE else NUMBER + _LENGTH_WIDTHS[arg.n]
    if arg is pickletools.stringnl_noescape_pair:  # GLOBAL and INST: a module and a name
        return TWO_LINES
    if arg.n == pickletools.UP_TO_NEWLINE:
        return LINE
    return SIZED + _LENGTH_WIDTHS[arg.n] if arg.n < 0 else arg.n


def entry(op: pickletools.OpcodeInfo) -> tuple[int, int, int, int]:
    """An opcode's kind, its argument's encoding, how many items it takes, and which of them it hashes."""
    return _KINDS[op.name], encoding(op.arg, op.name), len(op.stack_before), HASHES.get(op.name, 0)


_KNOWN = {ord(op.code): op for op in pickletools.opcodes if op.name in _KINDS}
WEIGHTS_ONLY_NAMES = frozenset({
    "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK", "TUPLE", "TUPLE1",
    "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET",
    "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "BINPERSID", "BINGET",
    "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1", "PROTO", "STOP",
})  # fmt: skip
"""The opcodes ``torch/_weights_only_unpickler.py``'s ``Unpickler.load`` implements (torch 2.13); it raises
"Unsupported operand" for every other."""


@dataclass(frozen=True)
class OpcodeSet:
    """The opcodes one reader implements, as the scan reads them."""

    table: Sequence[tuple[int, int, int, int] | None]
    """Each opcode's entry (see ``entry``), by its byte; ``None`` for a byte refused."""
    refusals: tuple[str, ...]
    """Why each byte is refused, by its byte (for one the table admits: an empty string)."""
    packed: bytes
    """``table`` for the compiled scan (``_scan.c``, which numbers kinds and encodings as here): four bytes an
    opcode, its entry's, each a byte (negatives as two's complement; kind ``0xff`` for ``None``)."""


def _opcode_set(names: frozenset[str], reader: str) -> OpcodeSet:
    table = [entry(_KNOWN[code]) if code in _KNOWN and _KNOWN[code].name in names else None for code in range(256)]
    refusals = tuple(
        "" if found else
        f"it holds the opcode {_KNOWN[code].name} ({bytes([code])!r}), which {reader} does not implement"
        if code in _KNOWN else f"it holds the unknown opcode {bytes([code])!r}"
        for code, found in enumerate(table)
    )  # fmt: skip
    packed = b"".join(bytes(value & 0xFF for value in found or (-1, 0, 0, 0)) for found in table)
    return OpcodeSet(table, refusals, packed)


PICKLE = _opcode_set(frozenset(_KINDS), "pickle")
"""Every opcode of ``pickle`` (``KIND_NAMES``): what ``pickle.load`` reads."""
WEIGHTS_ONLY = _opcode_set(WEIGHTS_ONLY_NAMES, "torch's weights-only unpickler")
"""The opcodes of torch's weights-only unpickler: what ``torch.load`` reads a torch file with."""
