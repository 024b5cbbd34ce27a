"""What every JSON document begins with: its schema version, the versions of optim-repair and torch, and its scanner."""

from __future__ import annotations

from typing import TypedDict

from optim_repair.formats.pickle_limits import SCANNER
from optim_repair.version import versions

SCHEMA_VERSION = 2


class VersionsDoc(TypedDict):
    optim_repair: str
    torch: str | None
    scanner: str


def versions_doc() -> VersionsDoc:
    found = versions()
    return {"optim_repair": found.optim_repair, "torch": found.torch, "scanner": SCANNER}
