"""A format-free description of the optimizers in a checkpoint: what is there, never tensor data.

Readers in ``optim_repair.formats`` produce these frozen dataclasses; everything downstream
(diagnose, repair, render) works on them alone. No torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from optim_repair.records.dtypes import itemsize, numel
from optim_repair.records.keys import unwrapped
from optim_repair.records.traffic import Traffic

ParamKey = str | int
"""A parameter's key in an optimizer state dict: its name, or its integer index."""

Scalar = None | bool | int | float | complex | str | bytes


def key_style(keys: Iterable[ParamKey]) -> Literal["name", "index"]:
    """How an optimizer state dict keys its parameters: by name when any key is a name."""
    return "name" if any(isinstance(key, str) for key in keys) else "index"


def within_storage(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, item: int, nbytes: int) -> bool:
    """Whether every element of a tensor of this layout (elements of ``item`` bytes) lies inside a storage of
    ``nbytes``, as torch's ``set_`` requires to rebuild it."""
    if len(stride) != len(shape) or offset < 0:
        return False
    if min(shape, default=0) < 0 or min(stride, default=0) < 0:
        return False
    if 0 in shape:
        return True  # no element: nothing to lie outside
    last = offset + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    return (last + 1) * item <= nbytes


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
    value: float | int | bool | complex | None = None
    """The value of a one-element tensor (``step``), when the reader read its few bytes."""
    zero_head: bool | None = None
    """Whether the tensor's leading bytes are all zero, when the reader probed them."""

    @cached_property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @cached_property
    def in_bounds(self) -> bool:
        """Whether every element lies inside the storage, as torch requires to rebuild the tensor."""
        return within_storage(self.shape, self.stride, self.storage_offset, itemsize(self.dtype), self.storage_nbytes)


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
    layout: Literal["nested", "flattened"] = "nested"
    """``flattened``: ``flatten_optimizer_state_dict=True`` keys (``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``), where an entry exists only through its keys, so ``{}`` cannot be stored."""

    @property
    def params(self) -> tuple[ParamKey, ...]:
        return tuple(param for group in self.groups for param in group.params)

    def entry(self, param: ParamKey) -> StateEntry | None:
        return self._by_param.get(param)

    @cached_property
    def _by_param(self) -> dict[ParamKey, StateEntry]:
        """Each entry by its parameter (the first, where a malformed state dict names one twice)."""
        found: dict[ParamKey, StateEntry] = {}
        for entry in self.entries:
            found.setdefault(entry.param, entry)
        return found


@dataclass(frozen=True)
class WeightMap:
    """A mapping of parameter names to tensors (model weights), used for parameter shapes."""

    source: str
    """Where it came from, for messages: ``checkpoint.pt:policy_state_dict``, ``model.safetensors``."""
    tensors: tuple[tuple[str, TensorMeta], ...]
    offsets: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """For one rank's shard of a model saved by DCP's ``HuggingFaceStorageWriter`` (``DCP_SHARDING_INFO``): where
    each tensor's shard begins in the whole tensor. Its ``tensors`` are then the shards, not the whole tensors."""
    in_model_order: bool = False
    """Whether ``tensors`` are in the order the model's ``state_dict`` gave them (a torch file keeps it; a
    safetensors header sorts its names), so that the ``i``-th is the parameter an optimizer indexes ``i``."""

    def lookup(self) -> dict[str, TensorMeta]:
        """Each tensor by its name, and by its name without wrapper prefixes (``keys.unwrapped``) where that
        names no other tensor: a DDP or compiled model's weights give the shapes of a clean-named optimizer."""
        found = dict(self.tensors)
        for name, meta in self.tensors:
            found.setdefault(unwrapped(name), meta)
        return found


@dataclass(frozen=True)
class FileInventory:
    """What one file (or one DCP directory) holds."""

    file: str
    format: Literal["torch-zip", "torch-legacy", "dcp", "deepspeed-universal"]
    optimizers: tuple[OptimizerInventory, ...]
    weights: tuple[WeightMap, ...] = ()
    reads_from: tuple[int, int] | None = None
    """The oldest torch release whose reader takes it, where older ones cannot: (2, 15) for a DCP ``.metadata``
    whose ``TensorProperties`` hold 2.15's sixth field, ``strides``."""
    views: tuple[str, ...] = ()
    """For a DCP checkpoint saved without collectives: its metadata files, one a rank (``__0.metadata``), each
    read as that rank's own view; its optimizers' addresses begin with the view's name. Else ()."""
    writer: Literal["lightning"] | None = None
    """The library whose own files beside it say which loader resumes it: ``lightning`` for a DCP checkpoint
    holding Lightning's ``meta.pt`` (its FSDPStrategy's sharded checkpoint)."""


@dataclass(frozen=True)
class Skipped:
    """A file looked at in directory mode that holds no optimizer or cannot be read safely."""

    file: str
    reason: str
    kind: Literal["other", "unsafe", "deepspeed-zero"] = "other"
    """``unsafe``: loading it would import code (``weights_only`` refuses it); ``deepspeed-zero``: a DeepSpeed
    checkpoint file, recognised by the classes it names, whose ZeRO partitions have no per-parameter entries."""


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
    links_outside: tuple[str, ...] = ()
    """The symbolic links, kept as links in a copy, that point outside the checkpoint."""
    dereference: bool = False
    """Whether every link under the argument was followed (``--dereference``) instead of kept."""
    traffic: Traffic | None = None
    """For a checkpoint in object storage: the requests and bytes reading it took."""

    @property
    def optimizers(self) -> tuple[OptimizerInventory, ...]:
        return tuple(opt for f in self.files for opt in f.optimizers)
