"""What the checkpoint layer asks of a store: ``Store`` to read a bucket's objects, ``WritableStore`` to write one.

One interface per axis, as torch's ``FileSystemBase`` and fsspec's ``AbstractFileSystem`` are: the checkpoint
layer names these protocols, never a store's class, and a store is one module that implements them and a row of
``schemes.SCHEMES``. Every name a store lists is checked where it is listed (``names.checked_name``), every answer
is judged before it is believed (``answers``), and a read names the version it read, so that an object replaced
meanwhile is refused, never mixed with its old bytes.

A store's staging (where a repaired copy is written) is the store itself under a ``claim.Claim``: writes that never
replace an object (``put_file``, ``put_bytes``, ``copy``, ``compose``), a commit (``Claim.commit``) and an abort
that deletes only what this run wrote (``Claim.undo``, ``delete_own``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

from optim_repair.records.traffic import Traffic
from optim_repair.storage.objects import Composed, Copied, Small, StoredObject

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


class Store(Protocol):
    """One bucket (or container) of a store, read: listed with sizes and version tags, read by byte ranges."""

    bucket: str
    run: str
    """This run's id, which every object it writes carries."""
    proof: str
    """The checksum the store keeps of each whole object, as a report names it (``S3 CRC32``, ``GCS CRC32C``)."""

    def file_checksum(self, path: Path) -> str:
        """The checksum (``proof``) the store keeps of an object holding the bytes of the file ``path``."""

    def traffic(self) -> Traffic:
        """The requests sent and bytes moved so far, by this store and its siblings."""

    def where(self, key: str) -> str:
        """The object ``key`` as a URL, for messages (never with credentials)."""

    def listing(self, prefix: str, *, children: bool = False) -> dict[str, StoredObject]:
        """Every object under ``prefix`` (``children``: only those directly in it), by its checked name relative to
        it; a listing that repeats itself, names a key outside ``prefix``, or never ends is refused."""

    def tail(self, key: str, length: int) -> tuple[StoredObject, bytes]:
        """The last ``length`` bytes of ``key`` (all of it, if shorter) by one request, with its size and version."""

    def head(self, key: str) -> StoredObject:
        """The size and version of ``key``."""

    def get_range(self, key: str, stored: StoredObject, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of the version ``stored`` of ``key``: exactly those, or an error."""

    def ranges(
        self, key: str, stored: StoredObject, wanted: Sequence[tuple[int, int]], *, gap: int = ...
    ) -> list[bytes]:
        """The bytes of each ``(offset, length)`` of ``key``, in the order asked: ranges closer than ``gap`` by one
        request."""

    def download(self, key: str, stored: StoredObject, target: BinaryIO) -> None:
        """The whole version ``stored`` of ``key`` into ``target``, checked against the store's checksum of it."""

    def checksum(self, key: str) -> Copied:
        """The checksum the store keeps of the whole object ``key`` (None without one), and its version."""

    def owner(self, key: str) -> tuple[str | None, Copied] | None:
        """The run that wrote ``key`` (None when no run did) and its checksum; None when there is no such object."""

    def read_small(self, key: str, limit: int) -> Small | None:
        """The object ``key`` whole, when it holds at most ``limit`` bytes, with its writer and age; None without."""

    def identical(self, key: str, stored: StoredObject, other: str, source: Store) -> bool:
        """Whether this store's ``other`` holds the bytes of ``source``'s ``key`` (as listed), both read back."""

    def each(self, work: Callable[[_Item], _Result], items: Sequence[_Item]) -> Generator[_Result, None, None]:
        """``work`` of each item, several at a time, in the order given; closed early, it starts no more."""


class WritableStore(Store, Protocol):
    """A store written into, never over an object that exists; every object written carries this run's id."""

    composes_ranges: bool
    """Whether ``compose`` takes a range of the original after new bytes (S3's multipart copy); where not (GCS's
    compose takes whole objects), a splice must keep the whole original and append to it."""

    pinned: str | None
    """Where the store proves no copy it makes by a checksum (Azure keeps none of a copy), how a report names its
    copies: made pinned to their source's version tag, not proven; None where every copy is proven."""

    def scratch_keys(self, key: str) -> list[str]:
        """Keys besides ``key`` that a ``compose`` of ``key`` may write and deletes once done: a run's claim lists
        them, so that what a stopped run left there is removed by the next."""

    def proven_by_tags(self, original: StoredObject, copied: Copied) -> str | None:
        """How a copy is proven the original's by version tags alone, where the store keeps no checksum of either
        (``S3 ETag (MD5)`` for an object stored in one part); None where they prove nothing."""

    def sibling(self, bucket: str) -> WritableStore:
        """The store of ``bucket`` through the same client, counted with this one, as the same run."""

    def put_file(self, key: str, path: Path, size: int) -> Copied:
        """The file ``path`` as the new object ``key``, checked by the store on receipt."""

    def put_bytes(self, key: str, data: bytes) -> Copied:
        """``data`` as the new object ``key``, checked by the store on receipt."""

    def replace_own(self, key: str, data: bytes, etag: str) -> Copied:
        """``data`` over this run's object ``key`` while it is still the version ``etag``."""

    def copy(self, source: str, stored: StoredObject, target: str, *, source_bucket: str) -> Copied:
        """The version ``stored`` of ``source`` (in ``source_bucket``) copied inside the store to the new ``target``."""

    def compose(
        self,
        key: str,
        head: bytes,
        original: tuple[Store, str, StoredObject],
        kept: tuple[int, int],
        tail: bytes,
        original_checksum: str | None,
    ) -> Composed:
        """The new object ``key``: ``head``, bytes ``kept`` of the ``original`` (its store, key and version) copied
        inside the store, then ``tail``; with the checksum it must have. Where the store does not
        ``composes_ranges``, ``head`` must be empty and ``kept`` the whole original."""

    def abort_uploads(self, prefix: str, *, exact: bool = False) -> int:
        """Abort the unfinished uploads a stopped run left under ``prefix`` (``exact``: at that key); how many."""

    def delete_own(self, key: str, etag: str) -> None:
        """Delete ``key`` while it is still the version ``etag`` (one this run, or a stopped run, wrote)."""

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``: what the user allowed replacing (``--force``)."""
