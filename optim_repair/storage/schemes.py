"""The scheme table: which store serves a URL (``s3://bucket/prefix/``), and how a run reaches it.

A checkpoint argument with no scheme is a local path, read by ``checkpoint.discovery``; each other scheme is a row
here naming the store module that implements ``interface.WritableStore`` and the extra that brings its client. A
new store is its module and its row.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, replace
from typing import TypedDict

from optim_repair.errors import UsageError
from optim_repair.storage.interface import WritableStore


@dataclass(frozen=True)
class StoreOptions:
    """How to reach a store: a profile, an endpoint and an account, each None for the client's own choice (the AWS
    CLI's; Azure's connection string)."""

    profile: str | None = None
    endpoint_url: str | None = None
    account: str | None = None
    """An Azure storage account (``--account``, or the one an ``https://ACCOUNT.blob...`` URL names)."""


class StoreArgs(TypedDict, total=False):
    """``StoreOptions`` as the keyword arguments the library's functions take (``profile=``, ``endpoint_url=``,
    ``account=``)."""

    profile: str | None
    endpoint_url: str | None
    account: str | None


@dataclass(frozen=True)
class Scheme:
    """A row of the table: the store's name, and the module whose ``open_store(bucket, options)`` opens a bucket
    of it."""

    name: str
    module: str


_AZURE = Scheme("az", "optim_repair.storage.azure")
SCHEMES: dict[str, Scheme] = {
    "s3": Scheme("s3", "optim_repair.storage.s3"),
    "gs": Scheme("gs", "optim_repair.storage.gcs"),
    "az": _AZURE,
    "abfs": _AZURE,
    "abfss": _AZURE,
    "https": _AZURE,
}
"""Every store, by each spelling of its URLs' scheme (``abfs://`` as fsspec spells Azure's; ``https://`` only at
``ACCOUNT.blob.core.windows.net``); ``""`` (no scheme) is the local disk."""
_AZURE_HOST = re.compile(r"([a-z0-9]{3,24})\.blob\.core\.windows\.net")
_ABFS_NETLOC = re.compile(r"([^@/]+)@([a-z0-9]{3,24})\.dfs\.core\.windows\.net")


@dataclass(frozen=True)
class StoreUrl:
    """An object or a prefix in a bucket (an Azure container) of a store."""

    scheme: str
    """The store's name (``s3``, ``gs``, ``az``), whichever spelling named it."""
    bucket: str
    key: str
    account: str | None = None
    """The Azure storage account the URL names (``https://ACCOUNT.blob...``, ``abfs://C@ACCOUNT.dfs...``)."""

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
    scheme, separator, rest = text.partition("://")
    if scheme == "https" and not _AZURE_HOST.fullmatch(rest.partition("/")[0]):
        return ""
    return scheme if separator and scheme in SCHEMES else ""


def is_remote(text: object) -> bool:
    """Whether a checkpoint argument names a store rather than a local path."""
    return scheme_of(text) != ""


def parse_url(text: str) -> StoreUrl:
    """The store URL ``text`` (``SCHEME://BUCKET/KEY``; for Azure also ``https://ACCOUNT.blob.core.windows.net/
    CONTAINER/KEY`` and ``abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/KEY``)."""
    scheme = scheme_of(text)
    bucket, _, key = text[len(scheme) + 3 :].partition("/")
    account = None
    if scheme == "https":
        account = bucket.partition(".")[0]
        bucket, _, key = key.partition("/")
    elif scheme in ("abfs", "abfss") and "@" in bucket:
        matched = _ABFS_NETLOC.fullmatch(bucket)
        if matched is None:
            raise UsageError(
                f"{text} names no container and account ({scheme}://CONTAINER@ACCOUNT.dfs.core.windows.net/)"
            )
        bucket, account = matched.groups()
    if not scheme or not bucket:
        raise UsageError(f"{text} names no bucket ({scheme or 's3'}://BUCKET/PREFIX/)")
    if key and any(part in ("", ".", "..") for part in key.removesuffix("/").split("/")):
        raise UsageError(
            f"{text} names a key with an empty, '.' or '..' segment, which a store keeps as it is written and this "
            "tool refuses to read back as a path; name the prefix without them"
        )
    return StoreUrl(SCHEMES[scheme].name, bucket, key, account)


def open_store(url: StoreUrl, options: StoreOptions) -> WritableStore:
    """The store holding ``url``, reached as ``options`` say (and at the account ``url`` names)."""
    if url.account is not None:
        if options.account not in (None, url.account):
            raise UsageError(f"{url} lies in the account {url.account}, not the --account {options.account}")
        options = replace(options, account=url.account)
    module = importlib.import_module(SCHEMES[url.scheme].module)
    store: WritableStore = module.open_store(url.bucket, options)
    return store
