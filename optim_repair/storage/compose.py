"""Composing a new object inside a store: new bytes, a range of another object copied there, new bytes again.

One multipart upload: the head and the first bytes of the range (S3 takes no part under ``MIN_PART`` but the
last), ``UploadPartCopy`` of the rest of the range, and the tail; ``CompleteMultipartUpload`` with
``If-None-Match: *``, aborted on any failure. Only the head, the tail and the original's bytes around the range
pass through the client. The composed object's CRC-32 follows from the original's and the bytes read
(``crc.middle``): sent with the completion, the store checks it, and it is compared with what the store returns.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass

from optim_repair.storage import crc, s3_writes
from optim_repair.storage.objects import Copied, StoredObject, encoded_crc32
from optim_repair.storage.s3 import S3Store

MIN_PART = 5 << 20
"""The smallest part S3 takes, but for the last."""


@dataclass(frozen=True)
class Composed:
    """What the store says of the new object (its CRC-32, None without one, and its ETag), and the CRC-32 it must
    have (None where the original has none to derive it from)."""

    written: Copied
    expected: str | None


def _decoded(value: str | None) -> int | None:
    return None if value is None else int.from_bytes(base64.b64decode(value), "big")


def compose(
    store: S3Store,
    key: str,
    head: bytes,
    original: tuple[S3Store, str, StoredObject],
    kept: tuple[int, int],
    tail: bytes,
    original_crc32: str | None,
) -> Composed:
    """Write the new object ``key`` of ``store``: ``head``, then bytes ``kept`` (start, end) of the ``original``
    object (its store, key, and listing), then ``tail``; never over an object that exists."""
    holder, source, stored = original
    start, end = kept
    first = max(MIN_PART - len(head), 0)
    if end - start < first + MIN_PART:  # too little to copy in a part of its own: all of it is uploaded
        body = head + holder.get_range(source, stored, start, end) + tail
        return Composed(s3_writes.put_bytes(store, key, body), encoded_crc32(zlib.crc32(body)))
    before = holder.get_range(source, stored, 0, start + first)
    after = holder.get_range(source, stored, end, stored.size)
    opening = head + before[start:]
    copied = (start + first, end)
    expected = None
    whole = _decoded(original_crc32)
    if whole is not None:
        middle = crc.middle(whole, zlib.crc32(before), zlib.crc32(after), copied[1] - copied[0], len(after))
        joined = crc.combine(zlib.crc32(opening), middle, copied[1] - copied[0])
        expected = encoded_crc32(crc.combine(joined, zlib.crc32(tail), len(tail)))
    cuts = list(range(copied[0], copied[1], s3_writes.COPY_PART))[1:]
    if cuts and copied[1] - cuts[-1] < MIN_PART:
        cuts.pop()  # the last piece joins the one before it: no copied part under MIN_PART
    ranges = list(zip([copied[0], *cuts], [*cuts, copied[1]], strict=True))
    written = s3_writes.multipart(
        store,
        key,
        [("bytes", opening), *(("copy", (holder.bucket, source, stored, a, b)) for a, b in ranges), ("bytes", tail)],
        expected,
    )
    return Composed(written, expected)
