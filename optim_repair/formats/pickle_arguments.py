"""How the pickle scan reads the argument of an opcode that its loop does not read itself, within bounds.

``pickle_limits``' scan hands such an argument here (a line or two, a length and its bytes, an integer, a frame):
each is read as the unpickler would read it, and refused (``Refused``) where it would make the unpickler misread
the stream, allocate what the pickle does not hold, or convert an integer of unbounded length.
"""

from __future__ import annotations

import struct
from typing import Any

from optim_repair.formats import pickle_opcodes as opcodes

MAX_INT_BYTES = 256
"""The longest integer of LONG1 and LONG4, in bytes (LONG1's own limit: 255); ``pickle`` writes LONG4 for no
integer below 2**2040."""
MAX_INT_DIGITS = 620
"""The longest integer of INT and LONG, in characters (digits, a sign, and the ``L`` that LONG ends with)."""

_INDEXED = frozenset({opcodes.PUT, opcodes.GET})
"""The kinds whose argument is a memo index."""
U4 = struct.Struct("<I").unpack_from
U8 = struct.Struct("<Q").unpack_from


class Refused(Exception):
    """A refusal, with its reason."""


def argument(data: Any, pos: int, kind: int, arg: int) -> tuple[int, int]:
    """Skip an argument the scan's loop does not read; return the next opcode's start and a memo index (or
    length)."""
    if arg > opcodes.NUMBER:
        width = arg - opcodes.NUMBER
        if pos + width > len(data):
            raise Refused("it ends inside an opcode")
        digits: int = data[pos] if width == 1 else U4(data, pos)[0]
        if digits > MAX_INT_BYTES:
            raise Refused(f"it holds an integer of {digits} bytes, more than {MAX_INT_BYTES}")
        return pos + width + digits, 0
    if arg > opcodes.SIZED:
        width = arg - opcodes.SIZED
        if pos + width > len(data):
            raise Refused("it ends inside an opcode")
        length: int = data[pos] if width == 1 else U4(data, pos)[0] if width == 4 else U8(data, pos)[0]
        return pos + width + length, 0
    if arg > 0:
        if pos + arg > len(data):
            raise Refused("it ends inside an opcode")
        if kind == opcodes.FRAME:  # the unpickler reads a frame's declared length in one go: it must be there
            length = U8(data, pos)[0]
            if length > len(data) - pos - arg:
                raise Refused(f"it declares a frame of {length} bytes, more than it holds")
            return pos + arg, length
        return pos + arg, 0
    end = data.find(b"\n", pos)
    if end < 0:
        raise Refused("it ends inside an opcode")
    if arg == opcodes.NUMBER_LINE and end - pos > MAX_INT_DIGITS:
        raise Refused(f"it holds an integer of {end - pos} characters, more than {MAX_INT_DIGITS}")
    index = int(data[pos:end]) if kind in _INDEXED else 0
    if arg == opcodes.TWO_LINES:
        end = data.find(b"\n", end + 1)
        if end < 0:
            raise Refused("it ends inside an opcode")
    return end + 1, index


def past_frame(op_start: int, pos: int, frame_end: int, size: int) -> int:
    """Where the frame ends once an opcode (from ``op_start`` to ``pos``) ends past ``frame_end``: outside any."""
    if pos > size:
        raise Refused("it declares more bytes than it holds")
    if op_start < frame_end:  # the C unpickler would read the rest past the frame, and misread what follows
        raise Refused("an opcode crosses the end of its frame")
    return size


def begin_frame(op_start: int, pos: int, length: int, frame_end: int, size: int) -> int:
    """Where the frame begun by a FRAME opcode (from ``op_start`` to ``pos``) ends."""
    if op_start < frame_end:
        if pos > frame_end:
            raise Refused("an opcode crosses the end of its frame")
        if frame_end < size:
            raise Refused("it begins a frame inside another")
    return pos + length
