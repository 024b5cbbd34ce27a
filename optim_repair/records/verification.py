"""What a verification proved: original tensors found bit-identical in the copy, bytes compared, files linked."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verification:
    """What a verification compared: original tensors found bit-identical in the copy, and bytes compared."""

    tensors: int
    bytes: int
    linked: tuple[str, ...] = ()
    """Files hard-linked to the original's (``link``): the same bytes by construction, not compared."""

    def __add__(self, other: Verification) -> Verification:
        return Verification(self.tensors + other.tensors, self.bytes + other.bytes, self.linked + other.linked)


NOTHING = Verification(0, 0)
