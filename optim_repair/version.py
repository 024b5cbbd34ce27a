"""The versions a report names: optim-repair's and the installed torch's.

optim-repair's is in the one place the package, its reports and pyproject.toml read it from.
"""

import functools
import importlib.metadata
import re
from typing import NamedTuple

__version__ = "0.1.0"


class Versions(NamedTuple):
    """The versions a report was made with: optim-repair's, and the installed torch's (None without one)."""

    optim_repair: str
    torch: str | None


@functools.cache
def versions() -> Versions:
    """optim-repair's version and the installed torch's, found without importing torch (from the
    environment's package metadata, read once)."""
    try:
        torch_version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return Versions(__version__, torch_version)


def torch_release() -> tuple[int, int] | None:
    """The installed torch's major and minor version (``2.13.0+cpu``: (2, 13)), or None without torch."""
    found = re.match(r"(\d+)\.(\d+)", versions().torch or "")
    return (int(found[1]), int(found[2])) if found else None
