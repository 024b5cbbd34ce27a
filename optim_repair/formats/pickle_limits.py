"""Bounding the work a pickle can cause, from its opcode stream, before any of it is unpickled.

CPython's C unpickler has no limits: a memo index of 2**28 allocates a 4 GiB memo, and a dict key
that is a deeply nested tuple (recursion while hashing: SIGSEGV) or a "billion laughs" tuple built
from memo references (2**60 leaves: hashing never ends) takes the process down. ``check_pickle``
decodes the opcodes itself (executing nothing), simulating the stack with a weight (leaves,
counting shared parts each time) and a depth for every object, and refuses:

* an opcode outside the set its reader implements (``pickle_opcodes``: torch's weights-only unpickler reads a
  torch file, ``pickle`` a DCP ``.metadata`` or bytes entry);
* containers nested deeper than ``MAX_DEPTH``, or a tuple weighing more than ``MAX_WEIGHT``;
* more objects alive at once (on its stack, its marks and its memo) than ``MAX_LIVE`` and one per
  ``LIVE_BYTES`` bytes of it (checked every ``LIVE_CHECK_OPS`` opcodes): the scan's memory, and the
  unpickler's stack and memo, stay proportional to the pickle's size;
* an integer of more than ``pickle_arguments.MAX_INT_BYTES`` bytes, or ``MAX_INT_DIGITS`` characters of text
  (its conversion, and any printing of it, stays cheap: Python refuses to print one of more than 4,300 digits);
* more hashing than the pickle's own size justifies (dict keys, and the arguments of every call,
  weighed together, against ``HASH_BUDGET_PER_OP`` per opcode);
* a memo entry stored out of order (a memo index of 2**28), or a reference to one never stored;
* an opcode stream that ends early, underflows its stack, or declares more bytes than it holds (a
  string, or a frame: the unpickler allocates a frame's declared length before reading it);
* an opcode that crosses the end of its frame, or a frame begun inside another (the C unpickler
  reads what is past a frame from the file afresh, and misreads it: a memo index of 2**30).

Whatever it accepts, the unpickler finishes in time linear in the pickle's size. The depths it
computes are exact unless the pickle makes a container deeper after taking it from the memo (which
``pickle`` never writes); ``scan`` then says so, and the caller measures the unpickled graph itself.
The decoder is one loop over the bytes, handing the rarer opcodes to a method each (about 0.5 µs an opcode).
``_scan.c`` is it compiled, which ``scan`` runs where built unless ``OPTIM_REPAIR_PURE_PYTHON=1`` (``SCANNER``).
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

from optim_repair.errors import InputError
from optim_repair.formats import pickle_arguments
from optim_repair.formats import pickle_opcodes as opcodes
from optim_repair.formats.pickle_arguments import U4, Refused, argument, begin_frame, past_frame

try:
    from optim_repair.formats import _scan as _compiled
except ImportError:  # not built (no C compiler where it was installed): the Python scan alone
    _compiled = None  # type: ignore[assignment]

MAX_DEPTH = 100
"""How deeply containers may nest: a tuple's hash, and every recursive walk of the graph (comparison,
re-pickling), recurse into items; checkpoints nest a few levels."""
MAX_WEIGHT = 1 << 24
"""How many leaves, counting shared parts each time, one tuple may expand to."""
HASH_BUDGET_PER_OP = 32
"""Hashing work allowed per opcode read, beyond ``HASH_BUDGET_BASE``."""
HASH_BUDGET_BASE = 1 << 20
MAX_LIVE = 1 << 20
LIVE_BYTES = 4
"""Objects alive at once: at most ``MAX_LIVE`` and one per ``LIVE_BYTES`` bytes of the pickle (from its start to
the data's end). torch's pickles keep about one memo entry per 10 to 12 bytes."""
LIVE_CHECK_OPS = 1 << 16
"""How often (in opcodes read) the objects alive are counted: between two counts they grow by at most this."""
_Record = list[Any]
"""What the scan knows of an object on its stack or in its memo: four fields, read by the indices below."""
_WEIGHT, _DEPTH, _PARTS, _SHARED = range(4)
"""A record's leaves, counting shared parts each time (at most ``MAX_WEIGHT + 1`` in a container); how deeply
containers nest in it (0 for a scalar); a tuple's items (``None`` for anything else: a call's arguments are
weighed by them); and whether it was taken from the memo or duplicated (deepening it may leave depths stale)."""
_LEAF: _Record = [1, 0, None, False]
"""Every scalar's record (never changed: nothing grows or shares a scalar)."""


def _underflow() -> Refused:
    return Refused("its stack underflows")


def _too_deep() -> Refused:
    return Refused(f"it nests containers more than {MAX_DEPTH} deep")


def _too_many(live: int) -> Refused:
    return Refused(
        f"it holds more than {live} objects at once on its stack and in its memo (at most {MAX_LIVE} and one per "
        f"{LIVE_BYTES} bytes of it)"
    )


def _over_budget() -> Refused:
    return Refused("it asks for more hashing than its size justifies (a billion-laughs structure)")


def _new_tuple(items: list[_Record]) -> _Record:
    weight, depth = 1, 0
    for item in items:
        weight += item[_WEIGHT]
        if item[_DEPTH] > depth:
            depth = item[_DEPTH]
    if depth >= MAX_DEPTH:
        raise _too_deep()
    if weight > MAX_WEIGHT:
        raise Refused(f"a tuple expands to more than {MAX_WEIGHT} items (a billion-laughs structure)")
    return [weight, depth + 1, items, False]


def _grow(container: _Record, items: list[_Record]) -> bool:
    """Add ``items`` to a container's record; return whether it was taken from the memo and is now deeper (its
    depth in the records of containers holding it may be stale)."""
    weight, depth = container[_WEIGHT], container[_DEPTH]
    for item in items:
        weight += item[_WEIGHT]
        if item[_DEPTH] >= depth:
            depth = item[_DEPTH] + 1
    if depth > MAX_DEPTH:
        raise _too_deep()
    deeper = depth > container[_DEPTH]
    container[_WEIGHT], container[_DEPTH] = min(weight, MAX_WEIGHT + 1), depth
    return deeper and bool(container[_SHARED])


class _Scan:
    """One pickle's scan: its stack of records, the stack's marks and its memo, and the hashing it asks for.

    ``run`` reads the opcodes and handles the most frequent kinds itself, and hands each other kind to
    a method below, with the opcode's entry (the items it takes, or those above the topmost mark; which
    it hashes) and the number of opcodes read. An empty stack where an item is needed is an IndexError
    (refused by ``check_pickle``); an item below a mark is the unpickler's own error, met before any work.
    """

    __slots__ = ("hashed", "marks", "memo", "stack", "stale")

    def __init__(self) -> None:
        self.stack: list[_Record] = []
        self.marks = [0]  # the stack's floor: marks[-1]
        self.memo: list[_Record] = []  # pickle numbers memo entries in order; a gap is refused
        self.hashed = 0
        self.stale = False

    def run(self, data: Any, pos: int, allowed: opcodes.OpcodeSet) -> tuple[int, bool]:
        size, table, u4, leaf, handlers = len(data), allowed.table, U4, _LEAF, _HANDLERS
        live, check_ops = MAX_LIVE + max(size - pos, 0) // LIVE_BYTES, LIVE_CHECK_OPS
        count_at = check_ops  # the next count of the objects alive: every check_ops opcodes
        short_sized, long_sized, frame_kind = opcodes.SHORT_SIZED, opcodes.LONG_SIZED, opcodes.FRAME
        scalar_kind, memoize_kind, get_kind, put_kind = opcodes.SCALAR, opcodes.MEMOIZE, opcodes.GET, opcodes.PUT
        mark_kind, tuple_kind, empty_kind, stop_kind = opcodes.MARK, opcodes.TUPLE_N, opcodes.EMPTY, opcodes.STOP
        empty_tuple_kind, marked_kind = opcodes.EMPTY_TUPLE, opcodes.TUPLE
        stack, marks, memo = self.stack, self.marks, self.memo
        ops = 0
        frame_end = size  # where the frame being read ends; the data's end outside one
        # Not `while pos < size`: that loop ends in a conditional backward jump, and CPython 3.11 specialises
        # a function's bytecode only after 8 calls or 8 unconditional backward jumps, so the one call a scan
        # makes would run unspecialised, 20-25% slower.
        while True:
            if pos >= size:
                raise Refused("it ends without a STOP opcode")
            op_start = pos
            entry = table[data[pos]]
            if entry is None:
                raise Refused(allowed.refusals[data[pos]])
            kind, arg, count, hashes = entry
            ops += 1
            if ops == count_at:
                if len(stack) + len(marks) + len(memo) > live:
                    raise _too_many(live)
                count_at += check_ops
            pos += 1
            if arg:
                if arg == 1:  # BINPUT, BINGET, BININT1, PROTO
                    index = data[pos] if pos < size else 0
                    pos += 1
                elif arg == 4:  # LONG_BINPUT, LONG_BINGET, BININT
                    index = u4(data, pos)[0] if pos + 4 <= size else 0
                    pos += 4
                elif arg == short_sized:  # SHORT_BINUNICODE, SHORT_BINBYTES, SHORT_BINSTRING, LONG1
                    pos += 1 + (data[pos] if pos < size else 0)
                elif arg == long_sized:  # BINUNICODE, BINBYTES, BINSTRING, LONG4
                    pos += 4 + (u4(data, pos)[0] if pos + 4 <= size else 0)
                else:
                    pos, index = argument(data, pos, kind, arg)
                    if kind == frame_kind:
                        frame_end = begin_frame(op_start, pos, index, frame_end, size)
                if pos > frame_end:
                    frame_end = past_frame(op_start, pos, frame_end, size)
            if kind == scalar_kind:
                stack.append(leaf)
            elif kind == memoize_kind:
                memo.append(stack[-1])
            elif kind == get_kind:
                if index >= len(memo):
                    raise Refused(f"it refers to memo entry {index}, which it never stored")
                record = memo[index]
                if record is not leaf:
                    record[_SHARED] = True
                stack.append(record)
            elif kind == put_kind:
                if index == len(memo):
                    memo.append(stack[-1])
                elif index < len(memo):
                    memo[index] = stack[-1]
                else:  # what pickle never writes, and what would make the unpickler allocate a memo of index entries
                    raise Refused(f"it stores memo entry {index} when it holds {len(memo)}")
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
            elif kind == stop_kind:
                if len(stack) != 1 or len(marks) != 1:
                    raise Refused("it stops with other than one object on its stack")
                return pos, self.stale
            elif kind < marked_kind:
                handlers[kind](self, count, hashes, ops)
            elif len(marks) == 1:
                raise Refused("it pops a mark it never set")
            else:
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                handlers[kind](self, items, hashes, ops)

    def _tuple(self, items: list[_Record], hashes: int, ops: int) -> None:
        """TUPLE: a tuple of the items above the mark."""
        self.stack.append(_new_tuple(items))

    def _from_mark(self, items: list[_Record], hashes: int, ops: int) -> None:
        """LIST, DICT, FROZENSET: a container of the items above the mark; OBJ, INST: an object made of them."""
        if hashes:
            self.hashed += sum(item[_WEIGHT] for item in items[::hashes])
            if self.hashed > HASH_BUDGET_BASE + HASH_BUDGET_PER_OP * ops:
                raise _over_budget()
        record = [1, 1, None, False]
        _grow(record, items)
        self.stack.append(record)

    def _extend(self, items: list[_Record], hashes: int, ops: int) -> None:
        """APPENDS, SETITEMS, ADDITEMS: the items above the mark, added to the container below it."""
        if hashes:
            self.hashed += sum(item[_WEIGHT] for item in items[::hashes])
            if self.hashed > HASH_BUDGET_BASE + HASH_BUDGET_PER_OP * ops:
                raise _over_budget()
        if len(self.stack) <= self.marks[-1]:
            raise _underflow()
        if self.stack[-1] is not _LEAF:
            self.stale = _grow(self.stack[-1], items) or self.stale

    def _append(self, count: int, hashes: int, ops: int) -> None:
        """APPEND, SETITEM: an item, or a key and a value, added to the container below them."""
        stack = self.stack
        taken = count - 1  # the container stays
        if len(stack) - taken <= self.marks[-1]:
            raise _underflow()
        items = stack[-taken:]
        del stack[-taken:]
        if hashes:  # SETITEM hashes its key
            self.hashed += items[0][_WEIGHT]
            if self.hashed > HASH_BUDGET_BASE + HASH_BUDGET_PER_OP * ops:
                raise _over_budget()
        if stack[-1] is not _LEAF:
            self.stale = _grow(stack[-1], items) or self.stale

    def _reduce(self, count: int, hashes: int, ops: int) -> None:
        """REDUCE, NEWOBJ, NEWOBJ_EX: a call, which hashes its arguments (NEWOBJ_EX's keyword ones too)."""
        stack = self.stack
        if len(stack) - count < self.marks[-1]:
            raise _underflow()
        args = stack[1 - count]
        parts = args[_PARTS]
        if parts:
            self.hashed += 1
            for part in parts:
                self.hashed += part[_WEIGHT]
        else:
            self.hashed += args[_WEIGHT]
        if count == 3:
            self.hashed += stack[-1][_WEIGHT]
        if self.hashed > HASH_BUDGET_BASE + HASH_BUDGET_PER_OP * ops:
            raise _over_budget()
        if args[_DEPTH] >= MAX_DEPTH:
            raise _too_deep()
        del stack[-count:]
        stack.append([1, args[_DEPTH] + 1, None, False])

    def _build(self, count: int, hashes: int, ops: int) -> None:
        """BUILD: the state of the object below it, which may hash the state's keys."""
        state = self.stack.pop()
        self.hashed += state[_WEIGHT]
        if self.hashed > HASH_BUDGET_BASE + HASH_BUDGET_PER_OP * ops:
            raise _over_budget()
        container = self.stack[-1]
        if container is not _LEAF:
            if state[_DEPTH] >= container[_DEPTH]:
                if state[_DEPTH] >= MAX_DEPTH:
                    raise _too_deep()
                container[_DEPTH] = state[_DEPTH] + 1
                self.stale = self.stale or container[_SHARED]
            container[_WEIGHT] = min(container[_WEIGHT] + state[_WEIGHT], MAX_WEIGHT + 1)

    def _persid(self, count: int, hashes: int, ops: int) -> None:
        """BINPERSID, STACK_GLOBAL: an object named by the items taken (an id; a module and a name)."""
        if len(self.stack) - count < self.marks[-1]:
            raise _underflow()
        del self.stack[-count:]
        self.stack.append(_LEAF)

    def _pop(self, count: int, hashes: int, ops: int) -> None:
        """POP: the topmost item, or the topmost mark where no item is above it."""
        if len(self.marks) > 1 and self.marks[-1] == len(self.stack):
            self.marks.pop()
        elif len(self.stack) > self.marks[-1]:
            self.stack.pop()
        else:
            raise _underflow()

    def _dup(self, count: int, hashes: int, ops: int) -> None:
        """DUP: the topmost item, shared."""
        if len(self.stack) <= self.marks[-1]:
            raise _underflow()
        if self.stack[-1] is not _LEAF:
            self.stack[-1][_SHARED] = True
        self.stack.append(self.stack[-1])

    def _nothing(self, taken: object, hashes: int, ops: int) -> None:
        """PROTO, READONLY_BUFFER, FRAME (read with its argument); POP_MARK (the items above the mark, dropped)."""


_Handler = Callable[[_Scan, Any, int, int], None]
_METHODS: dict[int, _Handler] = {
    opcodes.APPEND: _Scan._append,
    opcodes.REDUCE: _Scan._reduce,
    opcodes.PERSID: _Scan._persid,
    opcodes.BUILD: _Scan._build,
    opcodes.POP: _Scan._pop,
    opcodes.DUP: _Scan._dup,
    opcodes.TUPLE: _Scan._tuple,
    opcodes.FROM_MARK: _Scan._from_mark,
    opcodes.EXTEND: _Scan._extend,
}
_HANDLERS: Sequence[_Handler] = [_METHODS.get(kind, _Scan._nothing) for kind in range(opcodes.POP_MARK + 1)]
"""The method that handles each kind, by kind (``_nothing`` for those that ``_Scan.run`` handles itself)."""


def scan_python(data: Any, pos: int = 0, allowed: opcodes.OpcodeSet = opcodes.PICKLE) -> tuple[int, bool]:
    """``scan`` in Python, on bytes or an mmap: the reference for ``scan_compiled``."""
    return _Scan().run(data, pos, allowed)


def scan_compiled(data: Any, pos: int = 0, allowed: opcodes.OpcodeSet = opcodes.PICKLE) -> tuple[int, bool]:
    """``scan`` compiled, on any buffer: ``scan_python``'s results and refusals (where ``_scan.c`` was built)."""
    limits = MAX_DEPTH, MAX_WEIGHT, HASH_BUDGET_BASE, HASH_BUDGET_PER_OP, MAX_LIVE, LIVE_BYTES, LIVE_CHECK_OPS
    integers = pickle_arguments.MAX_INT_BYTES, pickle_arguments.MAX_INT_DIGITS
    return _compiled.scan(data, pos, allowed.packed, allowed.refusals, Refused, *limits, *integers)


SCANNER = "compiled" if _compiled and os.environ.get("OPTIM_REPAIR_PURE_PYTHON") != "1" else "pure-python"


def scan(data: Any, pos: int = 0, allowed: opcodes.OpcodeSet = opcodes.PICKLE) -> tuple[int, bool]:
    """Check the pickle that starts at ``pos`` in ``data`` (bytes or mmap), of the opcodes ``allowed``; return
    where it ends, and whether it grows a container taken from the memo (its depths may be stale)."""
    return scan_compiled(data, pos, allowed) if SCANNER == "compiled" else scan_python(data, pos, allowed)


def check_pickle(
    stream: io.BytesIO, source: str, what: str = "pickle", allowed: opcodes.OpcodeSet = opcodes.PICKLE
) -> bool:
    """Refuse, with ``InputError``, a pickle whose unpickling could crash, hang or exhaust memory.

    Checks the one pickle that starts at ``stream``'s position, of the opcodes ``allowed`` (by default every
    opcode of ``pickle``), and leaves the position there: in memory, so that what is checked is what is unpickled
    (a file's pickle is read first: ``pickle_reading``).
    Returns whether the depths it checked may be stale (see ``scan``).
    """
    start = stream.tell()
    try:
        return scan(stream.getvalue(), start, allowed)[1]  # the bytes it was made from: no copy
    except Refused as exc:
        raise InputError(f"not a readable {what} ({exc})", path=source) from None
    except IndexError:
        raise InputError(f"not a readable {what} (its stack underflows)", path=source) from None
    except (ValueError, OverflowError, struct.error) as exc:
        reason = " ".join(str(exc).split())
        raise InputError(f"not a readable {what} ({type(exc).__name__}: {reason})", path=source) from exc
    finally:
        stream.seek(start)
