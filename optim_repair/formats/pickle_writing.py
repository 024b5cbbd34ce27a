"""Pickling a graph made by ``load_graph`` (possibly edited) back into bytes torch can load.

Every stand-in is pickled as the global, call or persistent id it stands for, so that what was not edited
pickles back as it was read.
"""

from __future__ import annotations

import collections
import io
import pickle
import types
from collections.abc import Iterable
from typing import Any, ClassVar

from optim_repair.errors import RepairRefused
from optim_repair.formats import safe_globals
from optim_repair.formats.pickled import STAND_INS, GlobalRef, Reduced, StorageRef
from optim_repair.records.dtypes import DTYPES, contiguous_strides


class _GraphPickler(pickle._Pickler):
    """The pure-Python pickler, taught to emit stand-ins as the globals and ids they stand for."""

    # pickle's own table sends a function to pickle's save_global, not to this class's: a stand-in function
    # the graph refers to without calling it (``bytearray`` as a tensor's hooks) is pickled as its global.
    dispatch: ClassVar[dict[type, Any]] = {
        **pickle._Pickler.dispatch,
        types.FunctionType: lambda self, obj: self.save_global(obj),
    }

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            return obj.pid
        return None

    def save_global(self, obj: Any, name: str | None = None) -> None:
        # The pure-Python pickler's internals (save, write, memoize, proto) are not in typeshed.
        this: Any = self
        if isinstance(obj, type) and issubclass(obj, safe_globals.PickledObject):
            ref = GlobalRef(obj.module, obj.name)
        else:
            ref = STAND_INS.get(obj, obj)
        if not isinstance(ref, GlobalRef):
            base: Any = super()
            base.save_global(obj, name)
            return
        if this.proto >= 4:
            this.save(ref.module)
            this.save(ref.name)
            this.write(pickle.STACK_GLOBAL)
        else:
            this.write(pickle.GLOBAL + f"{ref.module}\n{ref.name}\n".encode())
        this.memoize(obj)


TORCH_PROTOCOL = 2
"""What ``torch.save`` writes and torch's weights-only loader reads in full (protocol 4's ``FRAME`` it refuses)."""


def dump_graph(root: Any) -> bytes:
    """Pickle a graph made by ``load_graph`` (possibly edited) back into bytes torch can load."""
    buffer = io.BytesIO()
    _GraphPickler(buffer, protocol=TORCH_PROTOCOL).dump(root)
    return buffer.getvalue()


def dump_parts(values: Iterable[Any]) -> bytes:
    """Pickle ``values`` one after another as bare opcodes (no ``PROTO``, no ``STOP``) that store nothing in the
    memo: a part spliced into another pickle, whose memo entries it must leave as they are."""
    buffer = io.BytesIO()
    pickler: Any = _GraphPickler(buffer, protocol=TORCH_PROTOCOL)
    pickler.fast = True  # pickle's own switch: memoize nothing (so no value may refer to itself)
    for value in values:
        pickler.save(value)
    return buffer.getvalue()


def new_tensor(storage: StorageRef, shape: tuple[int, ...]) -> Reduced:
    """A contiguous tensor stand-in over a whole new storage, pickled as torch itself would."""
    rebuild = GlobalRef("torch._utils", "_rebuild_tensor_v2")
    return rebuild(storage, 0, tuple(shape), contiguous_strides(shape), False, collections.OrderedDict())


def storage_for(key: str, dtype: str, numel: int, *, legacy: bool, location: str = "cpu") -> StorageRef:
    """A new storage stand-in of ``dtype`` (a legacy storage class where torch would use one)."""
    known = DTYPES.get(dtype)
    cls = known.legacy_storage if known else ""
    if not cls:
        raise RepairRefused(f"cannot create a storage of dtype {dtype}: torch pickles name no storage class for it")
    pid: tuple[Any, ...] = ("storage", GlobalRef("torch", cls), key, location, numel)
    if legacy:
        pid = (*pid, None)
    return StorageRef(pid, dtype, key, location, numel)
