"""A ``.metadata`` in the form a torch before 2.15 reads: its ``TensorProperties`` without ``strides``.

torch 2.15 pickles a sixth field in each ``TensorProperties`` state, the saved tensor's strides; a torch before it
unpacks five and fails ("too many values to unpack (expected 5)"). ``without_strides`` gives the same pickle
with a POP before each TUPLE that closes such a state: the strides are still read, so the memo that every later
reference numbers is the same, then dropped, and BUILD gets the five fields an older torch unpacks (2.15 reads
five too, its strides then None). A frame grows by the POPs it holds; every other byte is the original's.
"""

from __future__ import annotations

import bisect
import pickle
import pickletools
import struct
from dataclasses import replace

from optim_repair.errors import InputError
from optim_repair.formats.dcp.metadata import MetadataPickle

_CLASS = ("torch.distributed.checkpoint.metadata", "TensorProperties")
_STRIDES_STATE = 6
"""Fields of torch 2.15's ``TensorProperties`` state: the five before it, then ``strides``."""


class _Made:
    """An object ``NEWOBJ`` made, and its class."""

    def __init__(self, cls: object) -> None:
        self.cls = cls


class _Tuple:
    """A tuple ``MARK ... TUPLE`` made: how many items it has, and where its TUPLE is."""

    def __init__(self, size: int, closed_at: int) -> None:
        self.size = size
        self.closed_at = closed_at


_OTHER = object()
"""A value the walk does not follow."""
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}
_FETCHES = {"GET", "BINGET", "LONG_BINGET"}
_STORES = {"PUT", "BINPUT", "LONG_BINPUT"}


def _pops(data: bytes, source: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Where a POP goes (the TUPLE of each six-field ``TensorProperties`` state), and each frame's place and
    length. Follows the stack of the pickle the safe reader has already checked and loaded."""
    stack: list[object] = []
    marks: list[int] = []
    memo: dict[int, object] = {}
    pops: list[int] = []
    frames: list[tuple[int, int]] = []
    for opcode, arg, at in pickletools.genops(data):
        pos = int(at or 0)  # genops gives every opcode's position in bytes
        name = opcode.name
        if name == "MARK":
            marks.append(len(stack))
        elif name == "FRAME":
            frames.append((pos, int(arg)))  # type: ignore[arg-type]
        elif name in _STRINGS:
            stack.append(arg)
        elif name in _FETCHES:
            stack.append(memo[int(arg)])  # type: ignore[arg-type]
        elif name in _STORES or name == "MEMOIZE":
            memo[len(memo) if name == "MEMOIZE" else int(arg)] = stack[-1]  # type: ignore[arg-type]
        elif name == "GLOBAL":
            stack.append(tuple(str(arg).split(" ", 1)))
        elif name == "STACK_GLOBAL":
            qualname, module = stack.pop(), stack.pop()
            stack.append((module, qualname))
        elif name == "TUPLE":
            start = marks.pop()
            size = len(stack) - start
            del stack[start:]
            stack.append(_Tuple(size, pos))
        elif name in ("NEWOBJ", "NEWOBJ_EX"):
            del stack[-1 if name == "NEWOBJ" else -2 :]  # its arguments, then its class
            stack.append(_Made(stack.pop()))
        elif name == "BUILD":
            state = stack.pop()
            made = stack[-1]
            if isinstance(made, _Made) and made.cls == _CLASS and _has_strides(state, source):
                assert isinstance(state, _Tuple)
                pops.append(state.closed_at)
                state.size -= 1  # as the copy holds it, for each later reference to it
        else:
            _generic(opcode, stack, marks)
    return pops, frames


def _has_strides(state: object, source: str) -> bool:
    if isinstance(state, _Tuple) and state.size in (_STRIDES_STATE - 1, _STRIDES_STATE):
        return state.size == _STRIDES_STATE
    raise InputError(
        "a TensorProperties state is not the tuple torch's pickler writes; it cannot be rewritten for an older torch",
        path=source,
    )


def _generic(opcode: pickletools.OpcodeInfo, stack: list[object], marks: list[int]) -> None:
    """Any other opcode, by the stack effect ``pickletools`` documents: what it takes, then what it pushes."""
    before = opcode.stack_before
    if pickletools.markobject in before:
        del stack[marks.pop() :]
        below = before.index(pickletools.markobject)
    else:
        below = len(before)
    if below:
        del stack[-below:]
    stack.extend([_OTHER] * len(opcode.stack_after))


def without_strides(original: MetadataPickle, source: str) -> MetadataPickle:
    """``original`` (torch 2.15's six-field form) with every ``TensorProperties`` state five fields long."""
    data = original.data[: original.end]
    try:
        pops, frames = _pops(data, source)
    except (IndexError, KeyError, ValueError) as exc:
        raise InputError(f"its pickle cannot be rewritten for an older torch ({exc})", path=source) from None
    out = bytearray()
    done = 0
    events = sorted([(at, -1) for at in pops] + [(at, length) for at, length in frames])
    for at, length in events:
        if length < 0:
            out += data[done:at] + pickle.POP
            done = at
        else:  # the frame's opcode, and its length grown by the POPs inside it
            inside = bisect.bisect_left(pops, at + 9 + length) - bisect.bisect_left(pops, at + 9)
            out += data[done:at] + pickle.FRAME + struct.pack("<Q", length + inside)
            done = at + 9
    out += data[done:]
    return replace(original, data=bytes(out), end=len(out), property_fields=_STRIDES_STATE - 1)
