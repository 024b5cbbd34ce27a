"""What a run moved to and from object storage: requests made, bytes read, written and copied server-side."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    """The requests one run made of an object store, and the bytes they moved."""

    requests: int
    read: int
    """Bytes received: object bodies and ranges."""
    written: int
    """Bytes sent: new objects."""
    copied: int
    """Bytes the store copied from object to object, which never passed through optim-repair."""
