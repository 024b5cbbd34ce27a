"""An Azure container, read (``reading.AzureReader``) and written, never over an object that exists.

Every write names the ETag it expects (``If-None-Match: *`` for a new object, ``If-Match`` the ETag a run wrote for
its own), so that Azure refuses it where another writer got there first. Every object carries its run's id; every
request that sends bytes carries their MD5 (``Content-MD5``), which Azure checks on receipt and answers with. A
copy is Azure's Copy Blob pinned to the ETag read (``x-ms-source-if-match``), waited for where it is not done at
once. A torch file's splice is a block blob of blocks: its new head, the original's kept range copied inside Azure
by Put Block From URL (pinned to the ETag read), its new tail, committed by Put Block List. Azure keeps no checksum
of a copy or of a block list it computed itself, so those are reported as pinned to their source's ETag, not
proven (``pinned``), unless ``--verify download`` reads them back. Where the store does not copy ranges (Azurite
answers Put Block From URL with 501, or 500), the kept range is read (pinned) and sent as blocks, each checked on
receipt.

A write whose answer was lost (it took effect, the transport retried, the retry found the object there) is
resolved by reading the key back: the object carries this run's id, or it is another writer's (``ObjectExists``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from optim_repair.errors import InputError, ObjectExists, OutputError, shown_name
from optim_repair.storage.answers import CHANGED
from optim_repair.storage.azure.credentials import without_queries
from optim_repair.storage.azure.reading import RUN_METADATA, AzureReader
from optim_repair.storage.azure.values import block_id, block_list, md5_of, md5_of_bytes
from optim_repair.storage.interface import Store
from optim_repair.storage.objects import Composed, Copied, StoredObject

SIMPLE_LIMIT = 64 << 20
"""The largest file sent by one request; a larger one is sent as blocks of ``BLOCK``."""
BLOCK = 64 << 20
FROM_URL_BLOCK = 1 << 30
"""The most bytes one Put Block From URL copies (Azure takes up to 4000 MiB)."""
THROUGH_BLOCK = 16 << 20
"""A block of a range read and sent by this run, where the store copies no ranges."""
STALLED_SECONDS = 600.0
"""How long an unfinished copy may make no progress before it is aborted and refused."""


class AzureStore(AzureReader):
    """One Azure container, read and written: what the checkpoint layer's ``WritableStore`` asks of a store."""

    composes_ranges = True
    pinned = "pinned to each source's ETag"
    _copies_ranges = True

    def scratch_keys(self, key: str) -> list[str]:
        """None: a splice's parts are blocks, which no listing shows and the commit of ``key`` discards."""
        return []

    def proven_by_tags(self, original: StoredObject, copied: Copied) -> str | None:
        """Nothing: an ETag says which write made an object, not what it holds."""
        return None

    def _written(self, key: str, write: Callable[[], Copied]) -> Copied:
        """What ``write`` (a request that replaces nothing) wrote at ``key``. Where it finds an object there, the
        object is read back: this run's own (a lost answer's retry found it), or another writer's."""
        try:
            return write()
        except ObjectExists:
            found = self.owner(key)
            if found is None or found[0] != self.run:
                raise ObjectExists("exists: another writer put an object there first", path=self.where(key)) from None
            return Copied(None, found[1].etag)

    def _sent(self, answer: Any, key: str, md5: str | None) -> Copied:
        """What a write's answer says: its ETag, and the MD5 Azure computed of what it received, which must be the
        one sent (``md5``; None where the answer's MD5 is of no object's bytes)."""
        etag = answer.headers.get("ETag")
        self._received(answer, key, md5)
        if not isinstance(etag, str) or not etag:
            raise OutputError("answered a write without an ETag", path=self.where(key))
        return Copied(md5, etag)

    def _received(self, answer: Any, key: str, md5: str | None) -> None:
        """Refuse an answer whose MD5 of what Azure received is not ``md5`` (where one was sent and one is answered:
        Azure refuses a write whose bytes are not the MD5 sent, and Azurite answers a block without it)."""
        echoed = answer.headers.get("Content-MD5")
        answer.close()
        if md5 is not None and echoed is not None and echoed != md5:
            given = shown_name(str(echoed)[:60])
            raise OutputError(f"answered a write with the MD5 {given}, not that of what was sent", path=self.where(key))

    def _put(self, key: str, data: bytes, condition: dict[str, str]) -> Copied:
        md5 = md5_of_bytes(data)
        headers = {"x-ms-blob-type": "BlockBlob", "Content-MD5": md5, f"x-ms-meta-{RUN_METADATA}": self.run}
        answer = self.send("PUT", self.url(key), key, writing=True, data=data, headers={**headers, **condition})
        self.count(written=len(data))
        return self._sent(answer, key, md5)

    def put_bytes(self, key: str, data: bytes) -> Copied:
        """``data`` as the new object ``key``, never over one that exists, checked by its MD5 on receipt."""
        return self._written(key, lambda: self._put(key, data, {"If-None-Match": "*"}))

    def replace_own(self, key: str, data: bytes, etag: str) -> Copied:
        """``data`` over this run's object ``key`` while it is still the ETag ``etag``."""
        return self._put(key, data, {"If-Match": etag})

    def put_file(self, key: str, path: Path, size: int) -> Copied:
        """The file ``path`` as the new object ``key``, never over one that exists: at most ``SIMPLE_LIMIT`` bytes
        by one request, more as blocks, each checked by its MD5 on receipt (the object then carries the file's MD5
        as its Content-MD5, a property Azure does not check: None is answered)."""
        if size <= SIMPLE_LIMIT:
            return self.put_bytes(key, path.read_bytes())
        ids: list[str] = []
        sent = 0
        with path.open("rb") as stream:
            while chunk := stream.read(BLOCK):
                ids.append(self._block(key, len(ids), chunk))
                sent += len(chunk)
        if sent != size:
            raise OutputError(f"an upload's file held {sent:,} bytes, not {size:,}", path=self.where(key))
        return self._written(key, lambda: self._commit(key, ids, {"x-ms-blob-content-md5": md5_of(path)}))

    def _block(self, key: str, index: int, data: bytes) -> str:
        """Stage ``data`` as this run's ``index``-th block of ``key``, checked by its MD5 on receipt; its id."""
        identifier = block_id(self.run, index)
        md5 = md5_of_bytes(data)
        answer = self.send(
            "PUT", self.url(key), key, writing=True, data=data, params={"comp": "block", "blockid": identifier},
            headers={"Content-MD5": md5},
        )  # fmt: skip
        self.count(written=len(data))
        self._received(answer, key, md5)
        return identifier

    def _commit(self, key: str, ids: list[str], headers: dict[str, str]) -> Copied:
        """The blocks ``ids`` committed, in order, as the new object ``key``."""
        sent = {"If-None-Match": "*", f"x-ms-meta-{RUN_METADATA}": self.run, "Content-Type": "application/xml"}
        answer = self.send(
            "PUT", self.url(key), key, writing=True, data=block_list(ids), params={"comp": "blocklist"},
            headers={**sent, **headers},
        )  # fmt: skip
        return self._sent(answer, key, None)

    def copy(self, source: str, stored: StoredObject, target: str, *, source_bucket: str) -> Copied:
        """The ETag ``stored`` of ``source`` (in ``source_bucket``) copied inside Azure to the new ``target``, waited
        for until Azure says it succeeded; pinned to that ETag, not proven by a checksum. Where an object is found
        there, it is this run's copy (a lost answer's retry found it: waited for in turn), or another writer's."""
        try:
            return self._copy(source, stored, target, source_bucket)
        except ObjectExists:
            original = self.sibling(source_bucket)
            if original.head(source).etag != stored.etag:  # a refusal of the pin, not of the no-replace
                raise InputError(CHANGED, path=original.where(source)) from None
            _, _, run, described = self._head(target)
            if run != self.run:
                raise ObjectExists(
                    "exists: another writer put an object there first", path=self.where(target)
                ) from None
            written = self._waited(target, str(described.headers.get("x-ms-copy-id", "")), stored.size)
            self.count(copied=stored.size)
            return written

    def _copy(self, source: str, stored: StoredObject, target: str, source_bucket: str) -> Copied:
        url, _ = self.access.source(self.url(source, container=source_bucket))  # inside the account: a SAS, or
        # the request's own Azure AD token, authorizes the source (an asynchronous copy takes no source token)
        answer = self.send(
            "PUT", self.url(target), target, writing=True,
            headers={"x-ms-copy-source": url, "x-ms-source-if-match": stored.etag, "If-None-Match": "*",
                     f"x-ms-meta-{RUN_METADATA}": self.run},
        )  # fmt: skip
        answer.close()
        copy_id, status = answer.headers.get("x-ms-copy-id"), answer.headers.get("x-ms-copy-status")
        if not isinstance(copy_id, str) or not copy_id or status not in ("success", "pending"):
            raise OutputError("answered a copy without its id and a status", path=self.where(target))
        written = self._waited(target, copy_id, stored.size)
        self.count(copied=stored.size)
        return written

    def _waited(self, target: str, copy_id: str, size: int) -> Copied:
        """The copy ``copy_id`` into ``target`` once Azure says it succeeded: one that failed, or made no progress
        for ``STALLED_SECONDS`` (then aborted), is refused, as is a copy of another size."""
        pause, progress, since = 0.0, "", time.monotonic()
        while True:
            answer = self.send("HEAD", self.url(target), target, writing=True)
            answer.close()
            stored, _, _ = self.properties(answer, target)
            if answer.headers.get("x-ms-copy-id") != copy_id:
                raise OutputError("holds another copy than the one started", path=self.where(target))
            status = answer.headers.get("x-ms-copy-status")
            if status == "success":
                if stored.size != size:
                    raise OutputError(f"holds {stored.size:,} bytes once copied, not {size:,}", path=self.where(target))
                return Copied(None, stored.etag)
            if status != "pending":
                described = str(answer.headers.get("x-ms-copy-status-description", status))
                reason = without_queries(shown_name(described[:200]))
                raise OutputError(f"the store's copy ended {shown_name(str(status))[:20]} ({reason})",
                                  path=self.where(target))  # fmt: skip
            now = str(answer.headers.get("x-ms-copy-progress", ""))
            if now != progress:
                progress, since = now, time.monotonic()
            elif time.monotonic() - since > STALLED_SECONDS:
                self.send("PUT", self.url(target), target, writing=True, accept=(409,),
                          params={"comp": "copy", "copyid": copy_id},
                          headers={"x-ms-copy-action": "abort"}).close()  # fmt: skip
                raise OutputError(f"its copy made no progress for {STALLED_SECONDS:.0f} s", path=self.where(target))
            pause = min(5.0, pause + 0.25)
            time.sleep(pause)

    def compose(
        self,
        key: str,
        head: bytes,
        original: tuple[Store, str, StoredObject],
        kept: tuple[int, int],
        tail: bytes,
        original_checksum: str | None,
    ) -> Composed:
        """The new object ``key``: ``head``, bytes ``kept`` of the ``original`` (its store, key and ETag) copied
        inside Azure by Put Block From URL pinned to that ETag, then ``tail``, committed as one block list. Azure
        keeps no checksum to derive: the result is pinned, not proven (``expected`` None)."""
        holder, source, stored = original
        try:
            return self._composed(key, head, (holder, source, stored), kept, tail)
        except InputError as exc:
            if exc.reason != CHANGED:
                raise
            raise InputError(CHANGED, path=holder.where(source)) from None  # the pin of the original refused

    def _composed(
        self, key: str, head: bytes, original: tuple[Store, str, StoredObject], kept: tuple[int, int], tail: bytes
    ) -> Composed:
        holder, source, stored = original
        ids: list[str] = []
        if head:
            ids.append(self._block(key, len(ids), head))
        for start in range(kept[0], kept[1], FROM_URL_BLOCK):
            end = min(start + FROM_URL_BLOCK, kept[1])
            if not (self._copies_ranges and self._block_from_url(key, len(ids), holder.bucket, source, stored,
                                                                   (start, end), ids)):  # fmt: skip
                for piece in range(start, end, THROUGH_BLOCK):
                    data = holder.get_range(source, stored, piece, min(piece + THROUGH_BLOCK, end))
                    ids.append(self._block(key, len(ids), data))
        if tail:
            ids.append(self._block(key, len(ids), tail))
        return Composed(self._written(key, lambda: self._commit(key, ids, {})), None)

    def _block_from_url(
        self, key: str, index: int, bucket: str, source: str, stored: StoredObject, span: tuple[int, int],
        ids: list[str],
    ) -> bool:  # fmt: skip
        """Stage bytes ``span`` of ``source`` as the ``index``-th block of ``key``, copied inside Azure pinned to
        the ETag ``stored``; False where the store copies no ranges (it answers 501, or, as Azurite does to a SAS,
        500 without an error code; sent once, not retried), which it is not asked again."""
        identifier = block_id(self.run, index)
        url, headers = self.access.source(self.url(source, container=bucket))
        answer = self.send(
            "PUT", self.url(key), key, writing=True, accept=(500, 501), retried=False,
            params={"comp": "block", "blockid": identifier},
            headers={"x-ms-copy-source": url, "x-ms-source-range": f"bytes={span[0]}-{span[1] - 1}",
                     "x-ms-source-if-match": stored.etag, "Content-Length": "0", **headers},
        )  # fmt: skip
        answer.close()
        if answer.status_code == 501 or (answer.status_code == 500 and "x-ms-error-code" not in answer.headers):
            self._copies_ranges = False
            return False
        if answer.status_code == 500:
            raise self.failure(answer, key, True)
        if answer.status_code != 201:
            raise OutputError(f"answered a copy of a range with HTTP {answer.status_code}", path=self.where(key))
        self.count(copied=span[1] - span[0])
        ids.append(identifier)
        return True

    def abort_uploads(self, prefix: str, *, exact: bool = False) -> int:
        """None to abort: blocks a stopped run staged are no object, show in no listing, and are discarded by the
        next commit at their key, or after a week."""
        return 0

    def delete_own(self, key: str, etag: str) -> None:
        """Delete ``key`` if it is still the ETag ``etag``; one replaced since, or gone, is left as it is."""
        try:
            self.send("DELETE", self.url(key), key, writing=True, headers={"If-Match": etag}).close()
        except ObjectExists:  # 412: another writer's object now
            return
        except InputError as exc:
            if "no such object" not in exc.reason and exc.reason != CHANGED:
                raise

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (what the user allowed replacing) with their snapshots, ``WORKERS`` at a time."""

        def remove(key: str) -> None:
            self.send("DELETE", self.url(key), key, writing=True, headers={"x-ms-delete-snapshots": "include"}).close()

        for _ in self.each(remove, list(keys)):
            pass
