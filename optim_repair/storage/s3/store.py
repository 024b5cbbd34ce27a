"""An S3 store, read (``reading.S3Reader``) and written, never over an object that exists.

Every object is marked with its run, written in parts where it is large; copies inside the store are pinned to
the version read, deletes to the version a run wrote.

A write whose answer was lost (the write took effect, the client retried, the retry found the object there) is
resolved by reading the key back: the object carries this run's id (``RUN_METADATA``), or it is another
writer's (``ObjectExists``).

A torch file's splice is composed by one multipart upload: the head and the first bytes of the kept range (S3
takes no part under ``MIN_PART`` but the last), ``UploadPartCopy`` of the rest of the range, and the tail;
``CompleteMultipartUpload`` with ``If-None-Match: *``, aborted on any failure. Only the head, the tail and the
original's bytes around the range pass through the client. The composed object's CRC-32 follows from the
original's and the bytes read (``crc.middle``): sent with the completion, the store checks it, and it is compared
with what the store returns.
"""

from __future__ import annotations

import base64
import contextlib
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from optim_repair.errors import InputError, ObjectExists, shown_name
from optim_repair.storage import crc
from optim_repair.storage.answers import CHANGED
from optim_repair.storage.interface import Store
from optim_repair.storage.objects import Composed, Copied, StoredObject, crc32_of, encoded_crc32
from optim_repair.storage.s3.reading import RUN_METADATA, S3Reader

COPY_LIMIT = 5 << 30
"""The largest object one ``CopyObject`` copies; a larger one is copied in parts of ``COPY_PART``."""
COPY_PART = 1 << 30
PUT_LIMIT = 5 << 30
"""The largest object one ``PutObject`` writes; a larger file is uploaded in parts of at least ``PUT_PART``."""
PUT_PART = 64 << 20
MIN_PART = 5 << 20
"""The smallest part S3 takes, but for the last."""


class S3Store(S3Reader):
    """One bucket of an S3 store, read and written: what the checkpoint layer's ``WritableStore`` asks of a store."""

    composes_ranges = True
    pinned = None

    def scratch_keys(self, key: str) -> list[str]:
        """None: a composition is one multipart upload to ``key``."""
        return []

    def proven_by_tags(self, original: StoredObject, copied: Copied) -> str | None:
        """An object S3 stored in one part has its MD5 for ETag (a multipart one has ``-`` and a part count in it):
        a copy with the same ETag holds the same bytes."""
        return "S3 ETag (MD5)" if "-" not in original.etag and copied.etag == original.etag else None

    def _written(self, key: str, write: Callable[[], dict[str, Any]]) -> Copied:
        """What ``write`` (a request that replaces nothing) wrote at ``key``. When it finds an object there, the
        object is read back: this run's own (the answer to a write that succeeded was lost, and its retry found
        it), or another writer's (``ObjectExists``)."""
        try:
            answer = write()
        except (ObjectExists, InputError) as exc:
            if isinstance(exc, InputError) and "no such upload" not in exc.reason:
                raise
            found = self.owner(key)
            if found is None or found[0] != self.run:
                raise ObjectExists("exists: another writer put an object there first", path=self.where(key)) from None
            return found[1]
        return Copied(answer.get("ChecksumCRC32"), self.etag(answer, key, writing=True))

    def put_file(self, key: str, path: Path, size: int) -> Copied:
        """Write the file ``path`` as the new object ``key``, never over one that exists; the store checks the
        CRC32 sent with it (or with each part, over ``PUT_LIMIT``) on receipt."""
        if size > PUT_LIMIT:
            return self._put_in_parts(key, path, size)

        def put() -> dict[str, Any]:
            with path.open("rb") as stream:
                answer: dict[str, Any] = self.request(
                    "put_object", key, writing=True, Key=key, Body=stream, ContentLength=size,
                    IfNoneMatch="*", ChecksumAlgorithm="CRC32", Metadata={RUN_METADATA: self.run},
                )  # fmt: skip
            self.count(written=size)
            return answer

        return self._written(key, put)

    def _put_in_parts(self, key: str, path: Path, size: int) -> Copied:
        part = max(PUT_PART, -(-size // 10_000))  # S3 takes at most 10,000 parts
        parts = [("file", (path, offset, min(part, size - offset))) for offset in range(0, size, part)]
        return self.multipart(key, parts, crc32_of(path))

    def put_bytes(self, key: str, data: bytes) -> Copied:
        """Write ``data`` as the new object ``key``, never over one that exists, with its CRC32."""

        def put() -> dict[str, Any]:
            answer: dict[str, Any] = self.request(
                "put_object", key, writing=True, Key=key, Body=data, IfNoneMatch="*", ChecksumAlgorithm="CRC32",
                Metadata={RUN_METADATA: self.run},
            )  # fmt: skip
            self.count(written=len(data))
            return answer

        return self._written(key, put)

    def replace_own(self, key: str, data: bytes, etag: str) -> Copied:
        """Write ``data`` over this run's object ``key`` (``etag``, as this run last wrote it); ``ObjectExists``
        when the object there is no longer that one."""
        answer = self.request(
            "put_object", key, writing=True, Key=key, Body=data, IfMatch=etag, ChecksumAlgorithm="CRC32",
            Metadata={RUN_METADATA: self.run},
        )  # fmt: skip
        self.count(written=len(data))
        return Copied(answer.get("ChecksumCRC32"), self.etag(answer, key, writing=True))

    def multipart(self, key: str, parts: Sequence[tuple[str, Any]], expected: str | None) -> Copied:
        """Write the new object ``key`` from ``parts``, ``WORKERS`` at a time: ``("bytes", data)``, ``("file",
        (path, offset, length))``, or ``("copy", (bucket, source, stored, start, end))``, a range of another object
        copied inside the self. Its CRC-32 is the whole object's (``FULL_OBJECT``), checked by the store
        against ``expected`` where given; never over an object that exists; aborted on any failure (a failed
        abort leaves the upload to the next run, which aborts it)."""
        upload = self.request(
            "create_multipart_upload", key, writing=True, Key=key, ChecksumAlgorithm="CRC32",
            ChecksumType="FULL_OBJECT", Metadata={RUN_METADATA: self.run},
        )["UploadId"]  # fmt: skip

        def send(numbered: tuple[int, tuple[str, Any]]) -> dict[str, Any]:
            number, (kind, what) = numbered
            common = {"Key": key, "UploadId": upload, "PartNumber": number}
            if kind == "copy":
                bucket, source, stored, start, end = what
                pinned = {"Bucket": bucket, "Key": source}
                answer = self.request(
                    "upload_part_copy", key, writing=True, CopySource=pinned, CopySourceIfMatch=stored.etag,
                    CopySourceRange=f"bytes={start}-{end - 1}", **common,
                )["CopyPartResult"]  # fmt: skip
                self.count(copied=end - start)
            else:
                data = what if kind == "bytes" else _slice(*what)
                answer = self.request("upload_part", key, writing=True, Body=data, ChecksumAlgorithm="CRC32", **common)
                self.count(written=len(data))
            etag = self.etag(answer, key, writing=True)
            found = {"PartNumber": number, "ETag": etag, "ChecksumCRC32": answer.get("ChecksumCRC32")}
            return {name: value for name, value in found.items() if value is not None}

        whole = {"ChecksumCRC32": expected} if expected is not None else {}
        try:
            sent = list(self.each(send, list(enumerate(parts, 1))))

            def complete() -> dict[str, Any]:
                return dict(
                    self.request(
                        "complete_multipart_upload", key, writing=True, Key=key, UploadId=upload,
                        MultipartUpload={"Parts": sent}, ChecksumType="FULL_OBJECT", IfNoneMatch="*", **whole,
                    )
                )  # fmt: skip

            written = self._written(key, complete)
        except BaseException:
            with contextlib.suppress(Exception):  # the failure that matters is the one raised
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            raise
        if written.checksum is None:
            return self.checksum(key)
        return written

    def copy(self, source: str, stored: StoredObject, target: str, *, source_bucket: str) -> Copied:
        """Copy ``source`` of ``source_bucket`` (the version listed) to the new object ``target`` inside the store,
        never over one that exists; the copy's CRC32 is computed by the self."""
        try:
            copied = self._copy(source_bucket, source, stored, target)
        except ObjectExists:
            original = self.sibling(source_bucket)
            if original.head(source).etag != stored.etag:  # a 412 of the pin, not of the no-replace
                raise InputError(CHANGED, path=original.where(source)) from None
            raise
        return copied

    def _copy(self, bucket: str, source: str, stored: StoredObject, target: str) -> Copied:
        if stored.size > COPY_LIMIT:  # in parts, each counted as it is copied
            ranges = [(start, min(start + COPY_PART, stored.size)) for start in range(0, stored.size, COPY_PART)]
            return self.multipart(target, [("copy", (bucket, source, stored, a, b)) for a, b in ranges], None)

        def copy() -> dict[str, Any]:
            answer: dict[str, Any] = self.request(
                "copy_object", target, writing=True, Key=target, CopySource={"Bucket": bucket, "Key": source},
                CopySourceIfMatch=stored.etag, IfNoneMatch="*", ChecksumAlgorithm="CRC32",
                MetadataDirective="REPLACE", Metadata={RUN_METADATA: self.run},
            )["CopyObjectResult"]  # fmt: skip
            self.count(copied=stored.size)
            return answer

        return self._written(target, copy)

    def abort_uploads(self, prefix: str, *, exact: bool = False) -> int:
        """Abort every multipart upload begun under ``prefix`` (with ``exact``, to that key alone) and never completed
        (a killed run's: invisible, but stored and billed until aborted); return how many. Only for a run that holds
        the claim on that prefix or key."""
        uploads = self.request("list_multipart_uploads", prefix, Prefix=prefix).get("Uploads", ())
        aborted = 0
        for upload in uploads:
            key = upload.get("Key", "")
            if not (isinstance(key, str) and key.startswith(prefix)):
                raise InputError(
                    f"listed an upload to {shown_name(str(key))}, which is not under it", path=self.where(prefix)
                )
            if exact and key != prefix:
                continue  # another object's upload (optimizer.pth beside optimizer.pt): not this claim's
            self.request("abort_multipart_upload", key, writing=True, Key=key, UploadId=upload["UploadId"])
            aborted += 1
        return aborted

    def delete_own(self, key: str, etag: str) -> None:
        """Delete ``key`` if it is still the object ``etag`` (one this run, or the stopped run it cleans up after,
        wrote); an object replaced since, or gone, is left as it is."""
        try:
            self.request("delete_object", key, writing=True, Key=key, IfMatch=etag)
        except ObjectExists:  # 412: another writer's object now
            return
        except InputError as exc:
            if "no such object" not in exc.reason:
                raise

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (what the user allowed replacing), a thousand a request."""
        batch = list(keys)
        for start in range(0, len(batch), 1000):
            objects = [{"Key": key} for key in batch[start : start + 1000]]
            self.request("delete_objects", objects[0]["Key"], writing=True, Delete={"Objects": objects, "Quiet": True})

    def compose(
        self,
        key: str,
        head: bytes,
        original: tuple[Store, str, StoredObject],
        kept: tuple[int, int],
        tail: bytes,
        original_checksum: str | None,
    ) -> Composed:
        """Write the new object ``key``: ``head``, then bytes ``kept`` (start, end) of the ``original``
        object (its store, key, and listing), then ``tail``; never over an object that exists."""
        holder, source, stored = original
        start, end = kept
        first = max(MIN_PART - len(head), 0)
        if end - start < first + MIN_PART:  # too little to copy in a part of its own: all of it is uploaded
            body = head + holder.get_range(source, stored, start, end) + tail
            return Composed(self.put_bytes(key, body), encoded_crc32(zlib.crc32(body)))
        before = holder.get_range(source, stored, 0, start + first)
        after = holder.get_range(source, stored, end, stored.size)
        opening = head + before[start:]
        copied = (start + first, end)
        expected = None
        whole = _decoded(original_checksum)
        if whole is not None:
            middle = crc.middle(whole, zlib.crc32(before), zlib.crc32(after), copied[1] - copied[0], len(after))
            joined = crc.combine(zlib.crc32(opening), middle, copied[1] - copied[0])
            expected = encoded_crc32(crc.combine(joined, zlib.crc32(tail), len(tail)))
        cuts = list(range(copied[0], copied[1], COPY_PART))[1:]
        if cuts and copied[1] - cuts[-1] < MIN_PART:
            cuts.pop()  # the last piece joins the one before it: no copied part under MIN_PART
        ranges = list(zip([copied[0], *cuts], [*cuts, copied[1]], strict=True))
        written = self.multipart(
            key,
            [
                ("bytes", opening),
                *(("copy", (holder.bucket, source, stored, a, b)) for a, b in ranges),
                ("bytes", tail),
            ],
            expected,
        )
        return Composed(written, expected)


def _slice(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as stream:
        stream.seek(offset)
        return stream.read(length)


def _decoded(value: str | None) -> int | None:
    return None if value is None else int.from_bytes(base64.b64decode(value), "big")
