"""The names training libraries give the steps of a run directory, spelled in this one place.

``checkpoint-N`` (transformers, accelerate), ``step-N`` (torchtitan), ``global_stepN`` (verl, DeepSpeed),
``iter_NNNNNNN`` (Megatron) and Lightning's ``epoch=E-step=S.ckpt`` name one step each; a run directory holds one
per save, and some libraries a tracker naming the last one they finished (``TRACKERS``).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import PurePosixPath

_STEP = re.compile(
    r"^(?:checkpoint-([0-9]+)|step-([0-9]+)|global_step([0-9]+)|iter_([0-9]+)|epoch=([0-9]+)-step=([0-9]+)\.ckpt)\Z"
)
"""Step names, in ASCII digits only: ``int`` reads other scripts' digits too (``checkpoint-٣٠٠`` as 300)."""


def step_number(name: str) -> tuple[int, int] | None:
    """The step a file or directory name gives (with Lightning's epoch, to order equal steps), or None."""
    found = _STEP.match(name)
    if found is None:
        return None
    plain, titan, verl, megatron, epoch, step = found.groups()
    if step is not None:
        return int(step), int(epoch)
    return int(plain or titan or verl or megatron), 0


def step_prefix(rel: str) -> str | None:
    """The part of a path inside the argument up to and including its step (``run/checkpoint-100``), or None
    for a path inside no step."""
    parts = PurePosixPath(rel).parts
    for index in range(len(parts) - 1, -1, -1):
        if step_number(parts[index]) is not None:
            return "/".join(parts[: index + 1])
    return None


HF_STARTED = "training_args.bin"
HF_COMMIT = "trainer_state.json"
"""The HF Trainer writes ``training_args.bin`` with the model, first, and ``trainer_state.json`` last: a step that
holds the one and not the other is still being saved (or its save died)."""


def save_under_way(names: Collection[str]) -> bool:
    """Whether the names of the files directly in a step show its library's save still under way: the HF Trainer's
    ``training_args.bin`` without its ``trainer_state.json``. (A DCP checkpoint without ``.metadata`` is judged by
    each listing itself.)"""
    return HF_STARTED in names and HF_COMMIT not in names


TRACKERS = ("latest", "latest_checkpointed_iteration.txt")
"""The files a run keeps naming its last saved step: DeepSpeed's ``latest`` (the step's tag, ``global_step100``;
elsewhere a link to the step) and Megatron's ``latest_checkpointed_iteration.txt`` (its iteration, ``100``)."""


def tracked_step(tracker: str, text: str) -> str | None:
    """The step a tracker's text names (``global_step100``; Megatron's ``100``: ``iter_0000100``), or None."""
    text = text.strip()
    if tracker == TRACKERS[1]:
        return f"iter_{int(text):07d}" if text.isascii() and text.isdigit() else None
    return text if step_number(text) is not None else None
