"""Bounding the work a pickle can cause, from its opcode stream, before any of it is unpickled.

CPython's C unpickler has no limits: a memo index of 2**28 allocates a 4 GiB memo, and a dict key
that is a deeply nested tuple (recursion while hashing: SIGSEGV) or a "billion laughs" tuple built
from memo references (2**60 leaves: hashing never ends) takes the process down. ``check_pickle``
decodes the opcodes itself (executing nothing), simulating the stack with a weight (leaves,
counting shared parts each time) and a depth for every object, and refuses:

* containers nested deeper than ``MAX_DEPTH``, or a tuple weighing more than ``MAX_WEIGHT``;
* more hashing than the pickle's own size justifies (dict keys, and the arguments of every call,
  weighed together, against ``HASH_BUDGET_PER_OP`` per opcode);
* a memo entry stored out of order (a memo index of 2**28), or a reference to one never stored;
* an opcode stream that ends early, underflows its stack, or declares more bytes than it holds (a
  string, or a frame: the unpickler allocates a frame's declared length before reading it);
* an opcode that crosses the end of its frame, or a frame begun inside another (the C unpickler
  reads what is past a frame from the file afresh, and misreads it: a memo index of 2**30).

Whatever it accepts, the unpickler finishes in time linear in the pickle's size. The depths it
computes are exact unless the pickle grows a container after taking it from the memo (which
``pickle`` never writes); ``scan`` then says so, and the caller measures the unpickled graph itself.
The decoder is a single loop over the bytes, about 0.5 µs an opcode.
"""

from __future__ import annotations

import io
import mmap
import struct
from collections.abc import Sequence
from typing import Any, BinaryIO

from optim_repair.errors import InputError

MAX_DEPTH = 100
"""How deeply containers may nest: a tuple's hash, and every recursive walk of the graph (comparison,
re-pickling), recurse into items; checkpoints nest a few levels."""
MAX_WEIGHT = 1 << 24
"""How many leaves, counting shared parts each time, one tuple may expand to."""
HASH_BUDGET_PER_OP = 32
"""Hashing work allowed per opcode read, beyond ``HASH_BUDGET_BASE``."""
HASH_BUDGET_BASE = 1 << 20

(
    _SCALAR, _EMPTY, _EMPTY_TUPLE, _TUPLE_N, _FROM_MARK, _APPEND, _EXTEND, _MARK, _POP, _POP_MARK,
    _DUP, _PUT, _MEMOIZE, _GET, _REDUCE, _PERSID, _NOTHING, _STOP, _BUILD, _FRAME,
) = range(20)  # fmt: skip
_INDEXED = frozenset({_PUT, _GET, _FRAME})
_LINE, _TWO_LINES = -1, -2
_SIZED = 100
_SHORT_SIZED = _SIZED + 1
_LONG_SIZED = _SIZED + 4
"""An argument of ``_SIZED + w``: a ``w``-byte little-endian length, then that many bytes."""

_OPCODES: dict[bytes, tuple[int, int, int]] = {}
"""Each opcode: what it does to the stack, how its argument is encoded, and how many items it takes."""
for _codes, _kind, _arg in (
    (b"I L S V F P", _SCALAR, _LINE),
    (b"c", _SCALAR, _TWO_LINES),
    (b"J \x84", _SCALAR, 4),
    (b"K \x82", _SCALAR, 1),
    (b"M \x83", _SCALAR, 2),
    (b"G", _SCALAR, 8),
    (b"N \x88 \x89 \x97", _SCALAR, 0),
    (b"\x8a U C \x8c", _SCALAR, _SIZED + 1),
    (b"\x8b T B X", _SCALAR, _SIZED + 4),
    (b"\x8e \x96 \x8d", _SCALAR, _SIZED + 8),
    (b"] } \x8f", _EMPTY, 0),
    (b")", _EMPTY_TUPLE, 0),
    (b"t l d \x91 o", _FROM_MARK, 0),
    (b"i", _FROM_MARK, _TWO_LINES),
    (b"a s", _APPEND, 0),
    (b"b", _BUILD, 0),
    (b"e u \x90", _EXTEND, 0),
    (b"(", _MARK, 0),
    (b"0", _POP, 0),
    (b"1", _POP_MARK, 0),
    (b"2", _DUP, 0),
    (b"p", _PUT, _LINE),
    (b"q", _PUT, 1),
    (b"r", _PUT, 4),
    (b"\x94", _MEMOIZE, 0),
    (b"g", _GET, _LINE),
    (b"h", _GET, 1),
    (b"j", _GET, 4),
    (b"R \x81 \x92", _REDUCE, 0),
    (b"Q \x93", _PERSID, 0),
    (b"\x80", _NOTHING, 1),
    (b"\x95", _FRAME, 8),
    (b"\x98", _NOTHING, 0),
    (b".", _STOP, 0),
):
    for _code in _codes.split(b" "):
        _OPCODES[_code] = (_kind, _arg, 0)
for _code, _count in ((b"\x85", 1), (b"\x86", 2), (b"\x87", 3)):
    _OPCODES[_code] = (_TUPLE_N, 0, _count)
_TABLE: Sequence[tuple[int, int, int] | None] = [_OPCODES.get(bytes([byte])) for byte in range(256)]
_HASHES_KEYS = frozenset(b"du")  # DICT and SETITEMS hash every other item; FROZENSET and ADDITEMS all
_HASHES_ALL = frozenset(b"\x91\x90")
_U4 = struct.Struct("<I").unpack_from
_U8 = struct.Struct("<Q").unpack_from


class _Refused(Exception):
    pass


def _underflow() -> _Refused:
    return _Refused("its stack underflows")


def _over_budget(hashed: int, ops: int) -> None:
    if hashed > HASH_BUDGET_BASE + HASH_BUDGET_PER_OP * ops:
        raise _Refused("it asks for more hashing than its size justifies (a billion-laughs structure)")


def _new_tuple(items: list[Any]) -> list[Any]:
    weight, depth = 1, 0
    for item in items:
        weight += item[0]
        if item[1] > depth:
            depth = item[1]
    if depth >= MAX_DEPTH:
        raise _Refused(f"it nests containers more than {MAX_DEPTH} deep")
    if weight > MAX_WEIGHT:
        raise _Refused(f"a tuple expands to more than {MAX_WEIGHT} items (a billion-laughs structure)")
    return [weight, depth + 1, items, False]


def _grow(container: list[Any], items: list[Any]) -> bool:
    """Add ``items`` to a container's record; return whether it was taken from the memo (its depth in
    the records of containers holding it may now be stale)."""
    weight, depth = container[0], container[1]
    for item in items:
        weight += item[0]
        if item[1] >= depth:
            depth = item[1] + 1
    if depth > MAX_DEPTH:
        raise _Refused(f"it nests containers more than {MAX_DEPTH} deep")
    container[0], container[1] = min(weight, MAX_WEIGHT + 1), depth
    return bool(container[3])


def _argument(data: Any, pos: int, kind: int, arg: int) -> tuple[int, int]:
    """Skip an opcode's argument; return where the next opcode starts, and a memo index for PUT and GET
    (a frame's length for FRAME)."""
    if arg > _SIZED:
        width = arg - _SIZED
        if pos + width > len(data):
            raise _Refused("it ends inside an opcode")
        length: int = data[pos] if width == 1 else _U4(data, pos)[0] if width == 4 else _U8(data, pos)[0]
        return pos + width + length, 0
    if arg > 0:
        if pos + arg > len(data):
            raise _Refused("it ends inside an opcode")
        if kind == _FRAME:  # the unpickler reads a frame's declared length in one go: it must be there
            length = _U8(data, pos)[0]
            if length > len(data) - pos - arg:
                raise _Refused(f"it declares a frame of {length} bytes, more than it holds")
            return pos + arg, length
        return pos + arg, _U4(data, pos)[0] if kind in _INDEXED and arg == 4 else 0
    end = data.find(b"\n", pos)
    if end < 0:
        raise _Refused("it ends inside an opcode")
    index = int(data[pos:end]) if kind in _INDEXED else 0
    if arg == _TWO_LINES:
        end = data.find(b"\n", end + 1)
        if end < 0:
            raise _Refused("it ends inside an opcode")
    return end + 1, index


def scan(data: Any, pos: int = 0) -> tuple[int, bool]:
    """Check the pickle that starts at ``pos`` in ``data`` (bytes or mmap); return where it ends, and
    whether it grows a container taken from the memo (its depths may be stale)."""
    size = len(data)
    table, u4 = _TABLE, _U4
    scalar_kind, memoize_kind, get_kind, put_kind = _SCALAR, _MEMOIZE, _GET, _PUT
    mark_kind, tuple_kind, empty_kind, empty_tuple_kind = _MARK, _TUPLE_N, _EMPTY, _EMPTY_TUPLE
    stack: list[Any] = []
    marks: list[int] = [0]  # the stack's floor: marks[-1]
    memo: list[Any] = []  # pickle numbers memo entries in order; a gap is refused
    scalar: list[Any] = [1, 0, None, False]
    ops = hashed = 0
    stale = False
    frame_end = size  # where the frame being read ends; the data's end outside one
    while pos < size:
        op_start = pos
        code = data[pos]
        entry = table[code]
        if entry is None:
            raise _Refused(f"it holds the unknown opcode {bytes([code])!r}")
        kind, arg, count = entry
        ops += 1
        pos += 1
        if arg:
            if arg == 1:  # BINPUT, BINGET, BININT1, PROTO
                index = data[pos] if pos < size else 0
                pos += 1
            elif arg == 4:  # LONG_BINPUT, LONG_BINGET, BININT
                index = u4(data, pos)[0] if pos + 4 <= size else 0
                pos += 4
            elif arg == _SHORT_SIZED:  # SHORT_BINUNICODE, SHORT_BINBYTES, SHORT_BINSTRING, LONG1
                pos += 1 + (data[pos] if pos < size else 0)
            elif arg == _LONG_SIZED:  # BINUNICODE, BINBYTES, BINSTRING, LONG4
                pos += 4 + (u4(data, pos)[0] if pos + 4 <= size else 0)
            else:
                pos, index = _argument(data, pos, kind, arg)
            if pos > size:
                raise _Refused("it declares more bytes than it holds")
            if pos > frame_end:  # the C unpickler would read the rest past the frame, and misread what follows
                if op_start < frame_end:
                    raise _Refused("an opcode crosses the end of its frame")
                frame_end = size
            if kind == _FRAME:
                if op_start < frame_end < size:
                    raise _Refused("it begins a frame inside another")
                frame_end = pos + index
        # The most frequent kinds first. An empty stack where an item is needed is an IndexError (refused
        # by check_pickle); an item below a mark is the unpickler's own error, reached before any work.
        if kind == scalar_kind:
            stack.append(scalar)
        elif kind == memoize_kind:
            memo.append(stack[-1])
        elif kind == get_kind:
            if index >= len(memo):
                raise _Refused(f"it refers to memo entry {index}, which it never stored")
            record = memo[index]
            if record is not scalar:
                record[3] = True
            stack.append(record)
        elif kind == put_kind:
            if index == len(memo):
                memo.append(stack[-1])
            elif index < len(memo):
                memo[index] = stack[-1]
            else:  # what pickle never writes, and what would make the unpickler allocate a memo of index entries
                raise _Refused(f"it stores memo entry {index} when it holds {len(memo)}")
        elif kind == mark_kind:
            marks.append(len(stack))
        elif kind == tuple_kind:
            start = len(stack) - count
            if start < marks[-1]:
                raise _underflow()
            items = stack[start:]
            del stack[start:]
            stack.append(_new_tuple(items))
        elif kind == empty_kind:
            stack.append([1, 1, None, False])
        elif kind == empty_tuple_kind:
            stack.append([1, 1, [], False])
        elif kind == _BUILD:  # the state of the object below it: it may hash the state's keys
            state = stack.pop()
            hashed += state[0]
            if hashed > HASH_BUDGET_BASE + HASH_BUDGET_PER_OP * ops:
                _over_budget(hashed, ops)
            container = stack[-1]
            if container is not scalar:
                if state[1] >= container[1]:
                    if state[1] >= MAX_DEPTH:
                        raise _Refused(f"it nests containers more than {MAX_DEPTH} deep")
                    container[1] = state[1] + 1
                container[0] = min(container[0] + state[0], MAX_WEIGHT + 1)
                stale = stale or container[3]
        elif kind == _REDUCE:
            taken = 3 if code == 0x92 else 2  # NEWOBJ_EX takes keyword arguments too
            if len(stack) - taken < marks[-1]:
                raise _underflow()
            args = stack[1 - taken]
            parts = args[2]
            if parts:
                hashed += 1
                for part in parts:
                    hashed += part[0]
            else:
                hashed += args[0]
            if taken == 3:
                hashed += stack[-1][0]
            if hashed > HASH_BUDGET_BASE + HASH_BUDGET_PER_OP * ops:
                _over_budget(hashed, ops)
            if args[1] >= MAX_DEPTH:
                raise _Refused(f"it nests containers more than {MAX_DEPTH} deep")
            del stack[-taken:]
            stack.append([1, args[1] + 1, None, False])
        elif kind in (_FROM_MARK, _EXTEND):
            if len(marks) == 1:
                raise _Refused("it pops a mark it never set")
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            if code in _HASHES_KEYS:
                hashed += sum(item[0] for item in items[0::2])
            elif code in _HASHES_ALL:
                hashed += sum(item[0] for item in items)
            _over_budget(hashed, ops)
            if code == 0x74:  # TUPLE
                stack.append(_new_tuple(items))
            elif kind == _FROM_MARK:
                record = [1, 1, None, False]
                _grow(record, items)
                stack.append(record)
            elif len(stack) <= marks[-1]:
                raise _underflow()
            elif stack[-1] is not scalar:
                stale = _grow(stack[-1], items) or stale
        elif kind == _APPEND:
            taken = 2 if code == 0x73 else 1  # SETITEM takes a key and a value
            if len(stack) - taken <= marks[-1]:
                raise _underflow()
            items = stack[-taken:]
            del stack[-taken:]
            if code == 0x73:  # SETITEM hashes its key
                hashed += items[0][0]
                _over_budget(hashed, ops)
            if stack[-1] is not scalar:
                stale = _grow(stack[-1], items) or stale
        elif kind == _PERSID:
            taken = 2 if code == 0x93 else 1  # STACK_GLOBAL takes a module and a name
            if len(stack) - taken < marks[-1]:
                raise _underflow()
            del stack[-taken:]
            stack.append(scalar)
        elif kind == _POP:
            if len(marks) > 1 and marks[-1] == len(stack):
                marks.pop()
            elif len(stack) > marks[-1]:
                stack.pop()
            else:
                raise _underflow()
        elif kind == _POP_MARK:
            if len(marks) == 1:
                raise _Refused("it pops a mark it never set")
            del stack[marks.pop() :]
        elif kind == _DUP:
            if len(stack) <= marks[-1]:
                raise _underflow()
            if stack[-1] is not scalar:
                stack[-1][3] = True
            stack.append(stack[-1])
        elif kind == _STOP:
            if len(stack) != 1 or len(marks) != 1:
                raise _Refused("it stops with other than one object on its stack")
            return pos, stale
    raise _Refused("it ends without a STOP opcode")


def check_pickle(stream: BinaryIO, source: str, what: str = "pickle") -> bool:
    """Refuse, with ``InputError``, a pickle whose unpickling could crash, hang or exhaust memory.

    Checks the one pickle that starts at ``stream``'s position, and leaves the position there.
    Returns whether the depths it checked may be stale (see ``scan``).
    """
    start = stream.tell()
    try:
        if isinstance(stream, io.BytesIO):
            return scan(stream.getbuffer().tobytes(), start)[1]
        with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return scan(data, start)[1]
    except _Refused as exc:
        raise InputError(f"not a readable {what} ({exc})", path=source) from None
    except IndexError:
        raise InputError(f"not a readable {what} (its stack underflows)", path=source) from None
    except (ValueError, OverflowError, struct.error, OSError) as exc:
        reason = " ".join(str(exc).split())
        raise InputError(f"not a readable {what} ({type(exc).__name__}: {reason})", path=source) from exc
    finally:
        stream.seek(start)
