"""An HTTP proxy on 127.0.0.1 in front of a real store's server (the S3 server of ``tests.factories.s3server``,
the GCS emulator of ``gcsserver``, Azurite of ``azurite``), which passes every request and answer through unchanged
until a fault is armed: then the store lies (names it does not hold, a whole object for a ranged read, a
continuation token that never ends, an answer of its choosing), drips, cuts answers off, loses answers of requests
that took effect, fails, answers late or drips its very headers, or redirects to another origin (``Elsewhere``, a
server that records what reaches it); or another writer acts just before a request goes on.

Clients reach it as they reach a store, by its endpoint (``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``, an
``--endpoint-url`` of ``http://127.0.0.1:PORT/devstoreaccount1`` for Azure). It forwards the request as it came:
method, path and query (an Azure SAS, which rides in the query, included), the headers (Host, the SigV4
Authorization, every ``x-ms-*`` header included) and the body; a body sent with chunked transfer encoding goes on
de-chunked with a Content-Length, its other headers (``Content-Encoding: aws-chunked``,
``x-amz-decoded-content-length``) untouched. Only the headers of the hop itself (Connection, Transfer-Encoding, an
Expect the proxy has already answered with ``100 Continue``) are not forwarded. The faults that alter a request
(ignore-range drops the signed Range header, repeat-token a query parameter) would not pass a server that checks
signatures; the others leave the request intact. A request carrying ``x-ms-version`` is Azure's: its failures are
answered as Azure answers them (an ``x-ms-error-code`` header and Azure's XML error).

What Azurite lacks, the proxy can do in its place (``copies-ranges``): Azurite answers Put Block From URL (``PUT
?comp=block`` with ``x-ms-copy-source``) with 501, or 500 under an account SAS, where the service copies the range
itself. Armed, the proxy serves it as Azure's REST reference describes it (learn.microsoft.com, "Put Block From
URL"): the source is read by ``x-ms-source-range`` while its ETag is ``x-ms-source-if-match`` (a source changed
since is ``412 SourceConditionNotMet``; a source that cannot be read, ``CannotVerifyCopySource`` with its status),
authorized as the source URL says (its SAS, or ``x-ms-copy-source-authorization``); its bytes are staged as the
block by a plain Put Block carrying their Content-MD5, and the answer is the service's ``201 Created``.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import socket
import threading
import time
import uuid
from base64 import b64encode
from collections.abc import Callable, Collection
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal, get_args
from urllib.parse import parse_qs, quote, urlsplit
from xml.sax.saxutils import escape

Kind = Literal[
    "hostile-names", "ignore-range", "drip", "cut", "repeat-token", "lose-answer", "fail", "slow-headers",
    "copies-ranges", "meanwhile", "answer-body", "answer-headers", "redirect", "drip-headers",
]  # fmt: skip
"""What a fault does to the requests it hits (see ``Fault``)."""
KINDS: tuple[Kind, ...] = get_args(Kind)
TOKEN = "same-token"
"""The continuation token of repeat-token: every listing it rewrites says there is more, from this token."""
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "transfer-encoding"})
"""Headers of one hop, which a proxy does not pass on."""
_NOT_XML = re.compile("[\x00-\x08\x0b-\x1f\ufffe\uffff]")
"""Characters that XML 1.0 text cannot hold as themselves (a carriage return would be read as a line feed)."""
_FROM_URL = frozenset(
    {"x-ms-copy-source", "x-ms-copy-source-authorization", "x-ms-source-range", "x-ms-source-if-match",
     "x-ms-source-if-none-match", "x-ms-source-if-modified-since", "x-ms-source-if-unmodified-since",
     "x-ms-source-content-md5", "x-ms-source-content-crc64"}
)  # fmt: skip
"""The headers of a Put Block From URL that speak of its source, which a plain Put Block does not carry."""


@dataclass(frozen=True)
class Fault:
    """One misbehaviour of the store, and the requests it hits.

    - ``hostile-names``: moto's ListObjectsV2 answer gains a ``<Contents>`` entry (Size, ETag, LastModified) for each
      of ``names`` after its own, KeyCount adjusted; URL-encoded as moto encodes its keys when the request asked for
      ``encoding-type=url`` (as botocore does), else XML-escaped, the characters XML cannot hold as themselves as
      character references (a carriage return survives; the control characters XML 1.0 forbids make parsers refuse
      the answer, which is why S3 offers ``encoding-type=url``). An Azure listing (``GET
      /ACCOUNT/CONTAINER?restype=container&comp=list``) gains a ``<Blob>`` (Name, and Properties with Content-Length,
      Etag, Last-Modified) for each after Azurite's own, its Name XML-escaped as above, or, where ``encoded``, as
      Azure writes a name XML cannot hold: percent-encoded (every character but letters, digits and ``_.-~``; a
      lone surrogate as the byte it stands for, as ``surrogateescape`` decoded it), ``<Name Encoded="true">``.
    - ``ignore-range``: a request with a Range header (Azure's ``x-ms-range`` too) goes to moto without it; the client
      gets the 200 and the whole body.
    - ``drip``: status and headers as usual, then the body one byte every ``delay`` seconds.
    - ``cut``: status and headers (the full Content-Length), ``after`` bytes of the body, then the connection closes.
    - ``repeat-token``: a ListObjectsV2 answer says it is truncated, with ``NextContinuationToken`` ``TOKEN``; a
      request that comes back with that token goes to moto without it (armed or not), so the first page comes again.
      An Azure listing's ``NextMarker`` becomes ``TOKEN`` (its ``marker`` parameter is dropped likewise).
    - ``lose-answer``: moto gets the request (it takes effect); the client gets ``status`` and an S3 error (Azure's,
      for Azure's requests).
    - ``fail``: moto never sees the request; the client gets ``status`` and an S3 error (``InternalError``; Azure's,
      for Azure's requests).
    - ``slow-headers``: moto gets the request at once; the answer starts ``delay`` seconds later.
    - ``copies-ranges``: the proxy serves a Put Block From URL itself, as the module says, where Azurite cannot.
    - ``meanwhile``: ``action`` runs (another writer's request, say) just before the request goes on.
    - ``answer-body``: the answer's body is ``body`` instead (its status and other headers as they were).
    - ``answer-headers``: the answer's headers that ``headers`` names carry the values it gives instead (added where
      the answer had none; left out where the value is None; its status, other headers and body as they were).
    - ``redirect``: moto never sees the request; the client gets ``307 Temporary Redirect`` to the same path and
      query at ``location`` (``http://HOST:PORT``: an ``Elsewhere``'s endpoint).
    - ``drip-headers``: moto never sees the request; the client gets a status line and headers one byte every
      ``delay`` seconds, without end (a header whose value never ends), for as long as the fault is armed and the
      client listens; once disarmed, the header ends and so does the answer (``400 Bad Request``, no body, the
      connection closed), so that a request a client left waiting is refused, never carried out later.

    ``message``, where given, is the message of the error answer of fail and lose-answer, ``{target}`` in it
    replaced by the request's path and query (a store that echoes the request). A fault hits the requests of
    ``method`` (any when None) whose path and query contain ``match`` and that carry the header ``header`` (any
    when empty), ``times`` of them (all when None); hostile-names and repeat-token hit only listings (S3's
    ListObjectsV2, GCS's JSON listing, whose ``items`` gain the names and whose ``nextPageToken`` they set, or
    Azure's), ignore-range only ranged ones, copies-ranges only Put Block From URL. Faults of different kinds armed
    together combine on a request (a failed answer comes late, a cut one drips); of one kind, the first armed that
    matches hits.
    """

    kind: Kind
    method: str | None = None
    match: str = ""
    times: int | None = None
    names: tuple[str, ...] = ()
    after: int = 0
    delay: float = 1.0
    status: int = 500
    encoded: bool = False
    header: str = ""
    action: Callable[[], object] | None = None
    body: bytes = b""
    headers: tuple[tuple[str, str | None], ...] = ()
    message: str = ""
    location: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; the faults are {', '.join(KINDS)}")


@dataclass
class _Armed:
    """An armed fault and how many more requests it may hit (None: no limit)."""

    fault: Fault
    left: int | None


@dataclass
class _Answer:
    """An HTTP answer as a whole: status, reason, headers in their order (repeated ones repeated), body."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class FaultyProxy:
    """The running proxy: its endpoint, the faults armed, what they hit and every request seen.

    ``hits`` counts, for each kind, the requests a fault of that kind hit since the last ``arm`` (a request that a
    retrying client repeats counts again); ``requests`` holds ``METHOD path?query`` of every request, as the client
    sent it, since the start.
    """

    def __init__(self, upstream: str) -> None:
        address = urlsplit(upstream)
        if address.hostname is None or address.port is None:
            raise ValueError(f"the upstream must be http://HOST:PORT, not {upstream!r}")
        self.upstream = (address.hostname, address.port)
        self.hits: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.requests: list[str] = []
        self._armed: list[_Armed] = []
        self._lock = threading.Lock()
        self._server = _Server(self)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-store", daemon=True)

    def arm(self, *faults: Fault) -> None:
        """Arm ``faults`` in place of those armed before, and count their hits from zero."""
        with self._lock:
            self._armed = [_Armed(fault, fault.times) for fault in faults]
            self.hits = dict.fromkeys(KINDS, 0)

    def disarm(self) -> None:
        """Pass everything through again (``hits`` keeps what the faults hit)."""
        with self._lock:
            self._armed = []

    def armed(self, fault: Fault) -> bool:
        """Whether ``fault`` is still armed."""
        with self._lock:
            return any(armed.fault is fault for armed in self._armed)

    def take(
        self,
        method: str,
        target: str,
        *,
        listing: bool,
        ranged: bool,
        from_url: bool = False,
        headers: Collection[str] = (),
    ) -> dict[Kind, Fault]:
        """Record a request (``method`` and ``target``, its path and query) and return the faults that hit it, by kind;
        ``listing``: it is a listing (ListObjectsV2, GCS's or Azure's), ``ranged``: it has a Range header,
        ``from_url``: it is an Azure Put Block From URL, ``headers``: the names of its headers, in lower case."""
        hit: dict[Kind, Fault] = {}
        with self._lock:
            self.requests.append(f"{method} {target}")
            for armed in self._armed:
                fault = armed.fault
                if (
                    fault.kind in hit
                    or armed.left == 0
                    or (fault.method is not None and fault.method.upper() != method)
                    or fault.match not in target
                    or (fault.header and fault.header.lower() not in headers)
                    or (fault.kind in ("hostile-names", "repeat-token") and not listing)
                    or (fault.kind == "ignore-range" and not ranged)
                    or (fault.kind == "copies-ranges" and not from_url)
                ):
                    continue
                hit[fault.kind] = fault
                self.hits[fault.kind] += 1
                if armed.left is not None:
                    armed.left -= 1
        return hit


class _Server(ThreadingHTTPServer):
    """The proxy's HTTP server: a thread (daemonic) for each connection, on a free port of 127.0.0.1."""

    def __init__(self, proxy: FaultyProxy) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.proxy = proxy

    def handle_error(self, request: object, client_address: object) -> None:
        """Nothing: a client that hangs up on a fault (a cut, a drip, a whole body it refused) is what the faults
        are for, and its traceback on stderr would be taken for the tool's."""


class _Handler(BaseHTTPRequestHandler):
    """One client connection, kept alive between requests as a store keeps it."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        """Every method is proxied alike."""
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def log_message(self, format: str, *args: object) -> None:
        """Nothing: the server behind keeps the log."""

    def _handle(self) -> None:
        """Read the request, forward it or not, alter the answer and send it, as the faults that hit it say."""
        server = self.server
        assert isinstance(server, _Server)
        proxy = server.proxy
        body, sized = self._read_body()
        query = parse_qs(urlsplit(self.path).query)
        azure = "x-ms-version" in self.headers
        gcs_listing = self.command == "GET" and urlsplit(self.path).path.endswith("/o")  # GCS's JSON API
        azure_listing = (
            self.command == "GET" and query.get("restype") == ["container"] and query.get("comp") == ["list"]
        )
        listing = self.command == "GET" and (query.get("list-type") == ["2"] or gcs_listing or azure_listing)
        from_url = self.command == "PUT" and query.get("comp") == ["block"] and "x-ms-copy-source" in self.headers
        ranged = "Range" in self.headers or "x-ms-range" in self.headers
        names = {name.lower() for name in self.headers}
        hit = proxy.take(self.command, self.path, listing=listing, ranged=ranged, from_url=from_url, headers=names)
        if "drip-headers" in hit:
            self._drip_headers(proxy, hit["drip-headers"])
            return
        if "meanwhile" in hit and hit["meanwhile"].action is not None:
            hit["meanwhile"].action()
        if "fail" in hit:
            answer = _error(hit["fail"].status, azure, _message(hit["fail"], self.path))
        elif "redirect" in hit:
            answer = _Answer(307, "Temporary Redirect", [("Location", f"{hit['redirect'].location}{self.path}")], b"")
        else:
            if "copies-ranges" in hit:
                answer = self._block_from_url(proxy, body)
            else:
                skipped = {"range", "x-ms-range"} if "ignore-range" in hit else set()
                answer = self._forward(proxy.upstream, _without_token(self.path), body, sized, skipped)
            if answer.status == 200 and "hostile-names" in hit:
                fault = hit["hostile-names"]
                if gcs_listing:
                    answer.body = _with_items(answer.body, fault.names)
                elif azure_listing:
                    answer.body = _with_blobs(answer.body, fault.names, fault.encoded)
                else:
                    answer.body = _with_names(answer.body, fault.names, query.get("encoding-type") == ["url"])
            if answer.status == 200 and "repeat-token" in hit:
                answer.body = (
                    _page_token(answer.body)
                    if gcs_listing
                    else _next_marker(answer.body)
                    if azure_listing
                    else _truncated(answer.body)
                )
            if "answer-body" in hit:
                answer.body = hit["answer-body"].body
            if "answer-headers" in hit:
                answer.headers = _with_headers(answer.headers, hit["answer-headers"].headers)
            if "lose-answer" in hit:
                answer = _error(hit["lose-answer"].status, azure, _message(hit["lose-answer"], self.path))
        if "slow-headers" in hit:
            time.sleep(hit["slow-headers"].delay)
        try:
            self._answer(answer, hit.get("drip"), hit.get("cut"))
        except OSError:
            self.close_connection = True

    def _read_body(self) -> tuple[bytes, bool]:
        """The request's body, de-chunked, and whether it came with a length or chunked (so goes on with one)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip(), 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline().strip():
                pass
            return b"".join(chunks), True
        length = self.headers.get("Content-Length")
        return (self.rfile.read(int(length)), True) if length is not None else (b"", False)

    def _forward(
        self,
        upstream: tuple[str, int],
        target: str,
        body: bytes,
        sized: bool,
        skipped: Collection[str],
        added: Collection[tuple[str, str]] = (),
    ) -> _Answer:
        """Moto's whole answer to the request, sent on with its headers but those of the hop and ``skipped``, and
        with ``added``."""
        connection = http.client.HTTPConnection(*upstream, timeout=60)
        try:
            connection.putrequest(self.command, target, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP | set(skipped) | {"expect", "content-length"}:
                    connection.putheader(name, value)
            for name, value in added:
                connection.putheader(name, value)
            if sized:
                connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body if sized else None)
            response = connection.getresponse()
            return _Answer(response.status, response.reason, response.getheaders(), response.read())
        finally:
            connection.close()

    def _block_from_url(self, proxy: FaultyProxy, body: bytes) -> _Answer:
        """A Put Block From URL served as Azure serves it (the module says how): the source's range read while it is
        the ETag named, then staged by a plain Put Block of those bytes and their Content-MD5."""
        if body:
            return _azure_error(400, "InvalidHeaderValue", "A Put Block From URL carries no body.")
        source = urlsplit(self.headers["x-ms-copy-source"])
        if source.scheme != "http" or source.hostname is None:
            return _azure_error(400, "CannotVerifyCopySource", "The copy source is no http:// URL the proxy reads.")
        named = (source.hostname, source.port or 80)
        ours = proxy.endpoint.rpartition(":")[2]  # the proxy names itself where a client reaches the store by it
        host = proxy.upstream if str(named[1]) == ours and named[0] in ("127.0.0.1", "localhost") else named
        headers = {"x-ms-version": self.headers.get("x-ms-version", "2023-11-03")}
        for name, sent in (("x-ms-source-range", "x-ms-range"), ("x-ms-source-if-match", "If-Match"),
                           ("x-ms-source-if-none-match", "If-None-Match"),
                           ("x-ms-copy-source-authorization", "Authorization")):  # fmt: skip
            if name in self.headers:
                headers[sent] = self.headers[name]
        connection = http.client.HTTPConnection(*host, timeout=60)
        try:
            connection.request("GET", f"{source.path}?{source.query}" if source.query else source.path,
                               headers=headers)  # fmt: skip
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        if response.status == 412:
            return _azure_error(412, "SourceConditionNotMet", "The source condition specified using HTTP conditional "
                                "header(s) is not met.")  # fmt: skip
        if response.status >= 300:
            return _azure_error(response.status, "CannotVerifyCopySource", response.reason)
        asked = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("x-ms-source-range", ""))
        if asked is not None and len(data) != int(asked[2]) - int(asked[1]) + 1:
            return _azure_error(
                416, "InvalidRange", "The range specified is invalid for the current size of the source."
            )
        md5 = b64encode(hashlib.md5(data).digest()).decode()
        return self._forward(proxy.upstream, self.path, data, True, _FROM_URL | {"content-md5"}, [("Content-MD5", md5)])

    def _answer(self, answer: _Answer, drip: Fault | None, cut: Fault | None) -> None:
        """Send ``answer`` (its Content-Length that of its whole body), its body dripped or cut if so armed."""
        self.send_response_only(answer.status, answer.reason)
        bodiless = self.command == "HEAD" or answer.status in (204, 304) or answer.status < 200
        for name, value in answer.headers:
            if name.lower() not in _HOP and (bodiless or name.lower() != "content-length"):
                self.send_header(name, value)
        if not bodiless:
            self.send_header("Content-Length", str(len(answer.body)))
        self.end_headers()
        sent = b"" if bodiless else answer.body[: cut.after] if cut else answer.body
        if drip:
            for index in range(len(sent)):
                time.sleep(drip.delay)
                self.wfile.write(sent[index : index + 1])
        else:
            self.wfile.write(sent)
        if cut:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def _drip_headers(self, proxy: FaultyProxy, fault: Fault) -> None:
        """A status line and headers one byte every ``delay`` seconds while ``fault`` is armed (a header without
        end once those are sent), then a ``400`` with no body, the connection closed (or the client hung up)."""
        self.close_connection = True
        head = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nX-Drip: "
        sent = 0
        try:
            while proxy.armed(fault):
                time.sleep(fault.delay)
                self.wfile.write(head[sent : sent + 1] if sent < len(head) else b"x")
                sent += 1
            self.wfile.write(head[sent:] + b"\r\n\r\n")
        except OSError:
            return


class Elsewhere:
    """Another origin on 127.0.0.1, where a ``redirect`` points: it records ``METHOD path?query`` and the length of
    the body of every request that reaches it (``requests``), and answers each ``404`` with no body."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int]] = []
        self._server = _ElsewhereServer(self)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="elsewhere", daemon=True)


class _ElsewhereServer(ThreadingHTTPServer):
    """An ``Elsewhere``'s HTTP server: a thread (daemonic) for each connection, on a free port of 127.0.0.1."""

    def __init__(self, elsewhere: Elsewhere) -> None:
        super().__init__(("127.0.0.1", 0), _Recording)
        self.elsewhere = elsewhere


class _Recording(BaseHTTPRequestHandler):
    """One connection to an ``Elsewhere``: each request recorded, answered ``404``."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        """Every method is recorded alike."""
        server = self.server
        assert isinstance(server, _ElsewhereServer)
        length = int(self.headers.get("Content-Length") or 0)
        server.elsewhere.requests.append((f"{self.command} {self.path}", len(self.rfile.read(length))))
        self.send_response_only(404, "Not Found")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def log_message(self, format: str, *args: object) -> None:
        """Nothing: the test reads ``requests``."""


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _message(fault: Fault, target: str) -> str | None:
    """The message of ``fault``'s error answer, ``{target}`` in it the request's (None: the store's usual)."""
    return fault.message.replace("{target}", target) if fault.message else None


def _error(status: int, azure: bool = False, message: str | None = None) -> _Answer:
    """An S3 error answer (``InternalError``) with ``status``; Azure's, for ``azure``; with ``message`` if given."""
    if azure:
        return _azure_error(status, "InternalError", message or "Server encountered an internal error.")
    request_id = uuid.uuid4().hex[:16].upper()
    text = _xml_text(message or "We encountered an internal error. Please try again.")
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
        f"<Message>{text}</Message><RequestId>{request_id}</RequestId></Error>"
    ).encode()
    return _Answer(
        status, _phrase(status), [("Content-Type", "application/xml"), ("x-amz-request-id", request_id)], body
    )


def _azure_error(status: int, code: str, message: str) -> _Answer:
    """An error answer as Azure's Blob service writes one: ``x-ms-error-code``, and the code and a message (with the
    request's id and the time, as Azure adds them) in XML."""
    request_id = str(uuid.uuid4())
    text = _xml_text(
        f"{message}\nRequestId:{request_id}\nTime:{time.strftime('%Y-%m-%dT%H:%M:%S.0000000Z', time.gmtime())}"
    )
    body = f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{code}</Code><Message>{text}</Message></Error>'.encode()
    headers = [("Content-Type", "application/xml"), ("x-ms-request-id", request_id), ("x-ms-error-code", code),
               ("x-ms-version", "2023-11-03"), ("Date", formatdate(usegmt=True))]  # fmt: skip
    return _Answer(status, _phrase(status), headers, body)


def _with_headers(headers: list[tuple[str, str]], given: tuple[tuple[str, str | None], ...]) -> list[tuple[str, str]]:
    """``headers`` with those ``given`` names (in any case) carrying the values given instead, added where absent,
    left out where the value given is None."""
    replaced = {name.lower() for name, _ in given}
    kept = [(name, value) for name, value in headers if name.lower() not in replaced]
    return [*kept, *((name, value) for name, value in given if value is not None)]


def _without_token(target: str) -> str:
    """``target`` without the continuation token repeat-token hands out, which moto would not know."""
    path, _, query = target.partition("?")
    if not query:
        return target
    dropped = (f"continuation-token={TOKEN}", f"pageToken={TOKEN}", f"marker={TOKEN}")
    kept = [part for part in query.split("&") if part not in dropped]
    return f"{path}?{'&'.join(kept)}" if kept else path


def _xml_text(text: str) -> str:
    """``text`` as XML character data; what XML cannot hold as itself, as a character reference."""
    return _NOT_XML.sub(lambda found: f"&#{ord(found[0])};", escape(text))


def _with_names(listing: bytes, names: tuple[str, ...], url_encoded: bool) -> bytes:
    """A ListObjectsV2 answer with an entry for each of ``names`` after moto's own, KeyCount adjusted."""
    entries = "".join(
        f"<Contents><Key>{_xml_text(quote(name) if url_encoded else name)}</Key>"
        "<LastModified>2024-01-01T00:00:00.000Z</LastModified>"
        f'<ETag>"{hashlib.md5(name.encode()).hexdigest()}"</ETag>'
        "<Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>"
        for name in names
    )
    text = listing.decode()
    place = text.rfind("</Contents>")
    place = place + len("</Contents>") if place >= 0 else text.rindex("</ListBucketResult>")
    text = text[:place] + entries + text[place:]
    text = re.sub(
        r"<KeyCount>(\d+)</KeyCount>", lambda found: f"<KeyCount>{int(found[1]) + len(names)}</KeyCount>", text
    )
    return text.encode()


def _truncated(listing: bytes) -> bytes:
    """A ListObjectsV2 answer that says it is truncated, to be continued from ``TOKEN``."""
    text = listing.decode().replace("<IsTruncated>false</IsTruncated>", "<IsTruncated>true</IsTruncated>")
    token = f"<NextContinuationToken>{TOKEN}</NextContinuationToken>"
    text, found = re.subn(r"<NextContinuationToken>[^<]*</NextContinuationToken>", token, text)
    if not found:
        place = text.rindex("</ListBucketResult>")
        text = text[:place] + token + text[place:]
    return text.encode()


def _with_items(listing: bytes, names: tuple[str, ...]) -> bytes:
    """A GCS listing (JSON) with an item for each of ``names`` after the emulator's own."""
    page = json.loads(listing)
    page["items"] = [
        *page.get("items", []),
        *({"kind": "storage#object", "name": name, "size": "1", "generation": "1", "crc32c": "AAAAAA=="}
          for name in names),
    ]  # fmt: skip
    return json.dumps(page).encode()


def _page_token(listing: bytes) -> bytes:
    """A GCS listing (JSON) that says there is more, from ``TOKEN``."""
    return json.dumps({**json.loads(listing), "nextPageToken": TOKEN}).encode()


def _with_blobs(listing: bytes, names: tuple[str, ...], encoded: bool) -> bytes:
    """An Azure listing (XML) with a ``<Blob>`` for each of ``names`` after Azurite's own."""
    entries = "".join(
        (
            f'<Blob><Name Encoded="true">{quote(name.encode(errors="surrogateescape"), safe="")}</Name>'
            if encoded
            else f"<Blob><Name>{_xml_text(name)}</Name>"
        )
        + "<Properties><Last-Modified>Mon, 01 Jan 2024 00:00:00 GMT</Last-Modified>"
        f"<Etag>0x{hashlib.md5(name.encode(errors='surrogateescape')).hexdigest()[:15].upper()}</Etag>"
        "<Content-Length>1</Content-Length><BlobType>BlockBlob</BlobType></Properties></Blob>"
        for name in names
    )
    text = listing.decode()
    text, found = re.subn(r"<Blobs\s*/>", f"<Blobs>{entries}</Blobs>", text, count=1)
    if not found:
        place = text.rindex("</Blobs>")
        text = text[:place] + entries + text[place:]
    return text.encode()


def _next_marker(listing: bytes) -> bytes:
    """An Azure listing (XML) that says there is more, from ``TOKEN``."""
    marker = f"<NextMarker>{TOKEN}</NextMarker>"
    text, found = re.subn(r"<NextMarker\s*/>|<NextMarker>[^<]*</NextMarker>", marker, listing.decode(), count=1)
    if not found:
        place = text.rindex("</EnumerationResults>")
        text = text[:place] + marker + text[place:]
    return text.encode()


def start(upstream: str) -> FaultyProxy:
    """A proxy in front of the server at ``upstream`` (``http://HOST:PORT``), serving from a daemon thread."""
    proxy = FaultyProxy(upstream)
    proxy._thread.start()
    return proxy


def elsewhere() -> Elsewhere:
    """Another origin, serving from a daemon thread: where a ``redirect`` points."""
    other = Elsewhere()
    other._thread.start()
    return other


def stop(proxy: FaultyProxy | Elsewhere) -> None:
    """Stop accepting and close the listening socket (connections still open end with the process)."""
    proxy._server.shutdown()
    proxy._server.server_close()
    proxy._thread.join()
