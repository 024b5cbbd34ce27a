"""Reading a Google Cloud Storage bucket over its JSON API: one counted session, its listings and reads.

The client is Google's own: ``google.auth`` finds the credentials (application default credentials: the
environment, ``gcloud auth application-default login``, a metadata server) and its ``AuthorizedSession`` (requests)
carries them; the JSON API is spoken directly, so that every answer's status, headers and length are seen and
judged (the ``optim-repair[gcs]`` extra). The endpoint is ``--endpoint-url``, else ``STORAGE_EMULATOR_HOST`` (an
emulator, reached with anonymous credentials where none are found), else Google's. Transient failures (429, 5xx,
a reset connection) are retried by the transport. A read names the generation it read (``generation=``, and the
answer's ``X-Goog-Generation`` must be it), so an object replaced meanwhile is refused, never mixed with its old
bytes. Bodies are read against a length and a pace (``answers.receive``), whole answers (a listing's page, an
object's resource) against a size and a deadline.
"""

from __future__ import annotations

import datetime
import email.utils
import importlib
import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from optim_repair.errors import InputError, ObjectExists, OptimRepairError, OutputError, UsageError, shown_name
from optim_repair.storage.answers import CHANGED, WHOLE_ANSWER_BYTES, cut, within
from optim_repair.storage.batched import HttpReads, sending
from optim_repair.storage.gcs.values import as_json, crc32c_of, encoded, hashes, is_crc
from optim_repair.storage.names import ListingBudget, checked_endpoint, checked_name, origin, redacted
from optim_repair.storage.objects import Copied, Small, StoredObject

GOOGLE = "https://storage.googleapis.com"
SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
CONNECT_SECONDS = 10
READ_SECONDS = 60
"""What the transport waits for a connection, and for each read of a socket (a store that answers nothing)."""
RUN_METADATA = "optim-repair-run"
"""The custom metadata every object a run writes carries: the run's id."""
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20})")
_DIGITS = re.compile(r"[0-9]{1,20}")
_SMALL_ATTEMPTS = 5


def _endpoint(endpoint_url: str | None) -> tuple[str, str]:
    """The service's base URL, and how it was named: ``google``, ``endpoint`` (``--endpoint-url``: an emulator, or a
    private endpoint of the service) or ``emulator`` (``STORAGE_EMULATOR_HOST``)."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    given, named = (endpoint_url, "endpoint") if endpoint_url else (emulator, "emulator")
    if not given:
        return GOOGLE, "google"
    if "://" not in given:
        given = f"http://{given}"  # STORAGE_EMULATOR_HOST is often HOST:PORT
    checked = checked_endpoint(given)
    assert checked is not None
    return checked.rstrip("/"), named


class GcsReader(HttpReads):
    """One bucket's objects, through one session whose every request is counted and every answer checked."""

    proof = "GCS CRC32C"

    def __init__(self, bucket: str, *, endpoint_url: str | None = None) -> None:
        self.base, named = _endpoint(endpoint_url)
        try:
            auth = importlib.import_module("google.auth")
            transport = importlib.import_module("google.auth.transport.requests")
            credentials_module = importlib.import_module("google.auth.credentials")
            self._requests = importlib.import_module("requests")
            importlib.import_module("google_crc32c")
        except ImportError:
            raise UsageError("gs:// checkpoints need google-auth: pip install 'optim-repair[gcs]'") from None
        try:
            if named == "emulator" and "GOOGLE_APPLICATION_CREDENTIALS" not in os.environ:
                raise auth.exceptions.DefaultCredentialsError  # as Google's client: an emulator, anonymously
            credentials, _ = auth.default(scopes=[SCOPE])
        except auth.exceptions.DefaultCredentialsError as exc:
            if named == "google":
                raise InputError(
                    "no Google Cloud credentials found (application default credentials: "
                    "gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS)"
                ) from exc
            credentials = credentials_module.AnonymousCredentials()
        self.opened(bucket, transport.AuthorizedSession(credentials), self._requests)

    def where(self, key: str) -> str:
        return f"gs://{self.bucket}/{key}"

    def file_checksum(self, path: Path) -> str:
        return crc32c_of(path)

    def url(self, key: str | None = None, *, upload: bool = False, bucket: str | None = None) -> str:
        """The JSON API's URL of the bucket's objects, or of the object ``key``."""
        root = f"{self.base}/upload/storage/v1" if upload else f"{self.base}/storage/v1"
        objects = f"{root}/b/{urllib.parse.quote(bucket or self.bucket, safe='')}/o"
        return objects if key is None else f"{objects}/{urllib.parse.quote(key, safe='')}"

    def send(
        self, method: str, url: str, key: str, *, writing: bool = False, accept: tuple[int, ...] = (), **kwargs: Any
    ) -> Any:
        """One request (about ``key``, for messages), its body left unread, answered in time and not redirected
        (``answered``); a refusal (but the statuses ``accept`` names) or a transport failure raised as the error a
        user is shown."""
        kwargs.setdefault("timeout", (CONNECT_SECONDS, READ_SECONDS))
        headers = {"Accept-Encoding": "identity", **kwargs.pop("headers", {})}
        answer = self.answered(
            self._session, method, url, key, writing=writing, accept=accept, headers=headers, **kwargs
        )
        if answer.status_code >= 400 and answer.status_code not in accept:
            raise self._failure(answer, key, writing, listing=urllib.parse.urlsplit(url).path.endswith("/o"))
        return answer

    def resource(self, method: str, url: str, key: str, *, writing: bool = False, **kwargs: Any) -> dict[str, Any]:
        """A request whose answer is a JSON object, read whole within ``WHOLE_ANSWER_BYTES`` and a deadline."""

        def call() -> dict[str, Any]:
            answer = self.send(method, url, key, writing=writing, **kwargs)
            return as_json(self.body(answer, key, WHOLE_ANSWER_BYTES), self.where(key))

        return within(call, self.where(key), origin(url), writing=writing, sending=sending(kwargs))

    def _failure(self, answer: Any, key: str, writing: bool, *, listing: bool) -> OptimRepairError:
        """The error of a request the store refused: denied is exit 4, naming bucket and key; a write that would
        replace an object (412, 409) is exit 5; a read of an object replaced since it was listed says so. A listing
        not found is of no bucket."""
        where, status = self.where(key), answer.status_code
        try:
            error = as_json(self.body(answer, key, 64 << 10), where).get("error", {})
            message = str(error.get("message", "") if isinstance(error, dict) else "").rstrip(".")
        except OptimRepairError:
            message = ""
        if status in (401, 403):
            return InputError(f"access denied (HTTP {status}: {redacted(message)})", path=where)
        if status == 404:
            bucket = listing or "bucket" in message.lower()
            reason = "no such bucket" if bucket else "no such object (was it deleted meanwhile?)"
            return InputError(reason, path=where)
        if status in (409, 412) and writing:
            return ObjectExists("exists: another writer put an object there first", path=where)
        if status == 412:
            return InputError(CHANGED, path=where)
        kind = OutputError if writing else InputError
        return kind(f"the store refused the request (HTTP {status}: {redacted(message)})", path=where)

    def _lost(self, exc: BaseException, key: str) -> InputError:
        return InputError(
            f"the store could not be reached or stopped answering ({redacted(str(exc))})", path=self.where(key)
        )

    def stored(self, item: Mapping[str, Any], key: str) -> tuple[StoredObject, Copied]:
        """An object's resource, judged: its size, generation and CRC-32C, each as the JSON API writes them."""
        size, generation, crc32c = item.get("size"), item.get("generation"), item.get("crc32c")
        if not (
            isinstance(size, str) and _DIGITS.fullmatch(size)
            and isinstance(generation, str) and _DIGITS.fullmatch(generation)
            and isinstance(crc32c, str) and is_crc(crc32c)
        ):  # fmt: skip
            raise InputError("was described without a size, a generation and a CRC32C", path=self.where(key))
        return StoredObject(int(size), generation), Copied(crc32c, generation)

    def listing(self, prefix: str, *, children: bool = False) -> dict[str, StoredObject]:
        """Every object under ``prefix`` (``children``: only those directly in it), by its checked name relative to
        it. A listing that repeats a page token or a name, lists a name outside ``prefix``, or holds more than its
        budget (``ListingBudget``: one that never ends) is refused."""
        found: dict[str, StoredObject] = {}
        budget = ListingBudget(self.where(prefix))
        tokens: set[str] = set()
        params: dict[str, str] = {"prefix": prefix, "fields": "items(name,size,generation,crc32c),nextPageToken"}
        if children:
            params["delimiter"] = "/"
        while True:
            page = self.resource("GET", self.url(), prefix, params=params)
            items = page.get("items", [])
            if not isinstance(items, list):
                raise InputError("answered a listing without a list of objects", path=self.where(prefix))
            for item in items:
                key = item.get("name") if isinstance(item, dict) else None
                if not (isinstance(key, str) and key.startswith(prefix)):
                    raise InputError(f"listed {shown_name(str(key))}, which is not under it", path=self.where(prefix))
                if key.endswith("/"):  # a console's folder marker holds nothing
                    continue
                name = checked_name(key[len(prefix) :], lambda relative: self.where(f"{prefix}{relative}"))
                if name in found:
                    raise InputError("was listed twice (the store repeats its listing)", path=self.where(key))
                found[name] = self.stored(item, key)[0]
                budget.hold(name, found[name].etag)
            following = page.get("nextPageToken")
            if following is None:
                return found
            if not isinstance(following, str) or not following or following in tokens:
                raise InputError("the store repeats its listing (a page token came twice)", path=self.where(prefix))
            tokens.add(following)
            budget.hold(following, following)
            params = {**params, "pageToken": following}

    def head(self, key: str) -> StoredObject:
        return self.stored(self.resource("GET", self.url(key), key), key)[0]

    def checksum(self, key: str) -> Copied:
        """The CRC-32C GCS keeps of the whole object ``key``, and its generation."""
        return self.stored(self.resource("GET", self.url(key), key), key)[1]

    def owner(self, key: str) -> tuple[str | None, Copied] | None:
        """The run that wrote ``key`` (None when no run of optim-repair did) and its CRC-32C; None when there is no
        such object."""
        try:
            item = self.resource("GET", self.url(key), key)
        except InputError as exc:
            if "no such object" in exc.reason:
                return None
            raise
        metadata = item.get("metadata")
        run = metadata.get(RUN_METADATA) if isinstance(metadata, dict) else None
        return (run if isinstance(run, str) else None), self.stored(item, key)[1]

    def _media(self, key: str, generation: str | None, wanted: str | None, *, accept: tuple[int, ...] = ()) -> Any:
        """A GET of ``key``'s bytes (of ``generation``, where given; the HTTP range ``wanted``, or all of them), its
        body unread; an answer from another generation, or without one, is refused (but an ``accept``ed status)."""
        params = {"alt": "media", **({"generation": generation} if generation is not None else {})}
        headers = {} if wanted is None else {"Range": f"bytes={wanted}"}
        answer = self.send("GET", self.url(key), key, params=params, headers=headers, accept=accept)
        if answer.status_code in accept:
            return answer
        given = answer.headers.get("X-Goog-Generation")
        if given is None or not _DIGITS.fullmatch(given) or (generation is not None and given != generation):
            answer.close()
            reason = CHANGED if given is not None else "answered a read without the generation it read"
            raise InputError(reason, path=self.where(key))
        if answer.headers.get("Content-Encoding", "identity") != "identity":
            answer.close()
            raise InputError("is stored compressed (Content-Encoding); it is read as stored", path=self.where(key))
        return answer

    def _length(self, answer: Any, key: str) -> int | None:
        text = answer.headers.get("Content-Length")
        return int(text) if text is not None and _DIGITS.fullmatch(text) else None

    def _ranged(self, answer: Any, asked: tuple[int, int, int] | None, key: str) -> int:
        """The object's size, from the Content-Range of a 206 answer (or a 200 giving the whole object, where that
        was asked); anything else than the range ``asked`` (None: a range at the end) is refused unread."""
        length = self._length(answer, key)
        if answer.status_code == 200 and asked is not None and asked[:2] == (0, asked[2] - 1) and length == asked[2]:
            return asked[2]
        given = answer.headers.get("Content-Range", "")
        matched = _CONTENT_RANGE.fullmatch(given)
        if answer.status_code != 206 or matched is None:
            answer.close()
            reason = (
                f"answered a read by range with its whole body (HTTP {answer.status_code}, not 206)"
                if answer.status_code != 206
                else f"answered a read by range with a Content-Range of no range ({shown_name(given[:100])})"
            )
            raise InputError(reason, path=self.where(key))
        first, last, size = (int(value) for value in matched.groups())
        if (asked is not None and (first, last, size) != asked) or last < first or last >= size:
            answer.close()
            raise InputError(f"answered a read of another range than was asked ({matched[0]})", path=self.where(key))
        return size

    def get_range(self, key: str, stored: StoredObject, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of the generation ``stored`` of ``key``, by one GET: only a 206 answer whose
        Content-Range is the one asked for is read, and no more than was asked."""
        if not 0 <= start < end <= stored.size:
            raise InputError(f"has no bytes {start:,} to {end:,} (it holds {stored.size:,})", path=self.where(key))
        answer = self._media(key, stored.etag, f"{start}-{end - 1}")
        self._ranged(answer, (start, end - 1, stored.size), key)
        data = self.body(answer, key, end - start, counted=True)
        if len(data) != end - start:
            raise InputError(cut(len(data), end - start), path=self.where(key))
        return data

    def tail(self, key: str, length: int) -> tuple[StoredObject, bytes]:
        """The last ``length`` bytes of ``key`` (all of it, if shorter) by one GET, with the object's size and
        generation, which later reads name."""
        answer = self._media(key, None, f"-{length}", accept=(416,))
        given = self._length(answer, key)
        if answer.status_code == 416 or (given == 0 and answer.status_code in (200, 206)):  # no bytes to give
            answer.close()
            stored = self.head(key)
            if stored.size:
                raise InputError(f"refused to give the last bytes of its {stored.size:,}", path=self.where(key))
            return stored, b""
        if answer.status_code == 200 and given is not None and given <= length:
            total = given  # all of it: what was asked
        else:
            total = self._ranged(answer, None, key)
        expected = min(length, total)
        if given != expected:
            answer.close()
            raise InputError(
                f"answered a read of its last {expected:,} bytes with another length", path=self.where(key)
            )
        data = self.body(answer, key, expected, counted=True)
        if len(data) != expected:
            raise InputError(cut(len(data), expected), path=self.where(key))
        return StoredObject(total, answer.headers["X-Goog-Generation"]), data

    def download(self, key: str, stored: StoredObject, target: BinaryIO) -> None:
        """The whole generation ``stored`` of ``key`` into ``target``, checked against the CRC-32C GCS keeps of it."""
        crc32c = importlib.import_module("google_crc32c")
        answer = self._media(key, stored.etag, None)
        kept = hashes(answer.headers.get("X-Goog-Hash", "")).get("crc32c")
        value = received = 0

        def sink(chunk: bytes) -> None:
            nonlocal value, received
            value = crc32c.extend(value, chunk)
            received += len(chunk)
            target.write(chunk)

        self.body(answer, key, stored.size, sink, counted=True)
        if received != stored.size:
            raise InputError(cut(received, stored.size), path=self.where(key))
        if kept is None:
            kept = self.checksum(key).checksum
        if kept != encoded(value):
            raise InputError("its bytes do not match the CRC32C the store keeps of it", path=self.where(key))

    def read_small(self, key: str, limit: int) -> Small | None:
        """The object ``key`` whole when it holds at most ``limit`` bytes (a marker), with its writer and age by the
        store's clock; None when there is none."""
        for _ in range(_SMALL_ATTEMPTS):  # its resource, then its bytes: a run may write it again in between
            try:
                item = self.resource("GET", self.url(key), key)
            except InputError as exc:
                if "no such object" in exc.reason:
                    return None
                raise
            stored, _ = self.stored(item, key)
            if stored.size > limit:
                raise InputError(f"holds {stored.size:,} bytes, more than the {limit:,} read", path=self.where(key))
            try:
                answer = self._media(key, stored.etag, None)
                break
            except InputError as exc:
                if "no such object" not in exc.reason and exc.reason != CHANGED:
                    raise
        else:
            raise InputError(f"was written again each of {_SMALL_ATTEMPTS} times it was read", path=self.where(key))
        sent = answer.headers.get("Date")
        data = self.body(answer, key, limit, counted=True)
        metadata = item.get("metadata")
        run = metadata.get(RUN_METADATA) if isinstance(metadata, dict) else None
        try:
            now = email.utils.parsedate_to_datetime(str(sent))
            updated = datetime.datetime.fromisoformat(str(item.get("updated", "")).replace("Z", "+00:00"))
            age: float | None = (now - updated).total_seconds()
        except (TypeError, ValueError):
            age = None
        return Small(data, stored.etag, run if isinstance(run, str) else None, age)
