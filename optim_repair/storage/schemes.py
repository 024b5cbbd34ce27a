"""The scheme table: which store serves a URL (``s3://bucket/prefix/``), and how a run reaches it.

A checkpoint argument with no scheme is a local path, read by ``checkpoint.discovery``; each other scheme is a row
here naming the store module that implements ``interface.WritableStore`` and the extra that brings its client. A
new store is its module and its row.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from optim_repair.errors import UsageError
from optim_repair.storage.interface import WritableStore


@dataclass(frozen=True)
class StoreOptions:
    """How to reach a store: a profile and an endpoint, each None for the client's own choice (the AWS CLI's)."""

    profile: str | None = None
    endpoint_url: str | None = None


@dataclass(frozen=True)
class Scheme:
    """A row of the table: the module whose ``open_store(bucket, options)`` opens a bucket of the store."""

    name: str
    module: str


SCHEMES: dict[str, Scheme] = {
    "s3": Scheme("s3", "optim_repair.storage.s3"),
    "gs": Scheme("gs", "optim_repair.storage.gcs"),
}
"""Every store, by the scheme of its URLs; ``""`` (no scheme) is the local disk."""


@dataclass(frozen=True)
class StoreUrl:
    """An object or a prefix in a bucket of a store."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    @property
    def prefix(self) -> str:
        """The key as a prefix of the objects under it (``step-1000/``; ``""`` for the whole bucket)."""
        return self.key if not self.key or self.key.endswith("/") else f"{self.key}/"

    def object(self, relative: str) -> str:
        """The key of the object ``relative`` under this prefix."""
        return f"{self.prefix}{relative}"

    def named(self, relative: str) -> str:
        """``relative`` under this prefix, as a URL for messages."""
        return f"{self.scheme}://{self.bucket}/{self.object(relative)}"


def scheme_of(text: object) -> str:
    """The scheme of a checkpoint argument: a row of ``SCHEMES``, or ``""`` for a local path (a path object, or a
    string with no scheme the table knows)."""
    if not isinstance(text, str):
        return ""
    scheme, separator, _ = text.partition("://")
    return scheme if separator and scheme in SCHEMES else ""


def is_remote(text: object) -> bool:
    """Whether a checkpoint argument names a store rather than a local path."""
    return scheme_of(text) != ""


def parse_url(text: str) -> StoreUrl:
    """The store URL ``text`` (``SCHEME://BUCKET/KEY``)."""
    scheme = scheme_of(text)
    bucket, _, key = text[len(scheme) + 3 :].partition("/")
    if not scheme or not bucket:
        raise UsageError(f"{text} names no bucket ({scheme or 's3'}://BUCKET/PREFIX/)")
    if key and any(part in ("", ".", "..") for part in key.removesuffix("/").split("/")):
        raise UsageError(
            f"{text} names a key with an empty, '.' or '..' segment, which a store keeps as it is written and this "
            "tool refuses to read back as a path; name the prefix without them"
        )
    return StoreUrl(scheme, bucket, key)


def open_store(url: StoreUrl, options: StoreOptions) -> WritableStore:
    """The store holding ``url``, reached as ``options`` say."""
    module = importlib.import_module(SCHEMES[url.scheme].module)
    store: WritableStore = module.open_store(url.bucket, options)
    return store
