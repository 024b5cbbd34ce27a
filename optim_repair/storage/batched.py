"""What every store's reader does alike over its own requests.

Counting, several requests at once, byte ranges coalesced into few reads, and two objects compared by reading both
back.

A store's reader (``s3.reading.S3Reader``, ``gcs.reading.GcsReader``, ``azure.reading.AzureReader``) inherits
``BatchedReads`` and gives ``get_range`` and ``head`` (``_Reads``); ``sibling`` is the same reader for another
bucket; what it sends and how it judges each answer stays its own. A reader over a requests session (GCS's,
Azure's) inherits ``HttpReads``: the session's retries, each request within a deadline and no redirect followed, and
a body read against a length and a pace.
"""

from __future__ import annotations

import http.client
import importlib
import threading
import uuid
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from optim_repair import signals
from optim_repair.errors import InputError, OptimRepairError
from optim_repair.records.traffic import Traffic
from optim_repair.storage.answers import receive, redirected, within
from optim_repair.storage.interface import Store
from optim_repair.storage.names import origin
from optim_repair.storage.objects import StoredObject

COALESCE_GAP = 1 << 20
"""Ranges of one object closer than this are read by one GET: a DCP shard's bytes entries lie at its head."""
WORKERS = 8
"""Requests in flight at once."""
_CHUNK = 8 << 20
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


class Counter:
    """The requests a client sent and the bytes they moved, counted from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.read = self.written = self.copied = 0

    def add(self, *, requests: int = 0, read: int = 0, written: int = 0, copied: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.read += read
            self.written += written
            self.copied += copied


class _Reads(Protocol):
    """What ``BatchedReads`` builds on: the reader's own ranged read and HEAD, and ``each``."""

    def get_range(self, key: str, stored: StoredObject, start: int, end: int) -> bytes: ...

    def head(self, key: str) -> StoredObject: ...

    def each(self, work: Callable[[_Item], _Result], items: Sequence[_Item]) -> Generator[_Result, None, None]: ...


class _Answers(Protocol):
    """What ``HttpReads.body`` builds on: the reader's counter, its transport's failures, and how it names an
    object and a lost transport."""

    _count: Counter
    _transport: tuple[type[BaseException], ...]

    def where(self, key: str) -> str: ...

    def _lost(self, exc: BaseException, key: str) -> InputError: ...


_Batched = TypeVar("_Batched", bound="BatchedReads")


class BatchedReads:
    """The reads a store's reader builds from its own ``get_range`` and ``head``, counted by its ``_count``."""

    _count: Counter
    bucket: str

    def sibling(self: _Batched, bucket: str) -> _Batched:
        """The store of ``bucket`` through the same client, counted with this one, as the same run."""
        if bucket == self.bucket:
            return self
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.bucket = bucket
        return other

    def traffic(self) -> Traffic:
        count = self._count
        return Traffic(count.requests, count.read, count.written, count.copied)

    def count(self, *, read: int = 0, written: int = 0, copied: int = 0) -> None:
        """Count bytes a request moved (its requests are counted as they are sent)."""
        self._count.add(read=read, written=written, copied=copied)

    def ranges(
        self: _Reads, key: str, stored: StoredObject, wanted: Sequence[tuple[int, int]], *, gap: int = COALESCE_GAP
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

    def identical(self: _Reads, key: str, stored: StoredObject, other: str, source: Store) -> bool:
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

    def each(self, work: Callable[[_Item], _Result], items: Sequence[_Item]) -> Generator[_Result, None, None]:
        """``work`` of each item, ``WORKERS`` at a time, in the order given. Closed early (an error, an ending
        signal), it starts no more, and returns once the requests in flight have ended."""
        pool = ThreadPoolExecutor(WORKERS)
        try:
            with signals.held():  # its threads start with the mask: the ending signals reach the main thread alone
                results = pool.map(work, items)
            yield from results
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


class HttpReads(BatchedReads):
    """What a reader over a requests session does alike: one session whose transport retries, its failures
    named, a new run and its counter (``opened``), each request answered within a deadline and never redirected
    (``answered``), and each body read within a length and at the floor's pace (``answers.receive``). The reader
    brings its session and the requests module (imported in its own package, as its extra is) and how a lost
    transport is named (``_lost``)."""

    _session: Any
    _transport: tuple[type[BaseException], ...]

    def opened(self, bucket: str, session: Any, requests: Any) -> None:
        """Read ``bucket`` through ``session``, retrying 429 and 5xx answers and lost connections (4 attempts,
        backing off, as the store's ``Retry-After`` asks), with a connection a request in flight; as a new run."""
        retry = importlib.import_module("urllib3.util.retry")
        urllib3 = importlib.import_module("urllib3.exceptions")
        retries = retry.Retry(
            total=4, backoff_factor=0.5, status_forcelist=(429, 500, 502, 503, 504), allowed_methods=None,
            raise_on_status=False, respect_retry_after_header=True,
        )  # fmt: skip
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=2 * WORKERS, max_retries=retries)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        self._session = session
        self._transport = (requests.RequestException, urllib3.HTTPError, http.client.HTTPException, OSError)
        self.bucket = bucket
        self.run = uuid.uuid4().hex
        """This run's id, in the metadata of every object it writes."""
        self._count = Counter()

    def answered(
        self: _Answers,
        session: Any,
        method: str,
        url: str,
        key: str,
        *,
        writing: bool,
        accept: tuple[int, ...],
        **kwargs: Any,
    ) -> Any:
        """``session``'s answer to one request about ``key``, its body unread, counted with the transport's retries:
        its body sent and its status and headers read within a deadline (``answers.within``); a redirect (a 3xx but
        a status ``accept`` names) refused unfollowed, naming where it pointed; a transport failure named."""
        try:
            answer = within(
                lambda: session.request(method, url, stream=True, allow_redirects=False, **kwargs),
                self.where(key), origin(url), writing=writing, sending=sending(kwargs),
            )  # fmt: skip
        except self._transport as exc:
            raise self._lost(exc, key) from exc
        retried = getattr(getattr(answer.raw, "retries", None), "history", ())
        self._count.add(requests=1 + len(retried))
        if 300 <= answer.status_code < 400 and answer.status_code not in accept:
            answer.close()
            raise redirected(answer.status_code, answer.headers.get("Location"), url, self.where(key), writing)
        return answer

    def body(
        self: _Answers,
        answer: Any,
        key: str,
        limit: int,
        sink: Callable[[bytes], None] | None = None,
        *,
        counted: bool = False,
    ) -> bytes:
        """The body of ``answer``, at most ``limit`` bytes at the floor's pace (``answers.receive``), into ``sink``
        where given (else returned); ``counted``: an object's bytes, counted as read. A transport failure named."""
        parts: list[bytes] = []

        def taken(chunk: bytes) -> None:
            if counted:
                self._count.add(read=len(chunk))
            (sink or parts.append)(chunk)

        try:
            receive(answer.raw, limit, taken, self.where(key))
        except OptimRepairError:
            raise
        except self._transport as exc:
            raise self._lost(exc, key) from exc
        finally:
            answer.close()
        return b"".join(parts)


def sending(request: dict[str, Any]) -> int:
    """How many bytes the body of a request (requests' keywords: ``data``) sends."""
    data = request.get("data")
    return len(data) if isinstance(data, bytes) else 0


def _end(wanted: Sequence[tuple[int, int]], group: Sequence[int]) -> int:
    return max(wanted[index][0] + wanted[index][1] for index in group)
