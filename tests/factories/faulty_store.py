"""An HTTP proxy on 127.0.0.1 in front of the real S3 server of ``tests.factories.s3server``, which passes every
request and answer through unchanged until a fault is armed: then the store lies (names it does not hold, a whole
object for a ranged read, a continuation token that never ends), drips, cuts answers off, loses answers of requests
that took effect, fails, or answers late.

Clients reach it as they reach a store, by its endpoint (``AWS_ENDPOINT_URL``). It forwards the request as it came:
method, path and query, the headers (Host and the SigV4 Authorization included) and the body; a body sent with
chunked transfer encoding goes on de-chunked with a Content-Length, its other headers (``Content-Encoding:
aws-chunked``, ``x-amz-decoded-content-length``) untouched. Only the headers of the hop itself (Connection,
Transfer-Encoding, an Expect the proxy has already answered with ``100 Continue``) are not forwarded. The faults that
alter a request (ignore-range drops the signed Range header, repeat-token a query parameter) would not pass a server
that checks signatures; the others leave the request intact.
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
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal, get_args
from urllib.parse import parse_qs, quote, urlsplit
from xml.sax.saxutils import escape

Kind = Literal["hostile-names", "ignore-range", "drip", "cut", "repeat-token", "lose-answer", "fail", "slow-headers"]
"""What a fault does to the requests it hits (see ``Fault``)."""
KINDS: tuple[Kind, ...] = get_args(Kind)
TOKEN = "same-token"
"""The continuation token of repeat-token: every listing it rewrites says there is more, from this token."""
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "transfer-encoding"})
"""Headers of one hop, which a proxy does not pass on."""
_NOT_XML = re.compile("[\x00-\x08\x0b-\x1f\ufffe\uffff]")
"""Characters that XML 1.0 text cannot hold as themselves (a carriage return would be read as a line feed)."""


@dataclass(frozen=True)
class Fault:
    """One misbehaviour of the store, and the requests it hits.

    - ``hostile-names``: moto's ListObjectsV2 answer gains a ``<Contents>`` entry (Size, ETag, LastModified) for each
      of ``names`` after its own, KeyCount adjusted; URL-encoded as moto encodes its keys when the request asked for
      ``encoding-type=url`` (as botocore does), else XML-escaped, the characters XML cannot hold as themselves as
      character references (a carriage return survives; the control characters XML 1.0 forbids make parsers refuse
      the answer, which is why S3 offers ``encoding-type=url``).
    - ``ignore-range``: a request with a Range header goes to moto without it; the client gets the 200 and the whole
      body.
    - ``drip``: status and headers as usual, then the body one byte every ``delay`` seconds.
    - ``cut``: status and headers (the full Content-Length), ``after`` bytes of the body, then the connection closes.
    - ``repeat-token``: a ListObjectsV2 answer says it is truncated, with ``NextContinuationToken`` ``TOKEN``; a
      request that comes back with that token goes to moto without it (armed or not), so the first page comes again.
    - ``lose-answer``: moto gets the request (it takes effect); the client gets ``status`` and an S3 error.
    - ``fail``: moto never sees the request; the client gets ``status`` and an S3 error (``InternalError``).
    - ``slow-headers``: moto gets the request at once; the answer starts ``delay`` seconds later.

    A fault hits the requests of ``method`` (any when None) whose path and query contain ``match``, ``times`` of them
    (all when None); hostile-names and repeat-token hit only listings (S3's ListObjectsV2, or GCS's JSON listing,
    whose ``items`` gain the names and whose ``nextPageToken`` they set), ignore-range only ranged ones.
    Faults of different kinds armed together combine on a request (a failed answer comes late, a cut one drips); of
    one kind, the first armed that matches hits.
    """

    kind: Kind
    method: str | None = None
    match: str = ""
    times: int | None = None
    names: tuple[str, ...] = ()
    after: int = 0
    delay: float = 1.0
    status: int = 500

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

    def take(self, method: str, target: str, *, listing: bool, ranged: bool) -> dict[Kind, Fault]:
        """Record a request (``method`` and ``target``, its path and query) and return the faults that hit it, by kind;
        ``listing``: it is a ListObjectsV2 request, ``ranged``: it has a Range header."""
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
                    or (fault.kind in ("hostile-names", "repeat-token") and not listing)
                    or (fault.kind == "ignore-range" and not ranged)
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
        gcs_listing = self.command == "GET" and urlsplit(self.path).path.endswith("/o")  # GCS's JSON API
        listing = self.command == "GET" and (query.get("list-type") == ["2"] or gcs_listing)
        hit = proxy.take(self.command, self.path, listing=listing, ranged="Range" in self.headers)
        if "fail" in hit:
            answer = _error(hit["fail"].status)
        else:
            skipped = {"range"} if "ignore-range" in hit else set()
            answer = self._forward(proxy.upstream, _without_token(self.path), body, sized, skipped)
            if answer.status == 200 and "hostile-names" in hit:
                names = hit["hostile-names"].names
                answer.body = (
                    _with_items(answer.body, names)
                    if gcs_listing
                    else _with_names(answer.body, names, query.get("encoding-type") == ["url"])
                )
            if answer.status == 200 and "repeat-token" in hit:
                answer.body = _page_token(answer.body) if gcs_listing else _truncated(answer.body)
            if "lose-answer" in hit:
                answer = _error(hit["lose-answer"].status)
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

    def _forward(self, upstream: tuple[str, int], target: str, body: bytes, sized: bool, skipped: set[str]) -> _Answer:
        """Moto's whole answer to the request, sent on with its headers but those of the hop and ``skipped``."""
        connection = http.client.HTTPConnection(*upstream, timeout=60)
        try:
            connection.putrequest(self.command, target, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP | skipped | {"expect", "content-length"}:
                    connection.putheader(name, value)
            if sized:
                connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body if sized else None)
            response = connection.getresponse()
            return _Answer(response.status, response.reason, response.getheaders(), response.read())
        finally:
            connection.close()

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


def _error(status: int) -> _Answer:
    """An S3 error answer (``InternalError``) with ``status``."""
    request_id = uuid.uuid4().hex[:16].upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
        "<Message>We encountered an internal error. Please try again.</Message>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    return _Answer(status, phrase, [("Content-Type", "application/xml"), ("x-amz-request-id", request_id)], body)


def _without_token(target: str) -> str:
    """``target`` without the continuation token repeat-token hands out, which moto would not know."""
    path, _, query = target.partition("?")
    if not query:
        return target
    kept = [part for part in query.split("&") if part not in (f"continuation-token={TOKEN}", f"pageToken={TOKEN}")]
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


def start(upstream: str) -> FaultyProxy:
    """A proxy in front of the server at ``upstream`` (``http://HOST:PORT``), serving from a daemon thread."""
    proxy = FaultyProxy(upstream)
    proxy._thread.start()
    return proxy


def stop(proxy: FaultyProxy) -> None:
    """Stop accepting and close the listening socket (connections still open end with the process)."""
    proxy._server.shutdown()
    proxy._server.server_close()
    proxy._thread.join()
