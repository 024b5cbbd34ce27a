"""The globals beyond torch's own that torch's weights-only loader admits once they are declared safe.

numpy's arrays, scalars and dtypes (HF Trainer's ``rng_state.pth``) are named by ``GlobalRef`` stand-ins.
DTensor state brings objects: its device mesh, its spec, its placements.

``torch.save`` of an FSDP2 model's or optimizer's ``state_dict()`` pickles each DTensor as a wrapper
tensor whose state holds its local tensor and a ``DTensorSpec``. The spec, its ``DeviceMesh`` and its
placements are plain objects made by NEWOBJ (``cls.__new__(cls, *args)``) and BUILD (``__setstate__``).
torch's weights-only loader admits exactly these classes once ``torch.distributed.tensor`` is imported.

Each admitted class is stood in for by a class of its own here, made once at import: its objects record
the arguments and the state they were built with, run nothing, and pickle back as the same opcodes.
"""

from __future__ import annotations

import copyreg
import pickle
from typing import Any, ClassVar

from optim_repair.errors import InputError

DTENSOR_CLASSES = (
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    ("torch.distributed._mesh_layout", "_FlatLayout"),
    ("torch.distributed._mesh_layout", "_MeshLayout"),
    ("torch.distributed.tensor.placement_types", "Shard"),
    ("torch.distributed.tensor.placement_types", "_StridedShard"),
    ("torch.distributed.tensor.placement_types", "Replicate"),
    ("torch.distributed.tensor.placement_types", "Partial"),
)
"""The classes ``torch.distributed.tensor`` declares safe for torch's weights-only loader (torch 2.13)."""


_NUMPY_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }
)
"""The globals numpy arrays, scalars and dtypes are pickled with, which torch's weights-only loader reads when
they are declared safe (HF Trainer's ``rng_state.pth``): data, never code; stand-ins here, never numpy."""


def is_numpy_data(module: str, name: str) -> bool:
    return (module, name) in _NUMPY_GLOBALS or (module == "numpy.dtypes" and name.endswith("DType"))


class PickledObject:
    """An object of an admitted class: the arguments NEWOBJ gave it and the state BUILD set, nothing run."""

    module: ClassVar[str]
    name: ClassVar[str]
    args: tuple[Any, ...]
    state: Any
    has_state: bool

    def __new__(cls, *args: Any, **kwargs: Any) -> PickledObject:
        if cls is PickledObject or kwargs:
            raise InputError(f"refuses to make an object of {cls.__qualname__} with keyword arguments")
        made = super().__new__(cls)
        made.args, made.state, made.has_state = args, None, False
        return made

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only a call (REDUCE) runs __init__, never NEWOBJ; a call would be pickled back as NEWOBJ, which skips
        # the real class's __init__: a different object.
        raise InputError(f"refuses to call {self.qualname()}: pickles make its objects with NEWOBJ")

    def __setstate__(self, state: Any) -> None:
        # A second BUILD, or a None state, could not be pickled back as it was.
        if self.has_state or state is None:
            raise pickle.UnpicklingError(f"the pickle sets the state of a {self.qualname()} twice or to None")
        self.state, self.has_state = state, True

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # copyreg.__newobj__ (not in typeshed) is how a reduction asks the pickler for NEWOBJ
        newobj = copyreg.__newobj__  # type: ignore[attr-defined]
        return (newobj, (type(self), *self.args), self.state if self.has_state else None)

    @classmethod
    def qualname(cls) -> str:
        return f"{cls.module}.{cls.name}"


def _stand_in(module: str, name: str) -> type[PickledObject]:
    return type(name, (PickledObject,), {"module": module, "name": name, "__module__": __name__})


STAND_IN_CLASSES: dict[tuple[str, str], type[PickledObject]] = {
    (module, name): _stand_in(module, name) for module, name in DTENSOR_CLASSES
}
"""The stand-in of each admitted class, by the module and name a pickle gives it."""


def is_dtensor_class(value: Any) -> bool:
    return value is STAND_IN_CLASSES[("torch.distributed.tensor", "DTensor")]


def dtensor_local(state: Any) -> Any:
    """This rank's shard in the pickled state of a DTensor: a dict of its attributes, or (as Python 3.11 and
    later pickle an object with ``__slots__``) a pair of its ``__dict__`` (or None) and a dict of its slots."""
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    return next((part["_local_tensor"] for part in parts if isinstance(part, dict) and "_local_tensor" in part), None)
