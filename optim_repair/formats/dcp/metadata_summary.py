"""Summarizing a torch-written DCP ``.metadata`` as it is read, in memory that does not grow with its chunks.

A ``.metadata`` written on R ranks holds a ``ChunkStorageMetadata`` per rank per tensor, and a ``MetadataIndex``
and ``_StorageInfo`` pair per chunk: millions of records, each pickled by torch's pickler in the same few dozen
bytes. ``summarize`` walks the pickle once. Each run of such records, recognised whole by a regular expression
built from the memo entries that hold their class and field names, is reduced to a summary (a ``ChunkRun``: how
many chunks, what they hold, the furthest each reaches; a ``StorageRun``: the keys stored, the furthest byte of
each shard), and every other opcode is copied into a small pickle, in which a stand-in object takes each run's
place. That pickle is then checked and unpickled as any other (``metadata_reader``).

The walk follows only what torch's pickler writes (protocol 4 or 5, and its opcodes for the metadata classes);
anything else (another protocol, another opcode, a frame out of place, a reference to an object inside a
summarized record) raises ``NotSummarized``, and the caller reads the pickle whole, as before: a summary is a
cheaper way to the same answer, never another judge.
"""

from __future__ import annotations

import bisect
import operator
import re
import secrets
import struct
from collections.abc import Callable
from math import prod
from typing import Any

from optim_repair.formats.dcp.metadata_records import (
    CHUNK_MEMO,
    CLASSES,
    MAX_NDIM,
    MODULE,
    PAIR_MEMO,
    SMALL_INTS,
    ChunkRun,
    Global,
    NotSummarized,
    ShardEnds,
    StorageRun,
    Summary,
    chunk_pattern,
    fetch,
    int_value,
    pair_pattern,
    path_fault,
)

_RELEASE_EVERY = 1 << 22
"""How far the walk goes before it lets go of the pages behind it (4 MiB: the walk's own memory stays flat)."""
_AHEAD, _OPCODE = 1 << 22, 1 << 10
"""How far ahead the walk has its data read (``reach``); more than any opcode takes but a string (read to its end)."""
_NOWHERE = (-1, "")
_OPAQUE = object()
"""What the walk knows of a value it does not follow: that it is there."""
_U4 = struct.Struct("<I").unpack_from
_U8 = struct.Struct("<Q").unpack_from
_SIGNED4 = struct.Struct("<i").unpack_from


class _Walk:
    """One walk over a pickle: the stack it follows, its memo, what it copies and what it summarized."""

    def __init__(self, data: Any, release: Callable[[int], None], reach: Callable[[int], int]) -> None:
        self.data = data
        self.release = release
        self.reach = reach
        self.reached = 0  # how far ``data`` holds what was read: the walk touches nothing past it
        self.out = bytearray()
        self.stack: list[object] = []
        self.marks: list[int] = []
        self.memo = 0
        """How many memo entries the original has made so far."""
        self.known: dict[int, object] = {}
        """The memo entries that hold a string or a global, by index in the original."""
        self.where: dict[object, int] = {}
        """The latest memo index of each such value."""
        self.drop_starts: list[int] = []
        self.drop_ends: list[int] = []
        self.dropped_before: list[int] = []
        """For each range of summarized memo entries: where it starts and ends, and how many entries were
        summarized before it (the summarized pickle numbers its memo without them)."""
        self.dropped = 0
        self.chunks: list[ChunkRun] = []
        self.storage: list[StorageRun] = []
        self.shards = ShardEnds()
        self.ends: dict[str, tuple[int, str | bytes]] = {}
        """What ``shards`` will hold, a key written in place kept as its bytes until the walk ends."""
        self.strings: dict[bytes, str | None] = {}
        """What each fetch of a string seen in a record fetches."""
        self.safe_paths: set[str] = set()
        self.name = "run_" + secrets.token_hex(8)

    def _drop(self, count: int) -> None:
        if self.drop_ends and self.drop_ends[-1] == self.memo:
            self.drop_ends[-1] += count
        else:
            self.drop_starts.append(self.memo)
            self.drop_ends.append(self.memo + count)
            self.dropped_before.append(self.dropped)
        self.memo += count
        self.dropped += count

    def _renumbered(self, index: int) -> int:
        if index >= self.memo:
            raise NotSummarized
        at = bisect.bisect_right(self.drop_starts, index) - 1
        if at < 0:
            return index
        if index < self.drop_ends[at]:
            raise NotSummarized  # a reference into a summarized record
        return index - self.dropped_before[at] - (self.drop_ends[at] - self.drop_starts[at])

    def _pop(self, single: type | None = None) -> object:
        """The topmost item: never a run, which stands for many items in the original and one here, unless it is
        a ``single`` run of one record (a list of one chunk is made by APPEND, a dict of one pair by SETITEM)."""
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise NotSummarized
        item = self.stack.pop()
        if isinstance(item, (ChunkRun, StorageRun)) and not (isinstance(item, single or ()) and item.count == 1):
            raise NotSummarized
        return item

    def _pop_mark(self, allowed: type | None = None) -> None:
        """The items above the topmost mark, added to the container below it or made a tuple: only ``allowed``
        runs among them (chunks appended to a list; storage pairs set in a dict), whose stand-ins are
        added as the items they stand for would be."""
        if not self.marks:
            raise NotSummarized
        start = self.marks.pop()
        for item in self.stack[start:]:
            if isinstance(item, (ChunkRun, StorageRun)) and not isinstance(item, allowed or ()):
                raise NotSummarized
        del self.stack[start:]

    def _stand_in(self, kind: int, index: int) -> bytes:
        module, name = MODULE.encode(), self.name.encode()
        return (
            b"\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"
            + b"K" + bytes([kind]) + b"J" + struct.pack("<i", index) + b"\x86R"
        )  # fmt: skip

    def _gets(self, *keys: object) -> tuple[bytes, ...] | None:
        indices = [self.where.get(key) for key in keys]
        return None if None in indices else tuple(fetch(index) for index in indices if index is not None)

    def _chunks(self, pos: int, end: int) -> int:
        gets = self._gets(Global(*CLASSES["chunk"]), Global(*CLASSES["size"]), "offsets", "sizes")
        if gets is None:
            return pos
        data, small = self.data, SMALL_INTS
        ndim, pattern = 2, chunk_pattern(gets, 2)
        count = held = 0
        ends: list[int] = []
        while True:  # the hot loop of a million-chunk .metadata: what a ChunkRun holds is summed here
            match = pattern.match(data, pos, end)
            if match is None:
                for other in range(1, MAX_NDIM + 1):
                    if (match := chunk_pattern(gets, other).match(data, pos, end)) is not None:
                        break
                else:
                    break
                if count:
                    self._emit_run(ChunkRun(ndim, count, held, ends))
                    count = held = 0
                ndim, pattern = other, chunk_pattern(gets, other)
            groups = match.groups()
            try:
                values = tuple(map(small.__getitem__, groups))  # BININT1: never negative
            except KeyError:
                values = tuple(map(int_value, groups))
                if min(values) < 0:
                    break
            sizes = values[ndim:]
            held += prod(sizes)
            reach = map(operator.add, values, sizes)  # offset plus size, dimension by dimension
            ends = list(map(max, ends, reach)) if count else list(reach)
            count += 1
            pos = match.end()
        if count:
            self._emit_run(ChunkRun(ndim, count, held, ends))
        return pos

    def _emit_run(self, run: ChunkRun | StorageRun) -> None:
        """Put a stand-in for ``run`` where its records were (their memo entries, ``_drop``ped, are not there)."""
        self.stack.append(run)
        if isinstance(run, ChunkRun):
            self._drop(CHUNK_MEMO * run.count)
            self.chunks.append(run)
            self.out += self._stand_in(0, len(self.chunks) - 1)
        else:
            self.storage.append(run)
            self.shards.runs += 1
            self.out += self._stand_in(1, len(self.storage) - 1) + b"N"
            self.stack.append(_OPAQUE)  # the stand-in's value: a run of pairs stands as one pair

    def _pairs(self, pos: int, end: int) -> int:
        gets = self._gets(
            Global(*CLASSES["index"]), "fqn", Global(*CLASSES["size"]), Global(*CLASSES["info"]),
            "index", "offset", "relative_path", "length",
        )  # fmt: skip
        if gets is None:
            return pos
        data, string, strings = self.data, self._string, self.strings
        run, count, written_count = StorageRun(self.shards), 0, 0
        keys: set[str | bytes] = set()
        ends, safe, signed = self.ends, self.safe_paths, _SIGNED4
        named_at = len(gets[0]) + 6 + len(gets[1])  # where the fqn's opcode is: after the class, NEWOBJ, "fqn"
        ndim = 2
        by_written: dict[int | None, re.Pattern[bytes]] = {}  # this ndim's, by a fqn's length (None: fetched)
        while True:  # the hot loop of a million-chunk .metadata (what a StorageRun holds is kept here)
            at = pos + named_at
            written = data[at + 1] if at + 1 < end and data[at] == 0x8C else None
            pattern = by_written.get(written)
            if pattern is None:
                pattern = by_written[written] = pair_pattern(gets, ndim, written)
            match = pattern.match(data, pos, end)
            if match is None:
                for other in range(1, MAX_NDIM + 1):
                    if other != ndim and (match := pair_pattern(gets, other, written).match(data, pos, end)):
                        ndim, by_written = other, {}
                        break
                else:
                    break
            named, fetched_path, offset, stored = match.groups()
            if written is None:
                named = strings[named] if named in strings else string(named)
                if named is None:
                    break
            else:
                written_count += 1  # its string is kept as bytes, decoded once per name below
            relative_path = strings[fetched_path] if fetched_path in strings else string(fetched_path)
            if relative_path not in safe:
                if relative_path is None or path_fault(relative_path) is not None:
                    break
                safe.add(relative_path)
            # BININT1, BININT2 or BININT, decoded inline: this runs once per chunk
            kind, stored_kind = offset[0], stored[0]
            first = offset[1] if kind == 0x4B else offset[1] | offset[2] << 8 if kind == 0x4D else signed(offset, 1)[0]
            last = first + (
                stored[1] if stored_kind == 0x4B else stored[1] | stored[2] << 8 if stored_kind == 0x4D
                else signed(stored, 1)[0]
            )  # fmt: skip
            if first < 0 or last < first:
                break
            keys.add(named)
            if last > ends.get(relative_path, _NOWHERE)[0]:
                ends[relative_path] = (last, named)
            count += 1
            pos = match.end()
        if count:
            run.count = count
            run.keys = {_decoded(key) for key in keys}
            self._drop(PAIR_MEMO * count + written_count)
            self._emit_run(run)
        return pos

    def _string(self, encoded: bytes) -> str | None:
        """The string a BINGET or LONG_BINGET fetches, if the memo entry holds one (entries never change)."""
        if encoded not in self.strings:
            index = encoded[1] if encoded[0] == 0x68 else int(_U4(encoded, 1)[0])
            value = self.known.get(index)
            self.strings[encoded] = value if isinstance(value, str) else None
        return self.strings[encoded]

    def run(self) -> int:
        """Walk the pickle from its start; return where it ends (just past its STOP)."""
        data, out, stack, known = self.data, self.out, self.stack, self.known
        size = len(data)
        self.reached = self.reach(_AHEAD)
        if size < 2 or data[0] != 0x80 or data[1] not in (4, 5):
            raise NotSummarized
        out += data[:2]
        pos, frame_end, released = 2, size, 0
        chunk_class, index_class = Global(*CLASSES["chunk"]), Global(*CLASSES["index"])
        while True:
            if pos >= size:
                raise NotSummarized
            if pos - released > _RELEASE_EVERY:
                released = pos & ~0xFFFF
                self.release(released)
            if pos + _OPCODE > self.reached:
                self.reached = self.reach(pos + _AHEAD)
            op_start, op = pos, data[pos]
            pos += 1
            if op in (0x68, 0x6A):  # BINGET, LONG_BINGET
                width = 1 if op == 0x68 else 4
                if pos + width > size:
                    raise NotSummarized
                index = data[pos] if width == 1 else int(_U4(data, pos)[0])
                value = known.get(index, _OPAQUE)
                if value in (chunk_class, index_class):  # a run: matched no further than what was read
                    runs = self._chunks if value == chunk_class else self._pairs
                    after = runs(op_start, min(frame_end, self.reached))
                    if after != op_start:
                        pos = after
                        continue
                pos += width
                out += fetch(self._renumbered(index))
                stack.append(value)
            elif op == 0x94:  # MEMOIZE
                if len(stack) <= (self.marks[-1] if self.marks else 0):
                    raise NotSummarized
                value = stack[-1]
                if isinstance(value, (ChunkRun, StorageRun)):
                    raise NotSummarized
                if isinstance(value, (str, Global)):
                    known[self.memo] = value
                    self.where[value] = self.memo
                self.memo += 1
                out.append(op)
            elif op == 0x95:  # FRAME: from where the last one ended (or outside one), and inside the data
                if pos + 8 > size or (op_start < frame_end < size):
                    raise NotSummarized
                length = int(_U8(data, pos)[0])
                pos += 8
                if length > size - pos:
                    raise NotSummarized
                frame_end = pos + length
                if frame_end > self.reached:
                    self.reached = self.reach(frame_end)
                continue
            else:
                pos = self._general(op, pos)
                out += data[op_start:pos]
            if pos > frame_end:
                if op_start < frame_end:
                    raise NotSummarized  # an opcode across the end of its frame
                frame_end = size
            if op == 0x2E:  # STOP
                if len(stack) != 1 or self.marks or pos > size:
                    raise NotSummarized
                return pos

    def _general(self, op: int, pos: int) -> int:
        """Follow one opcode other than a fetch, a memo entry or a frame; return where the next one starts."""
        data, stack = self.data, self.stack
        if op in (0x8C, 0x58):  # SHORT_BINUNICODE, BINUNICODE
            width = 1 if op == 0x8C else 4
            if pos + width > len(data):
                raise NotSummarized
            length = data[pos] if width == 1 else int(_U4(data, pos)[0])
            start, pos = pos + width, pos + width + length
            if pos > len(data):
                raise NotSummarized
            if pos > self.reached:
                self.reached = self.reach(pos)
            try:
                stack.append(bytes(data[start:pos]).decode("utf-8", "surrogatepass"))
            except UnicodeDecodeError:
                raise NotSummarized from None
            return pos
        if op in _SCALARS:
            stack.append(_OPAQUE)
            if op == 0x8A:  # LONG1: a length, then the bytes
                return pos + 1 + (data[pos] if pos < len(data) else 0)
            return pos + _SCALARS[op]
        if op == 0x93:  # STACK_GLOBAL
            name, module = self._pop(), self._pop()
            both = isinstance(module, str) and isinstance(name, str)
            stack.append(Global(str(module), str(name)) if both else _OPAQUE)
        elif op in (0x85, 0x86, 0x87):  # TUPLE1-3
            for _ in range(op - 0x84):
                self._pop()
            stack.append(_OPAQUE)
        elif op == 0x28:  # MARK
            self.marks.append(len(stack))
        elif op == 0x74:  # TUPLE
            self._pop_mark()
            stack.append(_OPAQUE)
        elif op in (0x75, 0x65):  # SETITEMS, APPENDS: into the container below the mark
            self._pop_mark(StorageRun if op == 0x75 else ChunkRun)
            self._pop()
            stack.append(_OPAQUE)
        elif op in (0x73, 0x61, 0x62):  # SETITEM (a value, then its key), APPEND, BUILD: into the item below
            if op == 0x73:
                self._pop()
            self._pop(StorageRun if op == 0x73 else ChunkRun if op == 0x61 else None)
            self._pop()
            stack.append(_OPAQUE)
        elif op in (0x81, 0x52):  # NEWOBJ, REDUCE
            self._pop()
            self._pop()
            stack.append(_OPAQUE)
        elif op == 0x2E:  # STOP
            return pos
        else:
            raise NotSummarized
        return pos


_SCALARS = {
    0x29: 0, 0x5D: 0, 0x7D: 0, 0x4E: 0, 0x88: 0, 0x89: 0,  # EMPTY_TUPLE, EMPTY_LIST, EMPTY_DICT, NONE, booleans
    0x4B: 1, 0x4D: 2, 0x4A: 4, 0x47: 8, 0x8A: 1,  # BININT1, BININT2, BININT, BINFLOAT, LONG1
}  # fmt: skip
"""What pushes one value the walk does not follow, by opcode: how many bytes its argument takes."""


def _decoded(name: str | bytes) -> str:
    """A key as the unpickler gives it: a string written in place is UTF-8 (with surrogates, as pickle allows)."""
    if isinstance(name, str):
        return name
    try:
        return name.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise NotSummarized from None


def summarize(
    data: Any, release: Callable[[int], None] = lambda _: None, reach: Callable[[int], int] | None = None
) -> Summary:
    """Summarize the pickle at the start of ``data`` (bytes, or memory a file is read into as the walk goes: ``reach``
    has it read up to a place, and says how far it is read); ``release`` is told, now and then, how far the walk
    has read, so that the pages behind it can be let go. Raises ``NotSummarized``."""
    walk = _Walk(data, release, reach or (lambda _: len(data)))
    try:
        walk.run()
    except IndexError:
        raise NotSummarized from None
    walk.shards.ends.update((shard, (end, _decoded(key))) for shard, (end, key) in walk.ends.items())
    return Summary(bytes(walk.out), walk.name, walk.chunks, walk.storage)
