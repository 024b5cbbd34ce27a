"""A format-free description of the optimizers in a checkpoint: what is there, never tensor data.

Readers in ``optim_repair.formats`` produce these frozen dataclasses; everything downstream
(diagnose, repair, render) works on them alone. No torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

ParamKey = str | int
"""A parameter's key in an optimizer state dict: its name, or its integer index."""

Scalar = None | bool | int | float | complex | str | bytes

ELEMENT_SIZES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "qint8": 1,
    "qint32": 4,
    "quint8": 1,
    "quint4x2": 1,
    "quint2x4": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
}
"""Bytes per element of each torch dtype, by the name torch gives it without ``torch.``."""


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (a size-0 dimension counts as 1)."""
    strides: list[int] = []
    running = 1
    for size in reversed(shape):
        strides.insert(0, running)
        running *= max(size, 1)
    return tuple(strides)


@dataclass(frozen=True)
class TensorMeta:
    """A tensor as it is stored: its layout and where its storage lies, not its values."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: str
    """The storage's identity within its file (two tensors with one storage share bytes)."""
    storage_offset: int
    """Offset of the tensor's first element in its storage, in elements."""
    storage_nbytes: int
    byte_offset: int | None = None
    """Where the storage's bytes start in the file, when the format stores it contiguously."""
    value: float | int | bool | complex | None = None
    """The value of a one-element tensor (``step``), when the reader read its few bytes."""
    zero_head: bool | None = None
    """Whether the tensor's leading bytes are all zero, when the reader probed them."""

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * ELEMENT_SIZES.get(self.dtype, 1)

    def is_zero_dim(self) -> bool:
        return self.shape == ()


@dataclass(frozen=True)
class OtherValue:
    """A value that is neither a tensor nor a plain scalar (a list, a dict, an object)."""

    type_name: str


StateValue = TensorMeta | OtherValue | Scalar


@dataclass(frozen=True)
class StateEntry:
    """One parameter's entry in ``state``."""

    param: ParamKey
    values: tuple[tuple[str, StateValue], ...] | None
    """The entry's keys and values in file order; None when the entry is not a mapping."""
    type_name: str = "dict"

    @property
    def is_mapping(self) -> bool:
        return self.values is not None

    @property
    def is_empty(self) -> bool:
        return self.values == ()

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.values or ())

    def get(self, key: str) -> StateValue:
        for name, value in self.values or ():
            if name == key:
                return value
        return None


@dataclass(frozen=True)
class ParamGroup:
    """One entry of ``param_groups``: its params and hyperparameters (``lr``, ``betas``, ...)."""

    params: tuple[ParamKey, ...]
    options: tuple[tuple[str, StateValue | tuple[StateValue, ...]], ...] = ()

    def option(self, key: str) -> object:
        for name, value in self.options:
            if name == key:
                return value
        return None

    @property
    def option_keys(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.options)


@dataclass(frozen=True)
class OptimizerInventory:
    """An optimizer state dict found in a checkpoint."""

    file: str
    """The file it was found in, relative to the checkpoint argument ("" for the argument itself)."""
    location: str
    """Where it sits inside the file, for humans: ``optimizer_states[0]``, ``optimizers.actor``."""
    address: tuple[ParamKey, ...]
    """The same place as a path of keys and list indices, for writers."""
    key_style: Literal["name", "index"]
    groups: tuple[ParamGroup, ...]
    entries: tuple[StateEntry, ...]

    @property
    def params(self) -> tuple[ParamKey, ...]:
        return tuple(param for group in self.groups for param in group.params)

    def entry(self, param: ParamKey) -> StateEntry | None:
        for entry in self.entries:
            if entry.param == param:
                return entry
        return None

    def group_of(self, param: ParamKey) -> ParamGroup | None:
        for group in self.groups:
            if param in group.params:
                return group
        return None


@dataclass(frozen=True)
class WeightMap:
    """A mapping of parameter names to tensors (model weights), used for parameter shapes."""

    source: str
    """Where it came from, for messages: ``checkpoint.pt:policy_state_dict``, ``model.safetensors``."""
    tensors: tuple[tuple[str, TensorMeta], ...]

    def lookup(self) -> dict[str, TensorMeta]:
        return dict(self.tensors)


@dataclass(frozen=True)
class FileInventory:
    """What one file (or one DCP directory) holds."""

    file: str
    format: Literal["torch-zip", "torch-legacy", "dcp"]
    optimizers: tuple[OptimizerInventory, ...]
    weights: tuple[WeightMap, ...] = ()


@dataclass(frozen=True)
class Skipped:
    """A file looked at in directory mode that holds no optimizer or cannot be read safely."""

    file: str
    reason: str


@dataclass(frozen=True)
class CheckpointInventory:
    """Everything found under one checkpoint argument."""

    path: str
    format: Literal["torch", "dcp"]
    is_directory: bool
    files: tuple[FileInventory, ...]
    skipped: tuple[Skipped, ...] = ()
    weights: tuple[WeightMap, ...] = field(default=())
    """Model weights beside the optimizer files (``model.safetensors``), for parameter shapes."""

    @property
    def optimizers(self) -> tuple[OptimizerInventory, ...]:
        return tuple(opt for f in self.files for opt in f.optimizers)
