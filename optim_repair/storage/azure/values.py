"""What Azure's answers hold, read as Azure writes them, and what a run sends it.

MD5 values (base64 of the digest), XML answers (a listing, an error), block ids and block lists.
"""

from __future__ import annotations

import base64
import hashlib
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from xml.sax.saxutils import escape

from optim_repair.errors import InputError

_CHUNK = 8 << 20


def md5_of(path: Path) -> str:
    """A file's MD5, as Azure keeps it (``Content-MD5``: base64 of the digest)."""
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return encoded(digest.digest())


def md5_of_bytes(data: bytes) -> str:
    return encoded(hashlib.md5(data, usedforsecurity=False).digest())


def encoded(digest: bytes) -> str:
    """A digest as Azure writes a Content-MD5 (base64)."""
    return base64.b64encode(digest).decode()


def is_md5(text: str) -> bool:
    try:
        return len(base64.b64decode(text, validate=True)) == 16
    except ValueError:
        return False


def as_xml(data: bytes, where: str) -> ElementTree.Element:
    """An XML answer, parsed; one that declares a document type (entities to expand) is refused unparsed."""
    if b"<!" in data.replace(b"<![CDATA[", b""):
        raise InputError("answered with XML that declares a document type", path=where)
    try:
        return ElementTree.fromstring(data)
    except ElementTree.ParseError:
        raise InputError("answered with something other than XML", path=where) from None


def text_of(element: ElementTree.Element, path: str) -> str | None:
    found = element.find(path)
    return None if found is None else (found.text or "")


def block_id(run: str, index: int) -> str:
    """The id of a run's ``index``-th block of one object: every id of an object has the same length."""
    return base64.b64encode(f"{run}-{index:08d}".encode()).decode()


def block_list(ids: list[str]) -> bytes:
    """A Put Block List body naming ``ids`` (blocks this run staged), in order."""
    latest = "".join(f"<Latest>{escape(identifier)}</Latest>" for identifier in ids)
    return f'<?xml version="1.0" encoding="utf-8"?><BlockList>{latest}</BlockList>'.encode()
