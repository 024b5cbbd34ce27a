"""Reading an S3 or S3-compatible store through boto3: one counted client for a bucket, its listings and reads.

boto3 is imported when the first ``s3://`` argument is met (the ``optim-repair[s3]`` extra). Credentials and
endpoints come as the AWS CLI finds them (the environment, ``~/.aws`` profiles, SSO; ``AWS_ENDPOINT_URL``),
with ``profile`` and ``endpoint_url`` given by the caller first. Retries on throttling and transient errors
are the client's own. Every request and every byte is counted (``Traffic``). A read names the version it
read (``IfMatch`` its ETag), so an object replaced meanwhile is refused, never mixed with its old bytes. Every
answer is judged before it is believed (``answers``, ``names``); the writes are ``store``'s.
"""

from __future__ import annotations

import datetime
import email.utils
import functools
import http.client
import importlib
import traceback
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from optim_repair.errors import InputError, OptimRepairError, OutputError, UsageError, shown_name
from optim_repair.storage.answers import check_range, cut, failure, receive, redirected, within
from optim_repair.storage.batched import WORKERS, BatchedReads, Counter
from optim_repair.storage.names import ListingBudget, checked_endpoint, checked_name, origin, redacted
from optim_repair.storage.objects import Copied, Small, StoredObject, crc32_of, encoded_crc32

CONNECT_SECONDS = 10
READ_SECONDS = 60
"""What botocore waits for a connection, and for each read of a socket (a store that answers nothing)."""
RUN_METADATA = "optim-repair-run"
"""The user metadata every object a run writes carries: the run's id, by which a write whose answer was lost (the
retry finds the object there) is known for the run's own."""
_WITHIN = frozenset({"list_objects_v2", "list_multipart_uploads", "head_object", "get_object"})
"""The requests bounded by ``answers.within``: those whose answers the client reads whole, and a GetObject's status
and headers (its body is read against the floor as it comes, ``answers.receive``): a status line and headers that
drip a byte a second never trip botocore's read timeout, which is per socket read. A write's answer may rightly
take long (a server-side copy of gigabytes), and is bounded by botocore's read timeout alone."""


def _parsing(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while botocore's parser read an answer its model does not fit: an element twice
    where one is modelled (a list given to int()), a number past Python's digit limit, a time of no time."""
    return any(
        frame.f_globals.get("__name__") == "botocore.parsers" for frame, _ in traceback.walk_tb(exc.__traceback__)
    )


class S3Reader(BatchedReads):
    """One bucket's objects, through one client whose every request is counted and every answer checked: names
    where they are listed, ranges against what was asked, bodies against a deadline."""

    proof = "S3 CRC32"

    def __init__(self, bucket: str, *, profile: str | None = None, endpoint_url: str | None = None) -> None:
        endpoint_url = checked_endpoint(endpoint_url)
        try:
            boto3 = importlib.import_module("boto3")
            self._botocore = importlib.import_module("botocore.exceptions")
            config = importlib.import_module("botocore.config")
            urllib3 = importlib.import_module("urllib3.exceptions")
        except ImportError:
            raise UsageError("s3:// checkpoints need boto3: pip install 'optim-repair[s3]'") from None
        self._transport: tuple[type[BaseException], ...] = (
            self._botocore.BotoCoreError, urllib3.HTTPError, http.client.HTTPException, OSError
        )  # fmt: skip
        try:
            session = boto3.session.Session(profile_name=profile)
            self._client: Any = session.client(
                "s3",
                endpoint_url=endpoint_url,
                config=config.Config(
                    max_pool_connections=2 * WORKERS, connect_timeout=CONNECT_SECONDS, read_timeout=READ_SECONDS,
                    retries={"mode": "standard", "max_attempts": 4},
                ),
            )  # fmt: skip
        except (self._botocore.BotoCoreError, ValueError) as exc:
            raise UsageError(f"cannot set up the S3 client ({redacted(str(exc))})") from exc
        self.bucket = bucket
        self.run = uuid.uuid4().hex
        """This run's id, in the metadata of every object it writes."""
        self._count = Counter()
        self._client.meta.events.register("before-send.s3", lambda **_: self._count.add(requests=1))

    def where(self, key: str) -> str:
        """The object ``key`` as a URL, for messages."""
        return f"s3://{self.bucket}/{key}"

    def file_checksum(self, path: Path) -> str:
        """The file's CRC32, as S3 keeps it of an object."""
        return crc32_of(path)

    def request(self, operation: str, key: str, *, writing: bool = False, **kwargs: Any) -> Any:
        """The client's ``operation`` on this bucket (about ``key``, for messages); every refusal and transport
        failure raised as the error a user is shown, a redirect (unfollowed) naming where it pointed."""
        call = functools.partial(getattr(self._client, operation), Bucket=self.bucket, **kwargs)
        endpoint = self._client.meta.endpoint_url
        try:
            return within(call, self.where(key), origin(endpoint), writing=writing) if operation in _WITHIN else call()
        except self._botocore.ClientError as exc:
            metadata = exc.response.get("ResponseMetadata", {})
            status = metadata.get("HTTPStatusCode")
            if isinstance(status, int) and 300 <= status < 400:  # botocore follows none, and says so in no words
                location = metadata.get("HTTPHeaders", {}).get("location")
                raise redirected(status, location, endpoint, self.where(key), writing) from exc
            raise failure(exc.response, self.where(key), writing) from exc
        except self._botocore.NoCredentialsError as exc:
            raise InputError("no AWS credentials found (environment, ~/.aws profile, or SSO login)") from exc
        except self._transport as exc:
            raise self._lost(exc, key) from exc
        except (TypeError, ValueError) as exc:
            if not _parsing(exc):
                raise
            kind = OutputError if writing else InputError
            detail = shown_name(f"{type(exc).__name__}: {exc}"[:120])
            raise kind(f"answered with what botocore cannot read ({detail})", path=self.where(key)) from exc

    def etag(self, answer: dict[str, Any], key: str, *, writing: bool = False) -> str:
        """The ETag ``answer`` gives of ``key``; one without it (botocore leaves out what an answer lacks) is exit 4,
        exit 5 for a write's."""
        etag = answer.get("ETag")
        if not isinstance(etag, str) or not etag:
            kind = OutputError if writing else InputError
            raise kind("answered without the object's ETag", path=self.where(key))
        return etag

    def _lost(self, exc: BaseException, key: str) -> InputError:
        """A transport failure (a connection refused, reset or cut mid-answer, a timeout) as exit 4 naming ``key``."""
        return InputError(
            f"the store could not be reached or stopped answering ({redacted(str(exc))})", path=self.where(key)
        )

    def listing(self, prefix: str, *, children: bool = False) -> dict[str, StoredObject]:
        """Every object under ``prefix`` (``children``: only those directly in it, as ``ls`` lists a directory), by
        its key relative to it (``checked_name``). A listing that repeats a page (its continuation token, or a
        key), lists a key outside ``prefix``, or holds more than its budget (``ListingBudget``: one that never
        ends) is refused."""
        found: dict[str, StoredObject] = {}
        budget = ListingBudget(self.where(prefix))
        tokens: set[str] = set()
        token: dict[str, Any] = {"Delimiter": "/"} if children else {}
        while True:
            page = self.request("list_objects_v2", prefix, Prefix=prefix, **token)
            for item in page.get("Contents", ()):
                key, size, etag = item.get("Key"), item.get("Size"), item.get("ETag")
                if not (isinstance(key, str) and key.startswith(prefix)):
                    raise InputError(f"listed {shown_name(str(key))}, which is not under it", path=self.where(prefix))
                if not (isinstance(size, int) and size >= 0 and isinstance(etag, str)):
                    raise InputError("was listed without a size and an ETag", path=self.where(key))
                if key.endswith("/"):  # a console's folder marker holds nothing
                    continue
                name = checked_name(key[len(prefix) :], lambda relative: self.where(f"{prefix}{relative}"))
                if name in found:
                    raise InputError("was listed twice (the store repeats its listing)", path=self.where(key))
                budget.hold(name, etag)
                found[name] = StoredObject(size, etag)
            if not page.get("IsTruncated"):
                return found
            following = page.get("NextContinuationToken")
            if not isinstance(following, str) or not following or following in tokens:
                raise InputError(
                    "the store repeats its listing (a continuation token came twice)", path=self.where(prefix)
                )
            tokens.add(following)
            budget.hold(following, following)
            token = {**token, "ContinuationToken": following}

    def _receive(self, answer: dict[str, Any], key: str, length: int, sink: Callable[[bytes], None]) -> int:
        """The body of ``answer`` into ``sink``, counted (``answers.receive``); a transport failure named."""

        def counted(chunk: bytes) -> None:
            self._count.add(read=len(chunk))
            sink(chunk)

        try:
            return receive(answer["Body"], length, counted, self.where(key))
        except OptimRepairError:
            raise
        except self._transport as exc:
            raise self._lost(exc, key) from exc

    def download(self, key: str, stored: StoredObject, target: BinaryIO) -> None:
        """The whole object ``key``, as listed, into ``target``, checked against the CRC32 the store keeps of it,
        where it keeps one of the whole object."""
        answer = self.request("get_object", key, Key=key, IfMatch=stored.etag, ChecksumMode="ENABLED")
        value = 0

        def sink(chunk: bytes) -> None:
            nonlocal value
            value = zlib.crc32(chunk, value)
            target.write(chunk)

        received = self._receive(answer, key, stored.size, sink)
        if received != stored.size:
            raise InputError(cut(received, stored.size), path=self.where(key))
        kept = answer.get("ChecksumCRC32")
        if (
            kept is not None
            and answer.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
            and kept != encoded_crc32(value)
        ):
            raise InputError("its bytes do not match the CRC32 the store keeps of it", path=self.where(key))

    def get_range(self, key: str, stored: StoredObject, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of ``key``, as listed, by one GET: only a 206 answer whose Content-Range is
        the one asked for is read, and no more than was asked."""
        if not 0 <= start < end <= stored.size:
            raise InputError(f"has no bytes {start:,} to {end:,} (it holds {stored.size:,})", path=self.where(key))
        answer = self.request("get_object", key, Key=key, IfMatch=stored.etag, Range=f"bytes={start}-{end - 1}")
        check_range(answer, (start, end - 1, stored.size), self.where(key))
        parts: list[bytes] = []
        received = self._receive(answer, key, end - start, parts.append)
        if received != end - start:
            raise InputError(cut(received, end - start), path=self.where(key))
        return b"".join(parts)

    def tail(self, key: str, length: int) -> tuple[StoredObject, bytes]:
        """The last ``length`` bytes of ``key`` (all of it, if shorter) by one GET, with the object's size and ETag,
        which later reads name."""
        answer = self.request("get_object", key, Key=key, Range=f"bytes=-{length}")
        status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
        given = answer.get("ContentLength")
        whole = status == 200 and isinstance(given, int) and 0 <= given <= length  # all of it: what was asked
        total = given if whole else check_range(answer, None, self.where(key))
        stored = StoredObject(total, self.etag(answer, key))
        expected = min(length, total)
        if answer.get("ContentLength") != expected:
            raise InputError(
                f"answered a read of its last {expected:,} bytes with another length", path=self.where(key)
            )
        parts: list[bytes] = []
        received = self._receive(answer, key, expected, parts.append)
        if received != expected:
            raise InputError(cut(received, expected), path=self.where(key))
        return stored, b"".join(parts)

    def head(self, key: str) -> StoredObject:
        answer = self.request("head_object", key, Key=key)
        size = answer.get("ContentLength")
        if not (isinstance(size, int) and size >= 0):
            raise InputError("was described without a size", path=self.where(key))
        return StoredObject(size, self.etag(answer, key))

    def checksum(self, key: str) -> Copied:
        """The CRC32 the store keeps of the whole object ``key`` (None without one), and its ETag."""
        answer = self.request("head_object", key, Key=key, ChecksumMode="ENABLED")
        whole = answer.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
        return Copied(answer.get("ChecksumCRC32") if whole else None, self.etag(answer, key))

    def owner(self, key: str) -> tuple[str | None, Copied] | None:
        """The run that wrote ``key`` (None when no run of optim-repair did) and what the store says of it; None
        when there is no such object."""
        try:
            answer = self.request("head_object", key, Key=key, ChecksumMode="ENABLED")
        except InputError as exc:
            if isinstance(exc.__cause__, self._botocore.ClientError) and "no such object" in exc.reason:
                return None
            raise
        whole = answer.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
        run = answer.get("Metadata", {}).get(RUN_METADATA)
        return run, Copied(answer.get("ChecksumCRC32") if whole else None, self.etag(answer, key))

    def read_small(self, key: str, limit: int) -> Small | None:
        """The object ``key`` whole when it holds at most ``limit`` bytes (a marker), with what the store says of
        it; None when there is none."""
        try:
            answer = self.request("get_object", key, Key=key)
        except InputError as exc:
            if isinstance(exc.__cause__, self._botocore.ClientError) and "no such object" in exc.reason:
                return None
            raise
        parts: list[bytes] = []
        self._receive(answer, key, limit, parts.append)
        sent = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        modified = answer.get("LastModified")
        try:
            now = email.utils.parsedate_to_datetime(str(sent))
            age = (now - modified).total_seconds() if isinstance(modified, datetime.datetime) else None
        except (TypeError, ValueError):
            age = None
        run = answer.get("Metadata", {}).get(RUN_METADATA)
        return Small(b"".join(parts), self.etag(answer, key), run, age)
