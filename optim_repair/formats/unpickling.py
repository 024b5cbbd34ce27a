"""Allowlisting unpicklers, and the one set of errors a damaged pickle or zip archive raises.

Every pickle optim-repair reads (a torch file's ``data.pkl``, a DCP ``.metadata``, a DCP bytes
entry) goes through an ``AllowlistUnpickler``: a global outside its allowlist is refused
with ``UnsafeInputError`` before anything is called, and whatever a damaged pickle makes the
unpickler raise becomes one ``InputError`` naming the file.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import gc
import io
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from optim_repair.errors import InputError
from optim_repair.formats.pickle_limits import check_pickle
from optim_repair.formats.pickle_opcodes import PICKLE, OpcodeSet

UNPICKLING_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    ImportError,
    UnicodeDecodeError,
    struct.error,
    RecursionError,
    OverflowError,
    RuntimeError,
)
"""What unpickling damaged bytes raises (besides the ``InputError`` of an allowlist). A ``MemoryError`` is none:
reading ends, as the whole read's ``OutOfMemory``."""

ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    UnicodeDecodeError,
    NotImplementedError,
    ValueError,
    RuntimeError,
    zlib.error,
)
"""What ``zipfile`` raises on a damaged archive: a bad CRC, a mangled header, an unknown compression
method (NotImplementedError), an encrypted record (RuntimeError)."""


Allowlist = Callable[[str, str], Any]
"""What stands in for global ``module.name``; raises ``UnsafeInputError`` for a global not allowed."""


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The cyclic garbage collector paused: unpickling a million-chunk ``.metadata`` makes millions of objects,
    and each collection would walk them all again (5.8x slower with it on). What is unpickled here holds no
    cycles to collect, and the pre-scan has bounded how much there is."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class AllowlistUnpickler(pickle.Unpickler):
    """An unpickler that resolves every global through an allowlist, which refuses it or stands in."""

    def __init__(self, file: io.BytesIO, source: str, allowlist: Allowlist) -> None:
        super().__init__(file)
        self.source = source
        self._file = file
        self._allowlist = allowlist
        self.depth_unchecked = False
        """Whether the pickle grew a container after using it, so that its nesting was not measured."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        return self._allowlist(module, name)

    def stream_position(self) -> int:
        """Where in its file the pickle read so far ends (just past its STOP, once loaded)."""
        return self._file.tell()

    def load_safely(self, what: str, *, ours: bool = False, bounded: bool = False, allowed: OpcodeSet = PICKLE) -> Any:
        with collection_paused():
            return self._load_safely(what, ours=ours, bounded=bounded, allowed=allowed)

    def _load_safely(self, what: str, *, ours: bool, bounded: bool, allowed: OpcodeSet) -> Any:
        """Unpickle once ``check_pickle`` has bounded the work (and found only the opcodes ``allowed``: those
        of the reader that will read it), translating every error of a damaged pickle into an ``InputError``
        about ``what``. ``ours``: a pickle this run wrote (a copy read back for verification), which needs no
        bounding; ``bounded``: one whose work the caller has bounded otherwise. The allowlist applies all the
        same."""
        if not (ours or bounded):
            self.depth_unchecked = check_pickle(self._file, self.source, what, allowed)
        try:
            return self.load()
        except InputError as exc:  # raised by the allowlist or a stand-in: name the file
            exc.path = exc.path or self.source
            raise
        except UNPICKLING_ERRORS as exc:
            raise InputError(f"not a readable {what} ({type(exc).__name__}: {exc})", path=self.source) from exc
