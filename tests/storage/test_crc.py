"""CRC-32 arithmetic against zlib's own: the checksum of joined bytes, and of a middle part from the whole's."""

from __future__ import annotations

import random
import zlib

from optim_repair.storage import crc


def test_combine_and_middle_agree_with_zlib_on_random_bytes() -> None:
    chance = random.Random(18)
    for _ in range(200):
        head, middle, tail = (chance.randbytes(chance.choice([0, 1, 7, 64, 4096, 70_000])) for _ in range(3))
        whole = zlib.crc32(head + middle + tail)
        assert crc.combine(zlib.crc32(head), zlib.crc32(middle), len(middle)) == zlib.crc32(head + middle)
        found = crc.middle(whole, zlib.crc32(head), zlib.crc32(tail), len(middle), len(tail))
        assert found == zlib.crc32(middle)


def test_a_change_anywhere_in_the_middle_changes_the_checksum_derived() -> None:
    head, middle, tail = b"head" * 100, bytearray(10_000), b"tail" * 50
    whole = zlib.crc32(head + bytes(middle) + tail)
    middle[5_000] = 1
    derived = crc.middle(whole, zlib.crc32(head), zlib.crc32(tail), len(middle), len(tail))
    assert derived != zlib.crc32(bytes(middle))


def test_middle_undoes_combine_at_the_lengths_of_large_checkpoints() -> None:
    """A 1 TiB middle and a 3 GiB tail, known only by their CRC-32s: the middle's comes back from the whole's."""
    head, middle, tail = 0x1234ABCD, 0x0BADF00D, 0xCAFEBABE
    whole = crc.combine(crc.combine(head, middle, 1 << 40), tail, 3 << 30)
    assert crc.middle(whole, head, tail, 1 << 40, 3 << 30) == middle


def test_crc32c_joins_and_splits_as_gcs_computes_it() -> None:
    import google_crc32c

    head, middle, tail = b"the head", bytes(range(256)) * 9, b"and the tail"
    value = google_crc32c.value
    whole = value(head + middle + tail)
    assert crc.combine(value(head), value(middle), len(middle), crc.CRC32C) == value(head + middle)
    assert crc.middle(whole, value(head), value(tail), len(middle), len(tail), crc.CRC32C) == value(middle)
    assert crc.combine(value(head), value(middle), len(middle)) != value(head + middle)  # CRC-32's polynomial
