"""Reading one pickle out of a file that holds more (a legacy torch file's five, then its storages): through the file.

Nothing tells where a pickle ends but its ``STOP``, so ``read_pickle`` follows the opcodes' lengths alone (executing
nothing, keeping no stack) and reads up to it, so that what follows is never read. The bytes are then checked
(``pickle_limits.check_pickle``) and unpickled from memory: what is checked is what is unpickled. The file is never
mapped (see ``storage.disk``): cut short meanwhile, it is ``InputError`` (changed while being read), never SIGBUS.
"""

from __future__ import annotations

from typing import BinaryIO

from optim_repair.formats import pickle_opcodes as opcodes
from optim_repair.storage.disk import read_within

_READ = 1 << 16
"""How much more than an opcode needs ``read_pickle`` reads at a time."""
_STOPS, _UNKNOWN = -3, -4
_LENGTHS = [
    _UNKNOWN if found is None else _STOPS if found[0] == opcodes.STOP else found[1] for found in opcodes.PICKLE.table
]
"""How each byte's opcode is followed, for ``read_pickle``: its argument's encoding (``pickle_opcodes.encoding``),
or that it is ``STOP``, or no opcode."""


def read_pickle(stream: BinaryIO, source: str, size: int) -> bytes:
    """The bytes of the one pickle that starts at the position of ``stream``, a file of ``size`` bytes when it was
    opened, and where it is left: up to its ``STOP``. Where the file holds no ``STOP`` (or an unknown opcode comes
    first), or an opcode claims more bytes than the file holds, what was read: the scan refuses it, as it would the
    whole file, and nothing past the file's end is read for it. A file shorter than ``size``: ``InputError``."""
    start = stream.tell()
    rest = size - start
    data, pos, lengths, sized = bytearray(), 0, _LENGTHS, opcodes.SIZED
    try:
        while True:
            held = len(data)
            while pos < held:  # the hot loop: one step an opcode
                arg = lengths[data[pos]]
                if 0 <= arg < sized:
                    pos += 1 + arg
                elif arg > sized:
                    width = arg - sized
                    if pos + 1 + width > held:
                        break
                    pos += 1 + width + int.from_bytes(data[pos + 1 : pos + 1 + width], "little")
                elif arg <= _STOPS:
                    return bytes(data[: pos + 1])
                else:
                    end = data.find(b"\n", pos + 1)
                    if end >= 0 and arg == opcodes.TWO_LINES:
                        end = data.find(b"\n", end + 1)
                    if end < 0:
                        break
                    pos = end + 1
            if pos > rest:  # an opcode that claims more than the file holds
                return bytes(data)
            wanted = max(pos + 1 - held, held if pos < held else 0, _READ)  # a line or a header: twice as much
            more = read_within(stream, min(wanted, rest - held), size, source)
            if not more:
                return bytes(data)
            data += more
    finally:
        stream.seek(start)
