"""Writing into an S3 store, never over an object that exists.

Every object is marked with its run, written in parts where it is large; copies inside the store are pinned to
the version read, deletes to the version a run wrote.

A write whose answer was lost (the write took effect, the client retried, the retry found the object there) is
resolved by reading the key back: the object carries this run's id (``RUN_METADATA``), or it is another
writer's (``ObjectExists``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from optim_repair.errors import InputError, ObjectExists, shown_name
from optim_repair.storage.answers import CHANGED
from optim_repair.storage.objects import Copied, StoredObject, crc32_of
from optim_repair.storage.s3 import RUN_METADATA, S3Store

COPY_LIMIT = 5 << 30
"""The largest object one ``CopyObject`` copies; a larger one is copied in parts of ``COPY_PART``."""
COPY_PART = 1 << 30
PUT_LIMIT = 5 << 30
"""The largest object one ``PutObject`` writes; a larger file is uploaded in parts of at least ``PUT_PART``."""
PUT_PART = 64 << 20


def _written(store: S3Store, key: str, write: Callable[[], dict[str, Any]]) -> Copied:
    """What ``write`` (a request that replaces nothing) wrote at ``key``. When it finds an object there, the
    object is read back: this run's own (the answer to a write that succeeded was lost, and its retry found
    it), or another writer's (``ObjectExists``)."""
    try:
        answer = write()
    except (ObjectExists, InputError) as exc:
        if isinstance(exc, InputError) and "no such upload" not in exc.reason:
            raise
        found = store.owner(key)
        if found is None or found[0] != store.run:
            raise ObjectExists("exists: another writer put an object there first", path=store.where(key)) from None
        return found[1]
    return Copied(answer.get("ChecksumCRC32"), answer["ETag"])


def put_file(store: S3Store, key: str, path: Path, size: int) -> Copied:
    """Write the file ``path`` as the new object ``key``, never over one that exists; the store checks the
    CRC32 sent with it (or with each part, over ``PUT_LIMIT``) on receipt."""
    if size > PUT_LIMIT:
        return _put_in_parts(store, key, path, size)

    def put() -> dict[str, Any]:
        with path.open("rb") as stream:
            answer: dict[str, Any] = store.request(
                "put_object", key, writing=True, Key=key, Body=stream, ContentLength=size,
                IfNoneMatch="*", ChecksumAlgorithm="CRC32", Metadata={RUN_METADATA: store.run},
            )  # fmt: skip
        store.count(written=size)
        return answer

    return _written(store, key, put)


def _put_in_parts(store: S3Store, key: str, path: Path, size: int) -> Copied:
    part = max(PUT_PART, -(-size // 10_000))  # S3 takes at most 10,000 parts
    parts = [("file", (path, offset, min(part, size - offset))) for offset in range(0, size, part)]
    return multipart(store, key, parts, crc32_of(path))


def put_bytes(store: S3Store, key: str, data: bytes) -> Copied:
    """Write ``data`` as the new object ``key``, never over one that exists, with its CRC32."""

    def put() -> dict[str, Any]:
        answer: dict[str, Any] = store.request(
            "put_object", key, writing=True, Key=key, Body=data, IfNoneMatch="*", ChecksumAlgorithm="CRC32",
            Metadata={RUN_METADATA: store.run},
        )  # fmt: skip
        store.count(written=len(data))
        return answer

    return _written(store, key, put)


def replace_own(store: S3Store, key: str, data: bytes, etag: str) -> Copied:
    """Write ``data`` over this run's object ``key`` (``etag``, as this run last wrote it); ``ObjectExists``
    when the object there is no longer that one."""
    answer = store.request(
        "put_object", key, writing=True, Key=key, Body=data, IfMatch=etag, ChecksumAlgorithm="CRC32",
        Metadata={RUN_METADATA: store.run},
    )  # fmt: skip
    store.count(written=len(data))
    return Copied(answer.get("ChecksumCRC32"), answer["ETag"])


def multipart(store: S3Store, key: str, parts: Sequence[tuple[str, Any]], expected: str | None) -> Copied:
    """Write the new object ``key`` from ``parts``, ``WORKERS`` at a time: ``("bytes", data)``, ``("file",
    (path, offset, length))``, or ``("copy", (bucket, source, stored, start, end))``, a range of another object
    copied inside the store. Its CRC-32 is the whole object's (``FULL_OBJECT``), checked by the store
    against ``expected`` where given; never over an object that exists; aborted on any failure (a failed
    abort leaves the upload to the next run, which aborts it)."""
    upload = store.request(
        "create_multipart_upload", key, writing=True, Key=key, ChecksumAlgorithm="CRC32",
        ChecksumType="FULL_OBJECT", Metadata={RUN_METADATA: store.run},
    )["UploadId"]  # fmt: skip

    def send(numbered: tuple[int, tuple[str, Any]]) -> dict[str, Any]:
        number, (kind, what) = numbered
        common = {"Key": key, "UploadId": upload, "PartNumber": number}
        if kind == "copy":
            bucket, source, stored, start, end = what
            pinned = {"Bucket": bucket, "Key": source}
            answer = store.request(
                "upload_part_copy", key, writing=True, CopySource=pinned, CopySourceIfMatch=stored.etag,
                CopySourceRange=f"bytes={start}-{end - 1}", **common,
            )["CopyPartResult"]  # fmt: skip
            store.count(copied=end - start)
        else:
            data = what if kind == "bytes" else _slice(*what)
            answer = store.request("upload_part", key, writing=True, Body=data, ChecksumAlgorithm="CRC32", **common)
            store.count(written=len(data))
        found = {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32": answer.get("ChecksumCRC32")}
        return {name: value for name, value in found.items() if value is not None}

    whole = {"ChecksumCRC32": expected} if expected is not None else {}
    try:
        sent = list(store.each(send, list(enumerate(parts, 1))))

        def complete() -> dict[str, Any]:
            return dict(
                store.request(
                    "complete_multipart_upload", key, writing=True, Key=key, UploadId=upload,
                    MultipartUpload={"Parts": sent}, ChecksumType="FULL_OBJECT", IfNoneMatch="*", **whole,
                )
            )  # fmt: skip

        written = _written(store, key, complete)
    except BaseException:
        with contextlib.suppress(Exception):  # the failure that matters is the one raised
            store._client.abort_multipart_upload(Bucket=store.bucket, Key=key, UploadId=upload)
        raise
    if written.crc32 is None:
        return store.checksum(key)
    return written


def copy(store: S3Store, source: str, stored: StoredObject, target: str, *, source_bucket: str) -> Copied:
    """Copy ``source`` of ``source_bucket`` (the version listed) to the new object ``target`` inside the store,
    never over one that exists; the copy's CRC32 is computed by the store."""
    try:
        copied = _copy(store, source_bucket, source, stored, target)
    except ObjectExists:
        original = store.sibling(source_bucket)
        if original.head(source).etag != stored.etag:  # a 412 of the pin, not of the no-replace
            raise InputError(CHANGED, path=original.where(source)) from None
        raise
    return copied


def _copy(store: S3Store, bucket: str, source: str, stored: StoredObject, target: str) -> Copied:
    if stored.size > COPY_LIMIT:  # in parts, each counted as it is copied
        ranges = [(start, min(start + COPY_PART, stored.size)) for start in range(0, stored.size, COPY_PART)]
        return multipart(store, target, [("copy", (bucket, source, stored, a, b)) for a, b in ranges], None)

    def copy() -> dict[str, Any]:
        answer: dict[str, Any] = store.request(
            "copy_object", target, writing=True, Key=target, CopySource={"Bucket": bucket, "Key": source},
            CopySourceIfMatch=stored.etag, IfNoneMatch="*", ChecksumAlgorithm="CRC32",
            MetadataDirective="REPLACE", Metadata={RUN_METADATA: store.run},
        )["CopyObjectResult"]  # fmt: skip
        store.count(copied=stored.size)
        return answer

    return _written(store, target, copy)


def abort_uploads(store: S3Store, prefix: str, *, exact: bool = False) -> int:
    """Abort every multipart upload begun under ``prefix`` (with ``exact``, to that key alone) and never completed
    (a killed run's: invisible, but stored and billed until aborted); return how many. Only for a run that holds
    the claim on that prefix or key."""
    uploads = store.request("list_multipart_uploads", prefix, Prefix=prefix).get("Uploads", ())
    aborted = 0
    for upload in uploads:
        key = upload.get("Key", "")
        if not (isinstance(key, str) and key.startswith(prefix)):
            raise InputError(
                f"listed an upload to {shown_name(str(key))}, which is not under it", path=store.where(prefix)
            )
        if exact and key != prefix:
            continue  # another object's upload (optimizer.pth beside optimizer.pt): not this claim's
        store.request("abort_multipart_upload", key, writing=True, Key=key, UploadId=upload["UploadId"])
        aborted += 1
    return aborted


def delete_own(store: S3Store, key: str, etag: str) -> None:
    """Delete ``key`` if it is still the object ``etag`` (one this run, or the stopped run it cleans up after,
    wrote); an object replaced since, or gone, is left as it is."""
    try:
        store.request("delete_object", key, writing=True, Key=key, IfMatch=etag)
    except ObjectExists:  # 412: another writer's object now
        return
    except InputError as exc:
        if "no such object" not in exc.reason:
            raise


def delete(store: S3Store, keys: Iterable[str]) -> None:
    """Delete ``keys`` (what the user allowed replacing), a thousand a request."""
    batch = list(keys)
    for start in range(0, len(batch), 1000):
        objects = [{"Key": key} for key in batch[start : start + 1000]]
        store.request("delete_objects", objects[0]["Key"], writing=True, Delete={"Objects": objects, "Quiet": True})


def _slice(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as stream:
        stream.seek(offset)
        return stream.read(length)
