"""The step census: who is not training, before a resume fails. Pure functions.

A parameter without optimizer state is only the extreme of one whose ``step`` lags the optimizer's largest: an
expert rarely routed, a vision tower that saw no images. Each parameter's ``step`` is what inspect already read
(a one-element tensor's value, or a plain number); a parameter without state stands at step 0, the far end of
the same scale. Where no step value was read (DCP, whose tensors inspect never reads; an optimizer that keeps no
``step``), there is no census.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from optim_repair.errors import shown_name
from optim_repair.records.inventory import OptimizerInventory, ParamKey, TensorMeta

Step = int | float
SHOWN_LAGGING = 5
"""How many of the most lagging parameters a notice names."""


@dataclass(frozen=True)
class StepCensus:
    """Every listed parameter's ``step`` (0 for one without state), as inspect read them."""

    steps: tuple[tuple[ParamKey, Step], ...]
    """Each parameter and its step, in the order the param groups list them."""

    @property
    def largest(self) -> Step:
        return max(step for _, step in self.steps)

    @property
    def distribution(self) -> tuple[tuple[Step, int], ...]:
        """How many parameters stand at each step, the largest step first."""
        return tuple(sorted(Counter(step for _, step in self.steps).items(), reverse=True))

    @property
    def lagging(self) -> tuple[tuple[ParamKey, Step], ...]:
        """The parameters whose step is below the largest, the furthest behind first (listing order among ties)."""
        largest = self.largest
        behind = [(index, param, step) for index, (param, step) in enumerate(self.steps) if step < largest]
        return tuple((param, step) for _, param, step in sorted(behind, key=lambda item: (item[2], item[0])))


def _step(value: object) -> Step | None:
    """A ``step`` value as inspect read it: a one-element tensor's, or a plain number (never a bool)."""
    if isinstance(value, TensorMeta):
        value = value.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def step_census(optimizer: OptimizerInventory, missing: tuple[ParamKey, ...]) -> StepCensus | None:
    """The census of ``optimizer``, whose ``missing`` parameters (and ``{}`` entries) have no state: step 0; None
    where no entry's step was read, or where the optimizer keeps no step."""
    known = {entry.param: _step(entry.get("step")) for entry in optimizer.entries if entry.values}
    if not known or any(step is None for step in known.values()):
        return None
    absent = set(missing) | {entry.param for entry in optimizer.entries if entry.is_empty}
    steps = []
    for param in dict.fromkeys(optimizer.params):
        step = 0 if param in absent else known.get(param)
        if step is not None:
            steps.append((param, step))
    return StepCensus(tuple(steps)) if steps else None


def lagging_notice_detail(census: StepCensus, reported: Collection[ParamKey] = ()) -> str | None:
    """What the ``lagging-steps`` notice says: the parameters whose step lags though they have state, and those
    without state at step 0, the worst first; None where none with state lags but those already ``reported``
    (phantom-step entries; the missing are reported as such)."""
    lagging = census.lagging
    if not any(step > 0 and param not in reported for param, step in lagging):
        return None
    shown = ", ".join(
        f"{shown_name(param) if isinstance(param, str) else param} ({step:g})"
        for param, step in lagging[:SHOWN_LAGGING]
    )
    more = f", and {len(lagging) - SHOWN_LAGGING} more" if len(lagging) > SHOWN_LAGGING else ""
    return (
        f"{len(lagging)} of {len(census.steps)} parameters lag behind the optimizer's largest step "
        f"({census.largest:g}): {shown}{more}; a parameter whose step lags gets fewer updates (an expert rarely "
        "routed, a branch that sees few inputs), and one at 0 has no state"
    )
