"""A repair plan as plain data: which state entries to add, where, holding what.

``repair`` decides the plan; the format writers in ``optim_repair.formats`` and the verifiers
consume it. Nothing here decides anything, reads a file or imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

from optim_repair.records.dtypes import filled_chunks, itemsize, numel
from optim_repair.records.inventory import ParamKey, Scalar

Fill = Literal["empty", "fresh"]
FillChoice = Literal["auto", "empty", "fresh"]
"""What a user asks for: ``auto`` (the default, also None) is ``fresh`` where it can be built, else ``{}``."""
PlanFill = Literal["empty", "fresh", "mixed"]
"""A plan's fill: ``mixed`` when a directory's torch files got ``{}`` and its DCP checkpoints fresh state."""


@dataclass(frozen=True)
class FreshTensor:
    """A tensor to create: every element equals ``fill``."""

    dtype: str
    shape: tuple[int, ...]
    fill: float | int | bool | complex = 0

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * itemsize(self.dtype)

    def chunks(self) -> Iterator[bytes]:
        """Its contiguous little-endian bytes, in chunks of bounded size."""
        return filled_chunks(self.dtype, self.shape, self.fill)


AddedValue = FreshTensor | Scalar
"""One value of an added entry: a tensor to create, or a plain value stored as is."""


@dataclass(frozen=True)
class GroupOption:
    """One option a param group lacks and the loading torch asks for (``decoupled_weight_decay``, which torch
    before 2.8 did not write), to add with the value that torch assumes for it."""

    file: str
    location: str
    address: tuple[ParamKey, ...]
    group: int
    key: str
    value: Scalar


@dataclass(frozen=True)
class Addition:
    """One state entry to add to one optimizer, or (``replaces``) to put in place of a phantom-step entry."""

    file: str
    location: str
    address: tuple[ParamKey, ...]
    param: ParamKey
    state: tuple[tuple[str, AddedValue], ...]
    """The entry's keys and values; () adds ``{}``."""
    replaces: bool = False
    """Whether it replaces the parameter's entry (``step`` 1, all-zero moments: ``fix --reset-phantom-step``)."""
    group: int | None = None
    """For a parameter in no param group (``fix --add-from-model``): the group it joins, at the end of its
    ``params``; None for a parameter a group already lists."""
    like: ParamKey | None = None
    """For a parameter joining a group of a flattened state dict, which repeats the group's hyperparameters for
    each parameter: a parameter of that group, whose hyperparameters it takes."""

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.state)

    @property
    def dtypes(self) -> tuple[tuple[str, str], ...]:
        """Each tensor it creates, by its key: the tensor's dtype (a plain value, SGD's ``None``, has none)."""
        return tuple((key, value.dtype) for key, value in self.state if isinstance(value, FreshTensor))


@dataclass(frozen=True)
class ParamChange:
    """One parameter of one optimizer renamed (``new``), or dropped (``new`` is None): its state entry and its
    place in ``param_groups`` both. Applied before additions, which name parameters by their new names."""

    file: str
    location: str
    address: tuple[ParamKey, ...]
    old: ParamKey
    new: ParamKey | None


class FilledOptimizer(NamedTuple):
    """An optimizer a fresh fill fills, and the optimizer kind its fresh state is built for."""

    file: str
    location: str
    kind: str


@dataclass(frozen=True)
class RepairPlan:
    fill: PlanFill
    additions: tuple[Addition, ...]
    optimizers: tuple[FilledOptimizer, ...] = ()
    """For a fresh fill: each optimizer the plan fills, with its kind."""
    changes: tuple[ParamChange, ...] = ()
    """Parameters renamed or dropped (``fix --rename``, ``--drop``, ``--drop-not-in-model``)."""
    options: tuple[GroupOption, ...] = ()
    """Param-group options added: what the loading torch asks for and the checkpoint lacks."""
    fill_notes: tuple[str, ...] = ()
    """Where the default fill gave ``{}`` because fresh state could not be built: one line an optimizer, saying why
    and through which loaders ``{}`` resumes exactly."""
    older_forms: tuple[str, ...] = ()
    """Files written in the form the loading torch reads, older than the one that wrote them (a DCP ``.metadata``
    of torch 2.15, for a torch before it: ``TensorProperties`` without ``strides``)."""

    def for_file(self, file: str) -> tuple[Addition, ...]:
        return tuple(addition for addition in self.additions if addition.file == file)

    def changes_for(self, file: str) -> tuple[ParamChange, ...]:
        return tuple(change for change in self.changes if change.file == file)

    def options_for(self, file: str) -> tuple[GroupOption, ...]:
        return tuple(option for option in self.options if option.file == file)
