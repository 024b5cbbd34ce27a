"""What GCS's answers hold, read as GCS writes them.

CRC-32C values (base64 of the big-endian value), a JSON object's fields, the ``X-Goog-Hash`` header.
"""

from __future__ import annotations

import base64
import importlib
import itertools
import json
import re
from pathlib import Path
from typing import Any, TypeGuard

from optim_repair.errors import InputError

JSON_DEPTH = 32
"""The deepest JSON answer read: GCS's nest a few levels (a listing's items, an object's metadata, an error's
errors); deeper is refused before it is parsed, since Python's parser recurses once a level."""
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
_COUNT = re.compile("[0-9]{1,20}")
_NOT_BRACKET = re.compile(rb"[^\[\]{}]++")
_STEP = [1 if byte in b"[{" else -1 if byte in b"]}" else 0 for byte in range(256)]


def crc32c_of(path: Path) -> str:
    """A file's CRC-32C, as GCS keeps it (base64 of the big-endian value)."""
    crc32c = importlib.import_module("google_crc32c")
    value = 0
    with path.open("rb") as stream:
        while chunk := stream.read(8 << 20):
            value = crc32c.extend(value, chunk)
    return encoded(value)


def encoded(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode()


def decoded(value: str) -> int:
    return int.from_bytes(base64.b64decode(value), "big")


def as_json(data: bytes, where: str) -> dict[str, Any]:
    """A JSON answer that is an object, nested no deeper than ``JSON_DEPTH``: its brackets outside its strings are
    counted before it is parsed."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", data))
    if max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) > JSON_DEPTH:
        raise InputError(f"answered with JSON nested deeper than {JSON_DEPTH} levels", path=where)
    try:
        found = json.loads(data) if data else {}
    except ValueError:
        raise InputError("answered with something other than JSON", path=where) from None
    if not isinstance(found, dict):
        raise InputError("answered with JSON that is not an object", path=where)
    return found


def is_count(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a number as the JSON API writes one (a size, a generation, bytes done): a string of at
    most 20 ASCII digits (``str.isdigit`` takes other digits too, which ``int()`` reads or refuses)."""
    return isinstance(value, str) and _COUNT.fullmatch(value) is not None


def is_crc(text: str) -> bool:
    try:
        return len(base64.b64decode(text, validate=True)) == 4
    except ValueError:
        return False


def hashes(header: str) -> dict[str, str]:
    """``X-Goog-Hash`` (``crc32c=...,md5=...``) by kind."""
    found: dict[str, str] = {}
    for part in header.split(","):
        kind, _, value = part.strip().partition("=")
        if kind and value:
            found[kind] = value
    return found
