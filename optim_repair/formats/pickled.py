"""Safe, data-free reading and faithful rewriting of the pickles inside torch files.

A torch file's pickle is read into a plain object graph in which every torch global becomes a
``GlobalRef``, every call of one a ``Reduced`` and every storage a ``StorageRef``: no torch import,
no tensor bytes, and nothing outside an allowlist at least as strict as torch's ``weights_only``
can be named, let alone run. The same graph pickles back to an equivalent pickle (``pickle_writing``), so a
writer can change one dict and leave everything else as it was. A tensor torch's loader would refuse to rebuild is
refused as it is unpickled (``TorchRefuses``).
"""

from __future__ import annotations

import collections
import io
import pickle
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

from optim_repair.errors import InputError, TorchRefuses, UnsafeInputError, shown
from optim_repair.formats import safe_globals
from optim_repair.formats.pickle_limits import MAX_DEPTH
from optim_repair.formats.pickle_opcodes import WEIGHTS_ONLY, OpcodeSet
from optim_repair.formats.unpickling import AllowlistUnpickler
from optim_repair.records.dtypes import DTYPES, LEGACY_STORAGES, itemsize
from optim_repair.records.inventory import OtherValue, StateValue, TensorMeta, within_storage

TENSOR_REBUILDERS = frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"})
_TORCH_GLOBALS = frozenset({
    "Size", "Tensor", "device", "UntypedStorage", "per_tensor_affine", "per_tensor_symmetric", "per_channel_affine",
    "per_channel_symmetric", "per_channel_affine_float_qparams",
})  # fmt: skip
_REAL_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
}


@dataclass(frozen=True)
class GlobalRef:
    """A global the pickle names (``torch._utils._rebuild_tensor_v2``), standing in for it."""

    module: str
    name: str

    def __call__(self, *args: Any) -> Reduced:
        if self.module in ("torch._utils", "torch._tensor") and self.name in _REBUILD_ARITY:
            low, high = _REBUILD_ARITY[self.name]
            if not low <= len(args) <= high:
                raise TorchRefuses(f"a tensor is rebuilt by {self.name} with {len(args)} arguments")
        if self.module == "torch._utils" and self.name in TENSOR_REBUILDERS:
            _check_rebuild(self.name, args)
        if self.module == "torch" and (
            self.name in LEGACY_STORAGES or self.name in DTYPES or self.name in _NOT_CALLABLE
        ):
            raise TorchRefuses(f"its pickle calls torch.{self.name}, which torch's loader cannot call")
        takes = _TAKES.get(self.name) if self.module == "torch" else None
        if takes is not None and not takes(args):
            raise TorchRefuses(f"its pickle calls torch.{self.name} with {shown(args)}, arguments it refuses")
        return Reduced(self, args)

    def __reduce__(self) -> str:
        return self.name

    def __setstate__(self, state: Any) -> None:
        # BUILD on a stand-in would rewrite which global it names (torch.Size -> os.system).
        raise pickle.UnpicklingError(f"the pickle sets the state of global {self.qualname}")

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(eq=False)
class Reduced:
    """The result of calling an allowlisted torch global: a tensor, a Parameter, a Size, ..."""

    func: GlobalRef
    args: tuple[Any, ...]
    state: Any = None
    has_state: bool = False

    def __setstate__(self, state: Any) -> None:
        self.state = state
        self.has_state = True

    def __reduce__(self) -> tuple[Any, ...]:
        if self.has_state:
            return (self.func, self.args, self.state)
        return (self.func, self.args)


@dataclass(eq=False)
class StorageRef:
    """A storage a pickle refers to by persistent id; its bytes live outside the pickle."""

    pid: tuple[Any, ...]
    dtype: str
    key: str
    location: str
    numel: int

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"the pickle sets the state of storage {self.key}")

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


_REBUILD_ARITY = {"_rebuild_tensor": (4, 4), "_rebuild_tensor_v2": (6, 7), "_rebuild_tensor_v3": (7, 8),
                  "_rebuild_parameter": (3, 3), "_rebuild_parameter_with_state": (4, 4), "_rebuild_qtensor": (7, 7),
                  "_rebuild_sparse_tensor": (2, 2), "_rebuild_meta_tensor_no_storage": (4, 4),
                  "_rebuild_nested_tensor": (4, 4), "_rebuild_wrapper_subclass": (8, 8),
                  "_rebuild_device_tensor_from_cpu_tensor": (4, 4), "_rebuild_from_type_v2": (4, 4)}  # fmt: skip
"""The rebuild functions torch's loader allows, and how many arguments each takes (their signatures in ``torch._utils``
and ``torch._tensor``, unchanged from torch 2.4 to 2.13): torch refuses another count with a TypeError."""


def _device_arguments(args: tuple[Any, ...]) -> bool:
    """Whether ``torch.device`` takes ``args``: a device string or ordinal, or a type and an index (a bool is no
    index). Which device strings a torch build knows is left to it."""
    if len(args) == 1:
        return isinstance(args[0], str) or (isinstance(args[0], int) and not isinstance(args[0], bool))
    return len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], int) and not isinstance(args[1], bool)


def _size_arguments(args: tuple[Any, ...]) -> bool:
    """Whether ``torch.Size`` takes ``args``: nothing, or one list or tuple of integers."""
    return not args or (
        len(args) == 1 and isinstance(args[0], (list, tuple)) and all(isinstance(x, int) for x in args[0])
    )


_TAKES: dict[str, Callable[[tuple[Any, ...]], bool]] = {"device": _device_arguments, "Size": _size_arguments}
"""The allowlisted torch callables whose arguments torch checks, and what they take (torch raises TypeError else)."""
_NOT_CALLABLE = _TORCH_GLOBALS - {"Size", "Tensor", "device", "UntypedStorage"}
"""The allowlisted torch globals that are values, not callables: quantization schemes (as dtypes and storage types
are, which torch's loader also gives as values). A layout is named through ``torch.serialization._get_layout``."""


_METADATA = {"_rebuild_tensor": 4, "_rebuild_tensor_v2": 6, "_rebuild_tensor_v3": 7}
"""Where each tensor rebuild takes its ``metadata`` (``_rebuild_tensor`` takes none: past its four arguments)."""


def _check_rebuild(name: str, args: tuple[Any, ...]) -> None:
    """Refuse a tensor torch's loader would refuse to rebuild (``torch._utils._rebuild_tensor_v2`` sets its
    ``requires_grad``, then ``set_`` checks that its elements lie within its storage), from its arguments alone."""
    if not isinstance(args[0], StorageRef):
        raise TorchRefuses(f"a tensor is rebuilt from a {type(args[0]).__name__}, not a storage")
    requires_grad = args[4] if len(args) > 4 else False
    if not isinstance(requires_grad, bool):
        raise TorchRefuses(f"a tensor of storage {args[0].key} has requires_grad {shown(requires_grad)}, not a bool")
    dtype = args[0].dtype
    if name == "_rebuild_tensor_v3":
        dtype = args[6].name if isinstance(args[6], GlobalRef) else ""
        if dtype not in DTYPES:
            raise TorchRefuses(f"a tensor of storage {args[0].key} has the dtype {shown(args[6])}")
    layout = _layout(args)
    if layout is None or not within_storage(*layout, itemsize(dtype), args[0].nbytes):
        where = f"size {shown(args[2])}, stride {shown(args[3])} and offset {shown(args[1])}"
        raise TorchRefuses(f"a tensor's {where} reach past its storage {args[0].key} of {args[0].nbytes} bytes")
    if requires_grad and not dtype.startswith(("float", "bfloat", "complex")):
        raise TorchRefuses(f"a {dtype} tensor of storage {args[0].key} requires grad")
    metadata = args[_METADATA[name]] if len(args) > _METADATA[name] else None
    if metadata and not isinstance(metadata, dict):  # set_tensor_metadata asserts a dict, where there is any
        raise TorchRefuses(f"a tensor of storage {args[0].key} has the metadata {shown(metadata)}, not a dict")


def _encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for bytes, limited to latin-1."""
    if encoding != "latin1":
        raise UnsafeInputError(f"refuses _codecs.encode with encoding {shown(encoding)}")
    return text.encode("latin1")


def _bytearray(*args: Any) -> bytearray:
    """``bytearray`` as pickles use it: empty, or a copy of bytes; never ``bytearray(2**32)``."""
    if not args or (len(args) == 1 and isinstance(args[0], bytes)):
        return bytearray(*args)
    raise InputError(f"refuses bytearray called with {shown(args)}; pickles call it with bytes only")


STAND_INS: dict[Any, GlobalRef] = {
    _encode: GlobalRef("_codecs", "encode"),
    _bytearray: GlobalRef("builtins", "bytearray"),
}
"""The functions that stand in for globals a pickle may call, and the globals they are pickled back as."""


def _storage_dtype(ref: object, source: str) -> str:
    if not isinstance(ref, GlobalRef):
        raise InputError(f"a storage names {shown(ref)} as its type", path=source)
    if ref.name in LEGACY_STORAGES:
        return LEGACY_STORAGES[ref.name]
    if ref.name == "UntypedStorage":
        return "uint8"
    raise InputError(f"unknown storage type {ref.qualname}", path=source)


_GLOBAL_NAMES: dict[Any, str] = {
    **{real: f"{module}.{name}" for (module, name), real in _REAL_GLOBALS.items()},
    **{stand_in: ref.qualname for stand_in, ref in STAND_INS.items()},
    **{cls: cls.qualname() for cls in safe_globals.STAND_IN_CLASSES.values()},
}


def global_name(value: Any) -> str | None:
    """The global a graph value is a reference to (``collections.OrderedDict``, ``torch.Size``), by its name;
    None for a value that is not one. A reference is data: two graphs hold the same one when the names agree."""
    if isinstance(value, GlobalRef):
        return value.qualname
    if isinstance(value, (type, types.FunctionType)):
        return _GLOBAL_NAMES.get(value)
    return None


def _allowed_global(module: str, name: str) -> Any:
    """The stand-in for a global a torch pickle names: a real harmless builtin, or a ``GlobalRef``."""
    if (module, name) in _REAL_GLOBALS:
        return _REAL_GLOBALS[(module, name)]
    if (module, name) in safe_globals.STAND_IN_CLASSES:
        return safe_globals.STAND_IN_CLASSES[(module, name)]
    for stand_in, ref in STAND_INS.items():
        if (module, name) == (ref.module, ref.name):
            return stand_in
    allowed = (
        (module == "torch._utils" and name in _REBUILD_ARITY and name != "_rebuild_from_type_v2")
        or (module == "torch._tensor" and name == "_rebuild_from_type_v2")
        or (module == "torch.nn.parameter" and name == "Parameter")
        or (module == "torch.serialization" and name == "_get_layout")
        or (module == "torch" and (name in _TORCH_GLOBALS or name in LEGACY_STORAGES or name in DTYPES))
        or (module == "torch.storage" and name == "UntypedStorage")
        or safe_globals.is_numpy_data(module, name)
    )
    if not allowed:
        raise UnsafeInputError(f"refuses to load global {module}.{name}", global_name=f"{module}.{name}")
    return GlobalRef(module, name)


class _GraphUnpickler(AllowlistUnpickler):
    def __init__(self, file: io.BytesIO, source: str, *, legacy: bool) -> None:
        super().__init__(file, source, _allowed_global)
        self.storages: dict[str, StorageRef] = {}
        self._pid_length = 6 if legacy else 5
        """What torch's loader unpacks: ("storage", type, key, location, numel), and the legacy format's view."""

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == self._pid_length and pid[0] == "storage"):
            raise InputError(f"unexpected persistent id {shown(pid)}", path=self.source)
        if len(pid) == 6 and not (pid[5] is None or (isinstance(pid[5], tuple) and len(pid[5]) == 3)):
            # torch's legacy loader unpacks a view as (key, offset, size), and fails on anything else
            raise InputError(
                f"unexpected persistent id {shown(pid)} (its view is no (key, offset, size))", path=self.source
            )
        key, location, numel = pid[2], pid[3], pid[4]
        if isinstance(key, bool) or not isinstance(key, (str, int)) or not isinstance(location, str):
            raise InputError(f"a storage is named {shown(key)} at {shown(location)}", path=self.source)
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise InputError(f"storage {shown(key)} holds {shown(numel)} elements", path=self.source)
        ref = self.storages.get(str(key))
        if ref is None:
            ref = StorageRef(pid, _storage_dtype(pid[1], self.source), str(key), location, numel)
            self.storages[str(key)] = ref
        return ref


@dataclass
class PickleGraph:
    """One unpickled object graph and the storages it refers to."""

    root: Any
    storages: dict[str, StorageRef]
    memo: Callable[[], dict[int, Any]] = dict
    """The unpickler's memo as the pickle left it, copied on demand: which memo entry each object is."""
    end: int = 0
    """Where in what was read its ``STOP`` ends (a pickle may be followed by more)."""


_CONTAINERS = (dict, list, tuple, set, frozenset, Reduced, safe_globals.PickledObject)


def _contents(node: Any) -> Iterator[Any]:
    """The containers a container holds, iterated, never copied (the empty tuple, holding nothing, is none)."""
    items = chain(node.keys(), node.values()) if isinstance(node, dict) else node
    if isinstance(node, (Reduced, safe_globals.PickledObject)):
        items = (node.args, node.state)
    return (item for item in items if isinstance(item, _CONTAINERS) and item != ())


def check_depth(root: Any, source: str) -> None:
    """Refuse a graph whose containers nest deeper than ``MAX_DEPTH`` (where ``check_pickle`` could not measure it
    from the opcodes), walking it without recursion. The depth is the longest chain of containers (one shared by
    memo references counts on every path through it, once computed); a reference back to a container being walked
    adds nothing. Each container is expanded once, each reference looked at once by type: linear however often
    the memo shares one (a dict of 100,000 keys fetched 100,000 times took minutes)."""
    depth = {id(root): 0}  # 0 while walked
    walking = [(root, _contents(root), [0])] if isinstance(root, _CONTAINERS) else []
    while walking:
        node, contents, deepest = walking[-1]
        item = next(contents, walking)  # ``walking`` itself: all of them seen
        if item is walking:
            walking.pop()
            reached = depth[id(node)] = deepest[0] + 1
            if walking:
                walking[-1][2][0] = max(walking[-1][2][0], reached)
        elif id(item) in depth:
            deepest[0] = max(deepest[0], depth[id(item)])
            continue
        else:
            depth[id(item)], reached = 0, len(walking) + 1  # a chain this long: the root is as deep at least
            walking.append((item, _contents(item), [0]))
        if reached > MAX_DEPTH:
            raise InputError(f"its containers nest more than {MAX_DEPTH} deep", path=source)


def load_graph(
    data: bytes, source: str, *, ours: bool = False, legacy: bool = False, allowed: OpcodeSet = WEIGHTS_ONLY
) -> PickleGraph:
    """Unpickle ``data`` safely into a graph of plain values and stand-ins; no tensor bytes are read. ``legacy``:
    a pickle of the legacy format, whose storages' persistent ids end in a view; ``allowed``: the opcodes of
    the reader that will read it (``torch.load(weights_only=True)``'s, but for a DCP bytes entry)."""
    unpickler = _GraphUnpickler(io.BytesIO(data), source, legacy=legacy)
    root = unpickler.load_safely("torch pickle", ours=ours, allowed=allowed)
    if unpickler.depth_unchecked:
        check_depth(root, source)
    return PickleGraph(root, unpickler.storages, unpickler.memo.copy, unpickler.stream_position())


def _layout(args: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """The size, stride and storage offset of a tensor rebuild's arguments; None where they are not integers (a
    bool is none to torch's ``set_``: found by the fuzzer)."""
    size, stride, offset = args[2], args[3], args[1]
    if not (isinstance(size, tuple) and isinstance(stride, tuple)):
        return None
    return (size, stride, offset) if all(type(x) is int for x in (*size, *stride, offset)) else None


def tensor_meta(value: Any) -> TensorMeta | None:
    """The ``TensorMeta`` of a tensor or Parameter stand-in (a DTensor's local shard), or None for anything else."""
    if not isinstance(value, Reduced):
        return None
    func = value.func
    if func.module == "torch._utils" and func.name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        return tensor_meta(value.args[0]) if value.args else None
    if func.module == "torch._tensor" and func.name == "_rebuild_from_type_v2":
        if len(value.args) > 3 and safe_globals.is_dtensor_class(value.args[1]):
            return tensor_meta(safe_globals.dtensor_local(value.args[3]))
        inner = value.args[0] if value.args else None
        inner_args = value.args[2] if len(value.args) > 2 else ()
        if isinstance(inner, GlobalRef) and isinstance(inner_args, tuple):
            return tensor_meta(Reduced(inner, inner_args))
        return None
    if func.module != "torch._utils" or func.name not in TENSOR_REBUILDERS or len(value.args) < 4:
        return None
    storage = value.args[0]
    if not isinstance(storage, StorageRef):
        return None
    dtype = storage.dtype
    if func.name == "_rebuild_tensor_v3" and len(value.args) > 6 and isinstance(value.args[6], GlobalRef):
        dtype = value.args[6].name
    layout = _layout(value.args)
    if layout is None:
        return None  # a damaged tensor record: not a tensor this reader can describe
    shape, strides, start = layout
    return TensorMeta(
        dtype=dtype,
        shape=shape,
        stride=strides,
        storage=storage.key,
        storage_offset=start,
        storage_nbytes=storage.nbytes,
    )


def state_value(value: Any, *, tensors: bool = True) -> StateValue:
    """A graph value as the inventory records it: a ``TensorMeta``, a plain scalar, or a type name.

    ``tensors=False`` describes a tensor only as ``OtherValue("tensor")``: for pickles whose storages
    are not the file's own (a DCP bytes entry).
    """
    meta = tensor_meta(value) if tensors else None
    if meta is not None:
        return meta
    if is_tensor(value):
        return OtherValue("tensor")
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if isinstance(value, Reduced):
        return OtherValue(value.func.qualname)
    return OtherValue(type(value).__name__)


def option_value(value: Any, *, tensors: bool = True) -> StateValue | tuple[StateValue, ...]:
    """A param group's hyperparameter as the inventory records it (``betas`` stays a tuple)."""
    if isinstance(value, (list, tuple)):
        return tuple(state_value(item, tensors=tensors) for item in value)
    return state_value(value, tensors=tensors)


def is_tensor(value: Any) -> bool:
    """Whether a graph value stands for a tensor of any kind (dense, Parameter, sparse, ...)."""
    return isinstance(value, Reduced) and value.func.module in ("torch._utils", "torch._tensor")


def is_dtensor(value: Any) -> bool:
    """Whether a graph value stands for a DTensor (FSDP2's sharded parameters and their optimizer state)."""
    return (
        isinstance(value, Reduced)
        and value.func.qualname == "torch._tensor._rebuild_from_type_v2"
        and len(value.args) > 1
        and safe_globals.is_dtensor_class(value.args[1])
    )
