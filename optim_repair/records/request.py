"""What a repair is asked for, as frozen records that travel whole (as black's ``Mode`` does).

``PlanRequest`` holds the choices that decide the plan (``fix``'s ``--fill``, ``--optimizer``, ``--model``,
``--reset-phantom-step`` and the model changes); ``CopyRequest`` how the copy is written (``--force``,
``--link``, ``--no-sync``). The library's functions take them as keywords and pass them on as records.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optim_repair.records.repair_plan import FillChoice


@dataclass(frozen=True)
class Operations:
    """What ``fix`` is asked to change besides filling entries (its ``--rename``, ``--drop``, ... options)."""

    renames: tuple[tuple[str, str], ...] = ()
    """Regular expressions and their replacements, applied to every parameter name in turn."""
    drops: tuple[str, ...] = ()
    """Regular expressions: parameters whose (renamed) name matches one are dropped."""
    drop_not_in_model: bool = False
    add_from_model: bool = False
    to_group: int | None = None

    def __bool__(self) -> bool:
        return bool(self.renames or self.drops or self.drop_not_in_model or self.add_from_model)


NO_OPERATIONS = Operations()


@dataclass(frozen=True)
class PlanRequest:
    """The choices that decide a repair plan."""

    fill: FillChoice | None = None
    """``empty``, ``fresh``, or None for each format's default."""
    optimizer: str | None = None
    """The optimizer that wrote the state, when identification cannot tell (for a fresh fill)."""
    model: Path | str | None = None
    """Model weights for parameter shapes and model changes."""
    reset_phantom_step: bool = False
    operations: Operations = NO_OPERATIONS


@dataclass(frozen=True)
class CopyRequest:
    """How the repaired copy is written."""

    force: bool = False
    """Replace ``out`` when it exists."""
    link: bool = False
    """Hard-link the files the repair does not change instead of copying them."""
    sync: bool = True
    """Sync every file and directory written to the disk before verifying it."""
    read_back: bool = False
    """For a copy made inside a store: read every object back, instead of proving it by the store's checksums."""


DEFAULT_COPY = CopyRequest()
