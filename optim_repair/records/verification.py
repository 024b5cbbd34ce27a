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
    proof: str | None = None
    """How copies made inside an object store were proven (``S3 CRC32``), or None where every byte was read."""

    def __add__(self, other: Verification) -> Verification:
        linked = self.linked + other.linked
        return Verification(self.tensors + other.tensors, self.bytes + other.bytes, linked, self.proof or other.proof)


NOTHING = Verification(0, 0)
