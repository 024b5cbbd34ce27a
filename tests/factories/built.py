"""What a checkpoint factory returns: the checkpoint it wrote and what is known to be wrong with it.

Every factory takes a directory (pytest's ``tmp_path``), writes inside it and returns a
:class:`Built`:

* ``Built.path`` is what a user would point the tool at: a checkpoint directory
  (``checkpoint-3/``) or a single file (``healthy.pt``).
* ``Built.missing`` maps each optimizer state dict written (a :class:`Site`: a file relative to
  ``path``, ``""`` when ``path`` is the file, and the keys leading to the state dict inside it)
  to the parameter keys whose ``state`` entry is absent although the optimizer would create one
  on a step. Keys are names (``"head_unused.weight"``) in name-keyed state dicts
  (``get_optimizer_state_dict``) and integers in index-keyed ones (``optimizer.state_dict()``).
  Every optimizer written appears, with ``()`` when nothing is missing.
* ``Built.defects`` lists, per site, the parameters whose entry (or listing) was made wrong on
  purpose: ``{}`` entries, phantom-step entries, malformed entries, duplicated or orphan names.

Nothing here is mocked: models are trained for a few real steps with real optimizers, and
files are written with ``torch.save`` / ``safetensors`` exactly as the named trainers do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.factories.models import (
    ParamKey,
)

StateDict = dict[str, Any]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Site:
    """Where one optimizer state dict lies: a file under ``Built.path`` and the keys to it."""

    file: str = ""
    """Path relative to ``Built.path`` with ``/`` separators; ``""`` when ``path`` is the file."""
    address: tuple[ParamKey, ...] = ()
    """Dict keys and list indices from the loaded object to the state dict; ``()``: top level."""

    @property
    def location(self) -> str:
        """The address for humans: ``optimizer_states[0]``, ``optimizers.actor``, ``""``."""
        text = ""
        for part in self.address:
            if isinstance(part, int):
                text += f"[{part}]"
            else:
                text += f".{part}" if text else part
        return text


@dataclass(frozen=True)
class Built:
    """A checkpoint a factory wrote, and what is known to be wrong with it."""

    path: Path
    missing: Mapping[Site, tuple[ParamKey, ...]]
    defects: Mapping[Site, tuple[ParamKey, ...]] = field(default_factory=dict)

    @property
    def sites(self) -> tuple[Site, ...]:
        """Every optimizer state dict written."""
        return tuple(self.missing)

    @property
    def site(self) -> Site:
        """The only optimizer state dict written (raises when there are several)."""
        if len(self.missing) != 1:
            raise ValueError(f"{len(self.missing)} optimizer sites, not one")
        return next(iter(self.missing))

    @property
    def all_missing(self) -> tuple[ParamKey, ...]:
        """Missing keys of every site, concatenated in site order."""
        return tuple(key for keys in self.missing.values() for key in keys)

    def file(self, site: Site | None = None) -> Path:
        """The file holding ``site`` (default: the only site)."""
        site = self.site if site is None else site
        return self.path / site.file if site.file else self.path

    def load(self, site: Site | None = None) -> StateDict:
        """The optimizer state dict at ``site``, read with ``torch.load(weights_only=True)``."""
        site = self.site if site is None else site
        obj: Any = torch.load(self.file(site), map_location="cpu", weights_only=True)
        for part in site.address:
            obj = obj[part]
        if not isinstance(obj, dict):
            raise TypeError(f"{site.location!r} is a {type(obj).__name__}")
        return obj


def iter_files(built: Built) -> Iterator[Path]:
    """Every file under ``built.path`` (or the file itself), sorted."""
    if built.path.is_file():
        yield built.path
        return
    yield from sorted(p for p in built.path.rglob("*") if p.is_file())
