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
    """How copies made inside an object store were proven (``S3 CRC32``, ``GCS CRC32C``; ``read back``; for a
    local copy uploaded, ``UPLOADED`` and the checksum each upload was checked by; ``PINNED`` and the version tag,
    where they were not proven), or None where every byte was read."""

    def __add__(self, other: Verification) -> Verification:
        linked = self.linked + other.linked
        return Verification(self.tensors + other.tensors, self.bytes + other.bytes, linked, self.proof or other.proof)


NOTHING = Verification(0, 0)
UPLOADED = "uploaded, checked by "
"""How a proof begins for a copy proven on this machine, then uploaded to a store."""
PINNED = "pinned to "
"""How a proof begins for copies a store made pinned to their source's version tag and proved by no checksum
(``WritableStore.pinned``): not proven."""


@dataclass(frozen=True)
class HolderProof:
    """What the holder of a copy proves by its own means, so that a verifier checks where those bytes lie and does
    not read them: an object store proves a server-side copy, or an object it composed, by its checksums of whole
    objects. A verifier is given it; by default (``READ_EVERYTHING``) it reads every byte itself."""

    unchanged_files: bool = False
    """Every file the repair does not write is a whole copy the holder proves (a DCP checkpoint's shards copied
    inside a store): the directory the verifier reads holds only what the repair wrote, and every original entry
    must lie where it lay, in the copy of its own file."""
    kept: tuple[int, int, int] | None = None
    """``(start, end, moved)``: the copy's bytes from ``start + moved`` are the original's from ``start`` to ``end``
    (a spliced torch file composed inside a store): a storage there must lie ``moved`` bytes on, and is not read."""


READ_EVERYTHING = HolderProof()
