"""S3 and S3-compatible stores through boto3: list, ranged reads, no-replace writes, server-side copies, deletes.

boto3 is imported when the first ``s3://`` argument is met (the ``optim-repair[s3]`` extra). Credentials and
endpoints come as the AWS CLI finds them (the environment, ``~/.aws`` profiles, SSO; ``AWS_ENDPOINT_URL``),
with ``profile`` and ``endpoint_url`` given by the caller first. Retries on throttling and transient errors
are the client's own. Every request and every byte is counted (``Traffic``). A read names the version it
read (``IfMatch`` its ETag), so an object replaced meanwhile is refused, never mixed with its old bytes.
"""

from __future__ import annotations

import base64
import importlib
import threading
import zlib
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from optim_repair.errors import InputError, ObjectExists, OptimRepairError, OutputError, UsageError
from optim_repair.records.traffic import Traffic

SCHEME = "s3://"
COALESCE_GAP = 1 << 20
"""Ranges of one object closer than this are read by one GET: a DCP shard's bytes entries lie at its head."""
COPY_LIMIT = 5 << 30
"""The largest object one ``CopyObject`` copies; a larger one is copied in parts of ``COPY_PART``."""
COPY_PART = 1 << 30
PUT_LIMIT = 5 << 30
"""The largest object one ``PutObject`` writes; a larger file is uploaded in parts of at least ``PUT_PART``."""
PUT_PART = 64 << 20
CHANGED = "changed while being read (is a run still saving it?)"
WORKERS = 8
"""Requests in flight at once."""
_CHUNK = 8 << 20
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


@dataclass(frozen=True)
class S3Url:
    """An object or a prefix in a bucket."""

    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    @property
    def prefix(self) -> str:
        """The key as a prefix of the objects under it (``step-1000/``; ``""`` for the whole bucket)."""
        return self.key if not self.key or self.key.endswith("/") else f"{self.key}/"

    def object(self, relative: str) -> str:
        """The key of the object ``relative`` under this prefix."""
        return f"{self.prefix}{relative}"

    def named(self, relative: str) -> str:
        """``relative`` under this prefix, as a URL for messages."""
        return f"{SCHEME}{self.bucket}/{self.object(relative)}"


def is_s3(text: object) -> bool:
    """Whether a checkpoint argument names object storage."""
    return isinstance(text, str) and text.startswith(SCHEME)


def parse_url(text: str) -> S3Url:
    bucket, _, key = text[len(SCHEME) :].partition("/")
    if not bucket:
        raise UsageError(f"{text} names no bucket (s3://BUCKET/PREFIX/)")
    return S3Url(bucket, key)


@dataclass(frozen=True)
class StoredObject:
    """An object as a listing gave it."""

    size: int
    etag: str


@dataclass(frozen=True)
class Copied:
    """What the store says of an object after writing it: its CRC32 (when it computed one) and ETag."""

    crc32: str | None
    etag: str


def crc32_of(path: Path) -> str:
    """A file's CRC32, as S3 writes it (base64 of the big-endian value)."""
    value = 0
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.read = self.written = self.copied = 0

    def add(self, *, requests: int = 0, read: int = 0, written: int = 0, copied: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.read += read
            self.written += written
            self.copied += copied


class S3Store:
    """One bucket's objects, through one client whose every request is counted."""

    def __init__(self, bucket: str, *, profile: str | None = None, endpoint_url: str | None = None) -> None:
        try:
            boto3 = importlib.import_module("boto3")
            self._botocore = importlib.import_module("botocore.exceptions")
            config = importlib.import_module("botocore.config")
        except ImportError:
            raise UsageError("s3:// checkpoints need boto3: pip install 'optim-repair[s3]'") from None
        try:
            session = boto3.session.Session(profile_name=profile)
            self._client: Any = session.client(
                "s3", endpoint_url=endpoint_url, config=config.Config(max_pool_connections=2 * WORKERS)
            )
        except self._botocore.BotoCoreError as exc:
            raise UsageError(f"cannot set up the S3 client ({exc})") from exc
        self.bucket = bucket
        self._count = _Counter()
        self._client.meta.events.register("before-send.s3", lambda **_: self._count.add(requests=1))

    def sibling(self, bucket: str) -> S3Store:
        """The store of ``bucket`` through the same client, counted with this one."""
        if bucket == self.bucket:
            return self
        other = object.__new__(S3Store)
        other.__dict__.update(self.__dict__)
        other.bucket = bucket
        return other

    def traffic(self) -> Traffic:
        count = self._count
        return Traffic(count.requests, count.read, count.written, count.copied)

    def where(self, key: str) -> str:
        """The object ``key`` as a URL, for messages."""
        return f"{SCHEME}{self.bucket}/{key}"

    def _call(self, operation: str, key: str, *, writing: bool = False, **kwargs: Any) -> Any:
        try:
            return getattr(self._client, operation)(Bucket=self.bucket, **kwargs)
        except self._botocore.ClientError as exc:
            raise _failure(exc.response, self.where(key), writing) from exc
        except self._botocore.NoCredentialsError as exc:
            raise InputError("no AWS credentials found (environment, ~/.aws profile, or SSO login)") from exc
        except self._botocore.BotoCoreError as exc:
            kind = OutputError if writing else InputError
            raise kind(f"cannot reach the store ({exc})", path=self.where(key)) from exc

    def listing(self, prefix: str) -> dict[str, StoredObject]:
        """Every object under ``prefix``, by its key relative to it."""
        found: dict[str, StoredObject] = {}
        token: dict[str, Any] = {}
        while True:
            page = self._call("list_objects_v2", prefix, Prefix=prefix, **token)
            for item in page.get("Contents", ()):
                if not item["Key"].endswith("/"):  # a console's folder marker holds nothing
                    found[item["Key"][len(prefix) :]] = StoredObject(item["Size"], item["ETag"])
            if not page.get("IsTruncated"):
                return found
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def download(self, key: str, stored: StoredObject, target: BinaryIO) -> None:
        """The whole object ``key``, as listed, into ``target``; the client checks the CRC32 the store keeps of
        it, where it keeps one, as the body arrives."""
        body = self._call("get_object", key, Key=key, IfMatch=stored.etag, ChecksumMode="ENABLED")["Body"]
        try:
            with body:
                while chunk := body.read(_CHUNK):
                    self._count.add(read=len(chunk))
                    target.write(chunk)
        except self._botocore.BotoCoreError as exc:  # a CRC32 that does not match, a connection lost
            raise InputError(f"cannot be read whole ({exc})", path=self.where(key)) from exc

    def ranges(
        self, key: str, stored: StoredObject, wanted: Sequence[tuple[int, int]], *, gap: int = COALESCE_GAP
    ) -> list[bytes]:
        """The bytes of each ``(offset, length)`` of ``key``, in the order asked: ranges closer than ``gap`` are
        read by one GET, the GETs ``WORKERS`` at a time."""
        order = sorted(range(len(wanted)), key=lambda index: wanted[index][0])
        groups: list[list[int]] = []
        for index in order:
            offset, _ = wanted[index]
            if groups and offset - _end(wanted, groups[-1]) <= gap:
                groups[-1].append(index)
            else:
                groups.append([index])
        found: list[bytes] = [b""] * len(wanted)
        spans = [(wanted[group[0]][0], _end(wanted, group)) for group in groups]
        fetched = self.each(lambda span: self.get_range(key, stored, *span) if span[1] > span[0] else b"", spans)
        for group, (start, _), data in zip(groups, spans, fetched, strict=True):
            for index in group:
                offset, length = wanted[index]
                found[index] = data[offset - start : offset - start + length]
        return found

    def get_range(self, key: str, stored: StoredObject, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of ``key``, as listed, by one GET."""
        answer = self._call("get_object", key, Key=key, IfMatch=stored.etag, Range=f"bytes={start}-{end - 1}")
        try:
            with answer["Body"] as body:
                data: bytes = body.read()
        except self._botocore.BotoCoreError as exc:
            raise InputError(f"cannot be read ({exc})", path=self.where(key)) from exc
        self._count.add(read=len(data))
        if len(data) != end - start:
            raise InputError(f"gave {len(data)} bytes for a range of {end - start}", path=self.where(key))
        return data

    def identical(self, key: str, stored: StoredObject, other: str, source: S3Store) -> bool:
        """Whether this store's object ``other`` holds the bytes of ``source``'s ``key`` (as listed), both read
        back in chunks."""
        copy = self.head(other)
        if copy.size != stored.size:
            return False
        for start in range(0, stored.size, _CHUNK):
            end = min(start + _CHUNK, stored.size)
            if source.get_range(key, stored, start, end) != self.get_range(other, copy, start, end):
                return False
        return True

    def tail(self, key: str, length: int) -> tuple[StoredObject, bytes]:
        """The last ``length`` bytes of ``key`` (all of it, if shorter) by one GET, with the object's size and ETag,
        which later reads name."""
        answer = self._call("get_object", key, Key=key, Range=f"bytes=-{length}")
        with answer["Body"] as body:
            data: bytes = body.read()
        self._count.add(read=len(data))
        total = int(str(answer.get("ContentRange", "")).rpartition("/")[2] or len(data))
        return StoredObject(total, answer["ETag"]), data

    def head(self, key: str) -> StoredObject:
        answer = self._call("head_object", key, Key=key)
        return StoredObject(answer["ContentLength"], answer["ETag"])

    def checksum(self, key: str) -> Copied:
        """The CRC32 the store keeps of the whole object ``key`` (None without one), and its ETag."""
        answer = self._call("head_object", key, Key=key, ChecksumMode="ENABLED")
        whole = answer.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
        return Copied(answer.get("ChecksumCRC32") if whole else None, answer["ETag"])

    def put_file(self, key: str, path: Path, size: int) -> Copied:
        """Write the file ``path`` as the new object ``key``, never over one that exists; the store checks the
        CRC32 sent with it (or with each part, over ``PUT_LIMIT``) on receipt."""
        if size > PUT_LIMIT:
            return self._put_in_parts(key, path, size)
        with path.open("rb") as stream:
            answer = self._call(
                "put_object", key, writing=True, Key=key, Body=stream, ContentLength=size,
                IfNoneMatch="*", ChecksumAlgorithm="CRC32",
            )  # fmt: skip
        self._count.add(written=size)
        return Copied(answer.get("ChecksumCRC32"), answer["ETag"])

    def _put_in_parts(self, key: str, path: Path, size: int) -> Copied:
        part = max(PUT_PART, -(-size // 10_000))  # S3 takes at most 10,000 parts
        parts = [("file", (path, offset, min(part, size - offset))) for offset in range(0, size, part)]
        answer = self.multipart(key, parts, crc32_of(path))
        return Copied(answer.get("ChecksumCRC32"), answer["ETag"])

    def put_bytes(self, key: str, data: bytes) -> Copied:
        """Write ``data`` as the new object ``key``, never over one that exists, with its CRC32."""
        answer = self._call(
            "put_object", key, writing=True, Key=key, Body=data, IfNoneMatch="*", ChecksumAlgorithm="CRC32"
        )
        self._count.add(written=len(data))
        return Copied(answer.get("ChecksumCRC32"), answer["ETag"])

    def multipart(self, key: str, parts: Sequence[tuple[str, Any]], expected: str | None) -> dict[str, Any]:
        """Write the new object ``key`` from ``parts``, ``WORKERS`` at a time: ``("bytes", data)``, ``("file",
        (path, offset, length))``, or ``("copy", (bucket, source, stored, start, end))``, a range of another object
        copied inside the store. Its CRC-32 is the whole object's (``FULL_OBJECT``), checked by the store
        against ``expected`` where given; never over an object that exists; aborted on any failure."""
        upload = self._call(
            "create_multipart_upload", key, writing=True, Key=key, ChecksumAlgorithm="CRC32",
            ChecksumType="FULL_OBJECT",
        )["UploadId"]  # fmt: skip

        def send(numbered: tuple[int, tuple[str, Any]]) -> dict[str, Any]:
            number, (kind, what) = numbered
            common = {"Key": key, "UploadId": upload, "PartNumber": number}
            if kind == "copy":
                bucket, source, stored, start, end = what
                pinned = {"Bucket": bucket, "Key": source}
                answer = self._call(
                    "upload_part_copy", key, writing=True, CopySource=pinned, CopySourceIfMatch=stored.etag,
                    CopySourceRange=f"bytes={start}-{end - 1}", **common,
                )["CopyPartResult"]  # fmt: skip
                self._count.add(copied=end - start)
            else:
                data = what if kind == "bytes" else _slice(*what)
                answer = self._call("upload_part", key, writing=True, Body=data, ChecksumAlgorithm="CRC32", **common)
                self._count.add(written=len(data))
            found = {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32": answer.get("ChecksumCRC32")}
            return {name: value for name, value in found.items() if value is not None}

        whole = {"ChecksumCRC32": expected} if expected is not None else {}
        try:
            sent = list(self.each(send, list(enumerate(parts, 1))))
            return dict(
                self._call(
                    "complete_multipart_upload", key, writing=True, Key=key, UploadId=upload,
                    MultipartUpload={"Parts": sent}, ChecksumType="FULL_OBJECT", IfNoneMatch="*", **whole,
                )
            )  # fmt: skip
        except BaseException:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            raise

    def copy(self, source: str, stored: StoredObject, target: str, *, source_bucket: str) -> Copied:
        """Copy ``source`` of ``source_bucket`` (the version listed) to the new object ``target`` inside the store,
        never over one that exists; the copy's CRC32 is computed by the store."""
        try:
            copied = self._copy(source_bucket, source, stored, target)
        except OutputError:
            original = self.sibling(source_bucket)
            if original.head(source).etag != stored.etag:  # a 412 of the pin, not of the no-replace
                raise InputError(CHANGED, path=original.where(source)) from None
            raise
        return copied

    def _copy(self, bucket: str, source: str, stored: StoredObject, target: str) -> Copied:
        if stored.size > COPY_LIMIT:  # in parts, each counted as it is copied
            ranges = [(start, min(start + COPY_PART, stored.size)) for start in range(0, stored.size, COPY_PART)]
            self.multipart(target, [("copy", (bucket, source, stored, a, b)) for a, b in ranges], None)
            return self.checksum(target)
        answer = self._call(
            "copy_object", target, writing=True, Key=target, CopySource={"Bucket": bucket, "Key": source},
            CopySourceIfMatch=stored.etag, IfNoneMatch="*", ChecksumAlgorithm="CRC32",
        )["CopyObjectResult"]  # fmt: skip
        self._count.add(copied=stored.size)
        return Copied(answer.get("ChecksumCRC32"), answer["ETag"])

    def abort_uploads(self, prefix: str) -> int:
        """Abort every multipart upload begun under ``prefix`` and never completed (a killed run's: invisible,
        but stored and billed until aborted); return how many."""
        uploads = self._call("list_multipart_uploads", prefix, Prefix=prefix).get("Uploads", ())
        for upload in uploads:
            self._call(
                "abort_multipart_upload", upload["Key"], writing=True, Key=upload["Key"], UploadId=upload["UploadId"]
            )
        return len(uploads)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (what this run wrote), a thousand a request."""
        batch = list(keys)
        for start in range(0, len(batch), 1000):
            objects = [{"Key": key} for key in batch[start : start + 1000]]
            self._call("delete_objects", objects[0]["Key"], writing=True, Delete={"Objects": objects, "Quiet": True})

    def each(self, work: Callable[[_Item], _Result], items: Sequence[_Item]) -> Generator[_Result, None, None]:
        """``work`` of each item, ``WORKERS`` at a time, in the order given. Closed early (an error, an ending
        signal), it starts no more, and returns once the requests in flight have ended."""
        pool = ThreadPoolExecutor(WORKERS)
        try:
            yield from pool.map(work, items)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _slice(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as stream:
        stream.seek(offset)
        return stream.read(length)


def _end(wanted: Sequence[tuple[int, int]], group: Sequence[int]) -> int:
    return max(wanted[index][0] + wanted[index][1] for index in group)


_DENIED = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccountProblem"}


def _failure(response: dict[str, Any], where: str, writing: bool) -> OptimRepairError:
    """The error of a request the store refused: denied is exit 4, naming bucket and key; a write that would
    replace an object (412, 409) is exit 5; a read of an object replaced since it was listed says so."""
    error, status = response.get("Error", {}), response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code, message = str(error.get("Code", status)), str(error.get("Message", "")).rstrip(".")
    if code in _DENIED or status == 403:
        return InputError(f"access denied ({code})", path=where)
    if code == "NoSuchBucket":
        return InputError("no such bucket", path=where)
    if code in ("NoSuchKey", "404", "NotFound"):
        return InputError("no such object (was it deleted meanwhile?)", path=where)
    if status in (409, 412) and writing:
        return ObjectExists("exists: another writer put an object there first", path=where)
    if status == 412:
        return InputError(CHANGED, path=where)
    kind = OutputError if writing else InputError
    return kind(f"the store refused the request ({code}: {message})", path=where)
