"""What a store is told and what it answers with: endpoints, and the names a listing gives.

An endpoint is never shown with its credentials, and each listed name is checked where it is listed, so that no
store's name is ever joined onto a local path unchecked; what a listing keeps is bounded by the memory it takes.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable

from optim_repair.errors import InputError, UsageError, shown_name

NAME_LIMIT = 1024
"""The longest key S3 stores, in bytes: a longer name in a listing is a store's lie."""
LISTED_BYTES = 256 << 20
"""The most memory one listing's names may take (``ListingBudget``): a store that lists without end, or millions of
tiny objects, is refused past it, whatever its pages hold."""
NAME_OVERHEAD = 256
"""What a name kept costs beside its text and its version's: two strings, the object's record, its place in the
listing (about 250 bytes, measured)."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def redacted(text: str) -> str:
    """``text`` with the user information of every URL in it (``http://KEY:SECRET@host``) left out."""
    return _USERINFO.sub("", text)


def origin(url: str, base: str = "") -> str:
    """Where ``url`` (relative to ``base``, where given) points, as it is shown: its scheme, host and port, without
    credentials, path or query."""
    try:
        parts = urllib.parse.urlsplit(urllib.parse.urljoin(base, url[:2048]))
    except ValueError:  # a malformed address (an IPv6 host without its bracket)
        return shown_name(url[:200])
    host = parts.netloc.rpartition("@")[2][:255]
    return shown_name(f"{parts.scheme}://{host}" if parts.scheme else host)


def checked_endpoint(endpoint_url: str | None) -> str | None:
    """``endpoint_url`` as a store's client takes it; a malformed one, or one that holds credentials (requests are
    signed with the store's own credentials, never with these), is a ``UsageError`` that shows it without them."""
    if endpoint_url is None:
        return None
    shown = redacted(endpoint_url)
    try:
        parts = urllib.parse.urlsplit(endpoint_url)
        parts.port  # noqa: B018 (raises ValueError for a port out of range or not a number)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{shown} is not an endpoint URL (http://HOST[:PORT][/PATH] or https://...)")
    if parts.username is not None or parts.password is not None:
        raise UsageError(
            f"{shown}: an endpoint URL holds no credentials (requests are signed with the store's own: for s3:// "
            "the AWS keys of the environment, a profile or an SSO login; for gs://, application default credentials)"
        )
    return endpoint_url


def checked_name(name: str, where: Callable[[str], str]) -> str:
    """``name``, an object's key relative to the prefix listed, when it names a path inside that prefix: no empty,
    ``.`` or ``..`` segment, no leading ``/``, no longer than a key can be. A store may list ``run//home/u/x`` or
    ``run/../../x`` (S3 accepts both), which joined onto a local directory would name a path outside it: such a key
    is refused (exit 4, naming it), wherever it was to go. So is a name no file on a disk can have or no store can
    hold: one holding a NUL or another control character, or one that is no UTF-8 text (a lone surrogate, which
    GCS's JSON can spell)."""
    try:
        length = len(name.encode())
    except UnicodeEncodeError:
        length = -1
    if length < 0 or _CONTROL.search(name):
        raise InputError(
            "is listed by a name holding a NUL or another control character, or no UTF-8 text; it is refused",
            path=where(name),
        )
    parts = name.split("/")
    if not name or any(part in ("", ".", "..") for part in parts) or length > NAME_LIMIT:
        raise InputError(
            "names a path outside its prefix (an empty, '.' or '..' segment, or a leading '/'); it is refused",
            path=where(name),
        )
    return name


class ListingBudget:
    """The memory one listing holds (``where``: the prefix listed, for the message): each name kept, with its
    version, costs their UTF-8 bytes and ``NAME_OVERHEAD``, and so does each page token (kept twice: among those
    seen, and in the next request); past ``LISTED_BYTES`` the listing is refused (exit 4, naming the limit)."""

    def __init__(self, where: str) -> None:
        self.held = 0
        self._where = where

    def hold(self, *texts: str) -> None:
        self.held += NAME_OVERHEAD + sum(len(text.encode(errors="surrogatepass")) for text in texts)
        if self.held > LISTED_BYTES:
            raise InputError(
                f"lists more names than {LISTED_BYTES:,} bytes of memory hold (each name's bytes and "
                f"{NAME_OVERHEAD} more); list a narrower prefix",
                path=self._where,
            )
