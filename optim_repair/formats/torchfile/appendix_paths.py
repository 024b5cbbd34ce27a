"""Where a plan's entries go in a torch file's pickle when they are appended to it, for the writer and the proof alike.

An appendix sets each optimizer's new entries in one dict (its ``state``, or a flattened optimizer itself), which it
reaches from the root through dicts alone (``appendix``, ``appendix_proof``); these say which dict that is, and what
the pickle must be for entries appended after it to be read at all.
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Sequence
from typing import Any

from optim_repair.formats.torchfile.zipformat import ZipTorchFile
from optim_repair.records import keys
from optim_repair.records.repair_plan import Addition

SETTABLE = (dict, collections.OrderedDict)
"""The containers the appendix sets items in: exactly these types (torch's weights-only loader refuses others)."""


def target_path(optimizer: Any, address: tuple[Any, ...]) -> tuple[Any, ...]:
    """The keys from the root to the dict an optimizer's entries go in: its ``state``, or a flattened optimizer."""
    return (*address, keys.STATE) if keys.is_nested(optimizer) else address


def by_address(additions: Sequence[Addition]) -> dict[tuple[Any, ...], list[Addition]]:
    """The additions grouped by the optimizer they add to, in the order of the plan."""
    grouped: dict[tuple[Any, ...], list[Addition]] = {}
    for addition in additions:
        grouped.setdefault(addition.address, []).append(addition)
    return grouped


def whole_pickle(torch_file: ZipTorchFile) -> bool:
    """Whether the file's pickle ends with its ``STOP``: an appendix after anything else would go unread."""
    return torch_file.graph.end == len(torch_file.data) and torch_file.data.endswith(pickle.STOP)
