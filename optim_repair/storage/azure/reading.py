"""Reading an Azure Blob Storage container over its REST API: one counted session, its listings and reads.

The session is requests' (urllib3 retries transient failures: 429, 5xx, a reset connection); what authorizes it is
found as Azure's tools find it (``credentials``: an account SAS made by Azure's SDK from an account key, a SAS, or
an Azure AD token), so that every answer's status, headers and length are seen and judged (the
``optim-repair[azure]`` extra). A read names the ETag it read (``If-Match``, and the answer's ``ETag`` must be it),
so an object replaced meanwhile is refused, never mixed with its old bytes. Bodies are read against a length and a
pace (``answers.receive``), whole answers (a listing's page) against a size and a deadline; an XML answer that
declares a document type is refused unparsed. Azure reads no suffix range, so the last bytes of an object are read
by its properties, then a range.
"""

from __future__ import annotations

import email.utils
import hashlib
import importlib
import re
import urllib.parse
from pathlib import Path
from typing import Any, BinaryIO

from optim_repair.errors import InputError, ObjectExists, OptimRepairError, OutputError, shown_name
from optim_repair.storage.answers import CHANGED, WHOLE_ANSWER_BYTES, cut, within
from optim_repair.storage.azure.credentials import Access, access, without_queries
from optim_repair.storage.azure.values import as_xml, encoded, is_md5, md5_of, text_of
from optim_repair.storage.batched import HttpReads, sending
from optim_repair.storage.names import ListingBudget, checked_name, origin, redacted
from optim_repair.storage.objects import Copied, Small, StoredObject

API_VERSION = "2023-11-03"
CONNECT_SECONDS = 10
READ_SECONDS = 60
"""What the transport waits for a connection, and for each read of a socket (a store that answers nothing)."""
RUN_METADATA = "optimrepairrun"
"""The metadata (``x-ms-meta-optimrepairrun``) every object a run writes carries: the run's id."""
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20})")
_DIGITS = re.compile(r"[0-9]{1,20}")
_ETAG = re.compile(r'"?[\x21\x23-\x7e]{1,200}"?')
_SMALL_ATTEMPTS = 5


class AzureReader(HttpReads):
    """One container's objects, through one session whose every request is counted and every answer checked."""

    proof = "Azure Content-MD5"

    def __init__(self, container: str, *, account: str | None = None, endpoint_url: str | None = None) -> None:
        self.access: Access = access(account, endpoint_url)
        self._requests = importlib.import_module("requests")
        self.opened(container, self._requests.Session(), self._requests)
        self._once: Any = self._requests.Session()
        """For a request whose refusal is an answer (``send(retried=False)``): sent once."""

    def where(self, key: str) -> str:
        return f"az://{self.bucket}/{key}"

    def file_checksum(self, path: Path) -> str:
        return md5_of(path)

    def url(self, key: str | None = None, *, container: str | None = None) -> str:
        """The REST URL of the container, or of its object ``key``."""
        root = f"{self.access.endpoint}/{urllib.parse.quote(container or self.bucket, safe='')}"
        return root if key is None else f"{root}/{urllib.parse.quote(key, safe='/')}"

    def send(
        self,
        method: str,
        url: str,
        key: str,
        *,
        writing: bool = False,
        accept: tuple[int, ...] = (),
        retried: bool = True,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One request (about ``key``, for messages), its body left unread, retried where transient unless not
        ``retried``, answered in time and not redirected (``answered``); a refusal (but the statuses ``accept``
        names) or a transport failure raised as the error a user is shown."""
        kwargs.setdefault("timeout", (CONNECT_SECONDS, READ_SECONDS))
        sent = {"x-ms-version": API_VERSION, "Accept-Encoding": "identity", **self.access.headers(), **(headers or {})}
        answer = self.answered(
            self._session if retried else self._once, method, url, key, writing=writing, accept=accept, headers=sent,
            params={**(params or {}), **self.access.query()}, **kwargs,
        )  # fmt: skip
        if answer.status_code >= 400 and answer.status_code not in accept:
            raise self.failure(answer, key, writing, listing=(params or {}).get("comp") == "list")
        return answer

    def whole(self, method: str, url: str, key: str, **kwargs: Any) -> tuple[Any, bytes]:
        """A request and its whole answer, read within ``WHOLE_ANSWER_BYTES`` and a deadline."""

        def call() -> tuple[Any, bytes]:
            answer = self.send(method, url, key, **kwargs)
            return answer, self.body(answer, key, WHOLE_ANSWER_BYTES)

        return within(call, self.where(key), origin(url), sending=sending(kwargs))

    def failure(self, answer: Any, key: str, writing: bool, *, listing: bool = False) -> OptimRepairError:
        """The error of a request the store refused, by its status and ``x-ms-error-code``: denied is exit 4; a
        write that would replace an object is exit 5 (``ObjectExists``); a source or a read whose ETag changed
        says so. A listing not found is of no container."""
        where, status = self.where(key), answer.status_code
        code = str(answer.headers.get("x-ms-error-code", ""))[:100]
        message = ""
        if answer.request.method != "HEAD":
            try:
                message = text_of(as_xml(self.body(answer, key, 64 << 10), where), "Message") or ""
            except OptimRepairError:
                message = ""
        answer.close()
        first = message.splitlines()[0] if message else ""
        detail = without_queries(redacted(shown_name(f"{code}: {first}".strip(": ")[:300])))
        if status in (401, 403):
            return InputError(f"access denied (HTTP {status}: {detail})", path=where)
        if status == 404:
            container = listing or code == "ContainerNotFound"
            return InputError("no such container" if container else "no such object (was it deleted meanwhile?)",
                              path=where)  # fmt: skip
        if code == "SourceConditionNotMet" or (status == 412 and not writing):
            return InputError(CHANGED, path=where)
        if writing and ((status == 409 and code == "BlobAlreadyExists") or status == 412):
            return ObjectExists("exists: another writer put an object there first", path=where)
        kind = OutputError if writing else InputError
        return kind(f"the store refused the request (HTTP {status}: {detail})", path=where)

    def _lost(self, exc: BaseException, key: str) -> InputError:
        reason = without_queries(redacted(str(exc)))
        return InputError(f"the store could not be reached or stopped answering ({reason})", path=self.where(key))

    def properties(self, answer: Any, key: str) -> tuple[StoredObject, Copied, str | None]:
        """An object's properties, judged: its size, ETag and Content-MD5 (None without one), and the run that
        wrote it (None when no run of optim-repair did)."""
        size, etag = answer.headers.get("Content-Length"), answer.headers.get("ETag")
        md5 = answer.headers.get("Content-MD5")
        if not (isinstance(size, str) and _DIGITS.fullmatch(size) and isinstance(etag, str) and _ETAG.fullmatch(etag)):
            raise InputError("was described without a size and an ETag", path=self.where(key))
        if md5 is not None and not is_md5(md5):
            raise InputError(f"was described with a Content-MD5 of no MD5 ({shown_name(md5[:60])})",
                             path=self.where(key))  # fmt: skip
        run = answer.headers.get(f"x-ms-meta-{RUN_METADATA}")
        return StoredObject(int(size), etag), Copied(md5, etag), run

    def _head(self, key: str) -> tuple[StoredObject, Copied, str | None, Any]:
        answer = self.send("HEAD", self.url(key), key)
        answer.close()
        return (*self.properties(answer, key), answer)

    def listing(self, prefix: str, *, children: bool = False) -> dict[str, StoredObject]:
        """Every object under ``prefix`` (``children``: only those directly in it), by its checked name relative to
        it. A listing that repeats a marker or a name, lists a name outside ``prefix``, or holds more than its
        budget (``ListingBudget``: one that never ends) is refused; a directory of a hierarchical namespace
        (``hdi_isfolder``) holds nothing and is passed over."""
        found: dict[str, StoredObject] = {}
        budget = ListingBudget(self.where(prefix))
        markers: set[str] = set()
        params = {"restype": "container", "comp": "list", "prefix": prefix, "include": "metadata"}
        if children:
            params["delimiter"] = "/"
        while True:
            _, data = self.whole("GET", self.url(), prefix, params=params)
            page = as_xml(data, self.where(prefix))
            blobs = page.find("Blobs")
            for item in [] if blobs is None else blobs.findall("Blob"):
                if self._is_object(item):
                    name, stored = self._listed(item, prefix)
                    budget.hold(name, stored.etag)
                    found[name] = stored
            following = text_of(page, "NextMarker")
            if not following:
                return found
            if following in markers:
                raise InputError("the store repeats its listing (a marker came twice)", path=self.where(prefix))
            markers.add(following)
            budget.hold(following, following)
            params = {**params, "marker": following}

    @staticmethod
    def _is_object(item: Any) -> bool:
        return (text_of(item, "Metadata/hdi_isfolder") or "").lower() != "true"

    def _listed(self, item: Any, prefix: str) -> tuple[str, StoredObject]:
        name_element = item.find("Name")
        key = None if name_element is None else name_element.text or ""
        if key is not None and name_element is not None and name_element.get("Encoded") == "true":
            key = urllib.parse.unquote(key, errors="surrogateescape")  # bytes of no UTF-8: refused by checked_name
        if not (isinstance(key, str) and key.startswith(prefix)):
            raise InputError(f"listed {shown_name(str(key))}, which is not under it", path=self.where(prefix))
        size, etag = text_of(item, "Properties/Content-Length"), text_of(item, "Properties/Etag")
        if not (size is not None and _DIGITS.fullmatch(size) and etag is not None and _ETAG.fullmatch(etag)):
            raise InputError("was listed without a size and an ETag", path=self.where(key))
        name = checked_name(key[len(prefix) :], lambda relative: self.where(f"{prefix}{relative}"))
        return name, StoredObject(int(size), etag if etag.startswith('"') else f'"{etag}"')

    def head(self, key: str) -> StoredObject:
        return self._head(key)[0]

    def checksum(self, key: str) -> Copied:
        """The Content-MD5 the object ``key`` carries (None without one: a property its writer set, or Azure
        computed for an object written by one request), and its ETag."""
        return self._head(key)[1]

    def owner(self, key: str) -> tuple[str | None, Copied] | None:
        try:
            _, copied, run, _ = self._head(key)
        except InputError as exc:
            if "no such object" in exc.reason:
                return None
            raise
        return run, copied

    def _media(self, key: str, etag: str, wanted: tuple[int, int] | None) -> Any:
        """A GET of ``key``'s bytes while it is the ETag ``etag`` (the range ``wanted``, inclusive, or all of
        them), its body unread; an answer from another ETag is refused."""
        headers = {"If-Match": etag}
        if wanted is not None:
            headers["x-ms-range"] = f"bytes={wanted[0]}-{wanted[1]}"
        answer = self.send("GET", self.url(key), key, headers=headers)
        if answer.headers.get("ETag") != etag:
            answer.close()
            raise InputError(CHANGED, path=self.where(key))
        if answer.headers.get("Content-Encoding", "identity") != "identity":
            answer.close()
            raise InputError("is stored compressed (Content-Encoding); it is read as stored", path=self.where(key))
        return answer

    def _ranged(self, answer: Any, asked: tuple[int, int, int], key: str) -> None:
        """Refuse, unread, an answer that is not the range ``asked`` (a 206 whose Content-Range is it, or a 200
        giving the whole object where that was asked)."""
        length = answer.headers.get("Content-Length")
        if answer.status_code == 200 and asked[:2] == (0, asked[2] - 1) and length == str(asked[2]):
            return
        matched = _CONTENT_RANGE.fullmatch(answer.headers.get("Content-Range", ""))
        if answer.status_code != 206 or matched is None or tuple(int(value) for value in matched.groups()) != asked:
            answer.close()
            given = answer.headers.get("Content-Range", f"HTTP {answer.status_code}")
            raise InputError(f"answered a read of another range than was asked ({shown_name(given[:100])})",
                             path=self.where(key))  # fmt: skip
        if length != str(asked[1] - asked[0] + 1):
            answer.close()
            raise InputError("answered a read by range with another length", path=self.where(key))

    def get_range(self, key: str, stored: StoredObject, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of the ETag ``stored`` of ``key``, by one GET: only an answer of the range
        asked for is read, and no more than was asked."""
        if not 0 <= start < end <= stored.size:
            raise InputError(f"has no bytes {start:,} to {end:,} (it holds {stored.size:,})", path=self.where(key))
        answer = self._media(key, stored.etag, (start, end - 1))
        self._ranged(answer, (start, end - 1, stored.size), key)
        data = self.body(answer, key, end - start, counted=True)
        if len(data) != end - start:
            raise InputError(cut(len(data), end - start), path=self.where(key))
        return data

    def tail(self, key: str, length: int) -> tuple[StoredObject, bytes]:
        """The last ``length`` bytes of ``key`` (all of it, if shorter), with its size and ETag, which later reads
        name: its properties, then a ranged GET (Azure reads no suffix range)."""
        stored = self.head(key)
        if stored.size == 0:
            return stored, b""
        return stored, self.get_range(key, stored, max(0, stored.size - length), stored.size)

    def download(self, key: str, stored: StoredObject, target: BinaryIO) -> None:
        """The whole ETag ``stored`` of ``key`` into ``target``, checked against its Content-MD5 where it has one."""
        if stored.size == 0:
            return
        answer = self._media(key, stored.etag, (0, stored.size - 1))
        self._ranged(answer, (0, stored.size - 1, stored.size), key)
        digest = hashlib.md5(usedforsecurity=False)
        received = 0

        def sink(chunk: bytes) -> None:
            nonlocal received
            digest.update(chunk)
            received += len(chunk)
            target.write(chunk)

        self.body(answer, key, stored.size, sink, counted=True)
        if received != stored.size:
            raise InputError(cut(received, stored.size), path=self.where(key))
        kept = self.checksum(key).checksum
        if kept is not None and kept != encoded(digest.digest()):
            raise InputError("its bytes do not match the Content-MD5 it carries", path=self.where(key))

    def read_small(self, key: str, limit: int) -> Small | None:
        """The object ``key`` whole when it holds at most ``limit`` bytes (a marker), with its writer and age by the
        store's clock; None when there is none."""
        for _ in range(_SMALL_ATTEMPTS):  # its properties, then its bytes: a run may write it again in between
            try:
                stored, _, run, described = self._head(key)
            except InputError as exc:
                if "no such object" in exc.reason:
                    return None
                raise
            if stored.size > limit:
                raise InputError(f"holds {stored.size:,} bytes, more than the {limit:,} read", path=self.where(key))
            if stored.size == 0:
                data = b""
                break
            try:
                data = self.get_range(key, stored, 0, stored.size)
                break
            except InputError as exc:
                if "no such object" not in exc.reason and exc.reason != CHANGED:
                    raise
        else:
            raise InputError(f"was written again each of {_SMALL_ATTEMPTS} times it was read", path=self.where(key))
        try:
            now = email.utils.parsedate_to_datetime(str(described.headers.get("Date")))
            modified = email.utils.parsedate_to_datetime(str(described.headers.get("Last-Modified")))
            age: float | None = (now - modified).total_seconds()
        except (TypeError, ValueError):
            age = None
        return Small(data, stored.etag, run, age)
