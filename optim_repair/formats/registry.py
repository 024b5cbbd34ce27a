"""One registry from names to roles to adapters, used by every listing: a local walk and a store's listing alike.

A file's role follows from its name (``role_of``); a directory holding ``.metadata`` is a DCP checkpoint, which
each listing finds by ``is_dcp_metadata``. The formats that hold optimizers have an adapter (``ADAPTERS``), which
plans a file in its format. A new format is a package with its ``adapter.py``, and a row here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Literal

from optim_repair.formats.dcp import METADATA_FILE, is_rank_metadata
from optim_repair.formats.dcp import adapter as dcp_adapter
from optim_repair.formats.deepspeed_universal import adapter as universal_adapter
from optim_repair.formats.planned import Parsed, PlannedFile
from optim_repair.formats.safetensors import SAFETENSORS_SUFFIX
from optim_repair.formats.torchfile import TORCH_SUFFIXES
from optim_repair.formats.torchfile import adapter as torch_adapter
from optim_repair.records.inventory import FileInventory
from optim_repair.records.repair_plan import RepairPlan

Role = Literal["torch", "safetensors", "dcp", "file", "directory", "special"]
"""``torch``: may hold optimizers; ``safetensors``: model weights; ``dcp``: a DCP checkpoint directory;
``file``: anything else, copied as it is (every member of a DCP checkpoint); ``directory``: a directory
to recreate; ``special``: a FIFO, socket or device, which is never opened."""


def role_of(name: str) -> Role:
    """The role of a file by its name (a path or key; its last part decides): ``torch``, ``safetensors`` or
    ``file``."""
    suffix = PurePosixPath(name).suffix
    if suffix == SAFETENSORS_SUFFIX:
        return "safetensors"
    return "torch" if suffix in TORCH_SUFFIXES else "file"


def is_dcp_metadata(name: str) -> bool:
    """Whether a file by this name commits a DCP checkpoint (the directory holding it is one): its ``.metadata``,
    or one rank's own ``__<rank>.metadata`` where it was saved without collectives."""
    base = PurePosixPath(name).name
    return base == METADATA_FILE or is_rank_metadata(base)


Adapter = Callable[[Path, FileInventory, RepairPlan, Parsed], PlannedFile]
"""Plans one file of the inventory (at its path) in its format; raises what its writer would refuse."""

ADAPTERS: Mapping[str, Adapter] = {
    "torch-zip": torch_adapter.plan_file,
    "torch-legacy": torch_adapter.plan_file,
    "dcp": dcp_adapter.plan_file,
    "deepspeed-universal": universal_adapter.plan_file,
}
"""The adapter of each format that holds optimizers (``FileInventory.format``)."""
