"""What differs between two checkpoints: per optimizer, what it holds; per leaf, whether it is the same.

Built by ``decisions.difference`` from the two inventories and by ``checkpoint.diffing`` from the bytes; read
by ``render``. No torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Movement = Literal["advanced", "same", "went back", "unknown"]
What = Literal["only in A", "only in B", "kind", "dtype", "shape", "stride", "sharing", "bytes", "value", "chunks"]


How = Literal[
    "rewritten", "copied", "hard-linked", "downloaded", "added", "link", "same", "differs", "only in A", "only in B"
]


@dataclass(frozen=True)
class FileChange:
    """One file of two checkpoints compared (``same``, ``differs``, ``only in A``, ``only in B``), or of a repaired
    copy and how it came to be there: ``rewritten`` with the additions, ``copied``, ``hard-linked`` or
    ``downloaded`` from the original, ``added`` (a DCP checkpoint's new shard), or kept a ``link``."""

    file: str
    how: How
    bytes: int
    """Its size (compared: the bytes of the tensors and files it holds)."""


@dataclass(frozen=True)
class StepChange:
    """A parameter's ``step`` on each side (None: no state, or not read) and which way it moved."""

    param: str
    a: float | int | None
    b: float | int | None
    movement: Movement


@dataclass(frozen=True)
class OptionChange:
    """A hyperparameter of one param group that differs (``lr``), as each side holds it (None: absent)."""

    group: int
    key: str
    a: str | None
    b: str | None


@dataclass(frozen=True)
class OptimizerDifference:
    """One optimizer found on both sides (matched by where it sits) and what differs in what it holds."""

    location: str
    file_a: str
    file_b: str
    only_in_a: tuple[str, ...]
    """Parameters in A's ``param_groups`` and not in B's."""
    only_in_b: tuple[str, ...]
    appeared: tuple[str, ...]
    """Parameters with state in B and none in A (the entries a repair adds)."""
    vanished: tuple[str, ...]
    keys_appeared: tuple[tuple[str, str], ...]
    """``(param, key)``: a state entry's key in B and not in A (``exp_avg_sq`` of an entry that was ``{}``)."""
    keys_vanished: tuple[tuple[str, str], ...]
    steps: tuple[StepChange, ...]
    """Every parameter on both sides with a ``step`` on either."""
    options: tuple[OptionChange, ...]

    @property
    def differs(self) -> bool:
        return bool(
            self.only_in_a
            or self.only_in_b
            or self.appeared
            or self.vanished
            or self.keys_appeared
            or self.keys_vanished
            or self.options
            or any(step.movement != "same" for step in self.steps if step.movement != "unknown")
        )

    def moved(self, movement: Movement) -> tuple[StepChange, ...]:
        return tuple(step for step in self.steps if step.movement == movement)


@dataclass(frozen=True)
class LeafDifference:
    """One leaf that is not the same on both sides, and how."""

    name: str
    what: What
    a: str | None
    """What A holds there, for humans (``float32 (4, 8)``); None where A holds nothing."""
    b: str | None
    elements: int | None = None
    """For ``bytes``: how many elements differ in their bits."""
    numel: int | None = None
    largest: float | None = None
    """For ``bytes``: the largest absolute difference of two elements that differ, where the dtype decodes."""
    non_finite: bool = False
    """For ``bytes``: whether an element that differs is NaN or infinite on one side (its difference is none)."""


@dataclass(frozen=True)
class LeafTally:
    """How many leaves were compared and how: tensors, values and raw bytes."""

    tensors: int = 0
    values: int = 0
    raw: int = 0
    identical: int = 0
    bytes_compared: int = 0
    """Bytes read and compared on each side (0 with ``metadata_only``)."""


@dataclass(frozen=True)
class Difference:
    """Two checkpoints compared."""

    a: str
    b: str
    metadata_only: bool
    optimizers: tuple[OptimizerDifference, ...]
    optimizers_only_in_a: tuple[str, ...]
    optimizers_only_in_b: tuple[str, ...]
    leaves: tuple[LeafDifference, ...]
    tally: LeafTally
    seconds: float = 0.0
    files: tuple[FileChange, ...] = ()

    @property
    def same(self) -> bool:
        return not (
            self.leaves
            or self.optimizers_only_in_a
            or self.optimizers_only_in_b
            or any(optimizer.differs for optimizer in self.optimizers)
        )
