"""A GCS bucket, read (``reading.GcsReader``) and written, never over an object that exists.

Every write names the generation it expects (``ifGenerationMatch=0`` for a new object, the generation a run wrote
for its own), so that GCS refuses it where another writer got there first. Every object carries its run's id and
the CRC-32C of what was sent, which GCS checks on receipt; the CRC-32C it answers with is compared too. A copy is a
rewrite pinned to the generation read (``ifSourceGenerationMatch``), repeated with its token until done. A torch
file's splice is the whole original followed by a tail (GCS composes whole objects only, at most 32): the tail is
uploaded to the new key itself, then composed after the original into that key, pinned to both generations. Its
CRC-32C follows from the original's and the tail's (``crc.combine``) and must be the one GCS computed.

A write whose answer was lost (it took effect, the transport retried, the retry found the object there) is
resolved by reading the key back: the object carries this run's id, or it is another writer's (``ObjectExists``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import urllib.parse
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from optim_repair.errors import InputError, ObjectExists, OutputError, shown_name
from optim_repair.storage import crc
from optim_repair.storage.answers import CHANGED, WHOLE_ANSWER_BYTES
from optim_repair.storage.gcs.reading import RUN_METADATA, GcsReader
from optim_repair.storage.gcs.values import as_json, crc32c_of, decoded, encoded, is_count
from optim_repair.storage.interface import Store
from optim_repair.storage.objects import Composed, Copied, StoredObject

SIMPLE_LIMIT = 16 << 20
"""The largest file sent in one request; a larger one is sent by a resumable upload in parts of ``PART``."""
PART = 64 << 20
"""A resumable upload's part: a multiple of 256 KiB, as GCS asks."""
REWRITE_ROUNDS = 10_000
"""The most rounds a rewrite may take (GCS copies about a gigabyte a round): a store that never says done is
refused past it."""
SCRATCH = ".optim-repair-part"
"""Beside a composed object's key: the original copied into the output's bucket, where it lies in another."""


class GcsStore(GcsReader):
    """One GCS bucket, read and written: what the checkpoint layer's ``WritableStore`` asks of a store."""

    composes_ranges = False
    pinned = None

    def scratch_keys(self, key: str) -> list[str]:
        return [f"{key}{SCRATCH}"]

    def proven_by_tags(self, original: StoredObject, copied: Copied) -> str | None:
        """Nothing: a generation says when an object was written, not what it holds."""
        return None

    def _written(self, key: str, write: Callable[[], dict[str, Any]]) -> Copied:
        """What ``write`` (a request that replaces nothing) wrote at ``key``. Where it finds an object there, the
        object is read back: this run's own (a lost answer's retry found it), or another writer's."""
        try:
            return self._wrote(write(), key)
        except ObjectExists:
            found = self.owner(key)
            if found is None or found[0] != self.run:
                raise ObjectExists("exists: another writer put an object there first", path=self.where(key)) from None
            return found[1]

    def _wrote(self, resource: dict[str, Any], key: str) -> Copied:
        """What a write's answer says of the object it wrote, which must be ``key`` in this bucket."""
        if resource.get("name") != key or resource.get("bucket", self.bucket) != self.bucket:
            named = shown_name(f"{resource.get('bucket')}/{resource.get('name')}"[:300])
            raise OutputError(f"answered a write with another object ({named})", path=self.where(key))
        return self.stored(resource, key)[1]

    def _resource(self, key: str, checksum: str) -> dict[str, Any]:
        return {"name": key, "crc32c": checksum, "metadata": {RUN_METADATA: self.run}}

    def _upload(self, key: str, data: bytes, generation: str) -> dict[str, Any]:
        """``data`` as ``key`` where its generation is ``generation`` (``0``: where there is none), by one
        multipart upload carrying its CRC-32C."""
        boundary = uuid.uuid4().hex
        resource = json.dumps(self._resource(key, encoded(importlib.import_module("google_crc32c").value(data))))
        body = b"".join([
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{resource}\r\n".encode(),
            f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(), data,
            f"\r\n--{boundary}--\r\n".encode(),
        ])  # fmt: skip
        answer = self.resource(
            "POST", self.url(upload=True), key, writing=True, data=body,
            params={"uploadType": "multipart", "ifGenerationMatch": generation},
            headers={"Content-Type": f"multipart/related; boundary={boundary}"},
        )  # fmt: skip
        self.count(written=len(data))
        return answer

    def put_bytes(self, key: str, data: bytes) -> Copied:
        """``data`` as the new object ``key``, never over one that exists, with its CRC-32C."""
        return self._written(key, lambda: self._upload(key, data, "0"))

    def replace_own(self, key: str, data: bytes, etag: str) -> Copied:
        """``data`` over this run's object ``key`` while it is still the generation ``etag``."""
        return self._wrote(self._upload(key, data, etag), key)

    def put_file(self, key: str, path: Path, size: int) -> Copied:
        """The file ``path`` as the new object ``key``, never over one that exists: at most ``SIMPLE_LIMIT`` bytes
        by one request, more by a resumable upload; GCS checks the CRC-32C sent with it once the last byte is in."""
        if size <= SIMPLE_LIMIT:
            return self.put_bytes(key, path.read_bytes())
        return self._written(key, lambda: self._resumable(key, path, size))

    def _resumable(self, key: str, path: Path, size: int) -> dict[str, Any]:
        started = self.send(
            "POST", self.url(upload=True), key, writing=True, json=self._resource(key, crc32c_of(path)),
            params={"uploadType": "resumable", "ifGenerationMatch": "0"},
            headers={"X-Upload-Content-Length": str(size)},
        )  # fmt: skip
        started.close()
        session = started.headers.get("Location", "")
        if urllib.parse.urlsplit(session)[:2] != urllib.parse.urlsplit(self.base)[:2]:
            raise OutputError(
                f"answered an upload with a session at another address ({shown_name(session[:200])})",
                path=self.where(key),
            )
        with path.open("rb") as stream:
            for start in range(0, size, PART):
                chunk = stream.read(min(PART, size - start))
                last = start + len(chunk) - 1
                answer = self.send(
                    "PUT",
                    session,
                    key,
                    writing=True,
                    accept=(308,),  # "Resume Incomplete": a part taken, no redirect
                    data=chunk,
                    headers={"Content-Range": f"bytes {start}-{last}/{size}"},
                )
                self.count(written=len(chunk))
                if last + 1 < size:
                    answer.close()
                    if answer.status_code != 308 or answer.headers.get("Range") != f"bytes=0-{last}":
                        raise OutputError(
                            f"answered part {start:,}-{last:,} of an upload with HTTP {answer.status_code} "
                            f"({shown_name(answer.headers.get('Range', 'no range'))}), not 308 and all of it",
                            path=self.where(key),
                        )
                elif answer.status_code not in (200, 201):
                    answer.close()
                    raise OutputError(f"ended an upload with HTTP {answer.status_code}", path=self.where(key))
                else:
                    return as_json(self.body(answer, key, WHOLE_ANSWER_BYTES), self.where(key))
        raise OutputError("an upload's file ended before its size", path=self.where(key))

    def copy(self, source: str, stored: StoredObject, target: str, *, source_bucket: str) -> Copied:
        """The generation ``stored`` of ``source`` (in ``source_bucket``) rewritten inside GCS to the new ``target``,
        round after round until GCS says done; its CRC-32C is computed by GCS."""
        try:
            return self._written(target, lambda: self._rewrite(source, stored, target, source_bucket))
        except ObjectExists:
            original = self.sibling(source_bucket)
            if original.head(source).etag != stored.etag:  # a 412 of the pin, not of the no-replace
                raise InputError(CHANGED, path=original.where(source)) from None
            raise

    def _rewrite(self, source: str, stored: StoredObject, target: str, source_bucket: str) -> dict[str, Any]:
        url = f"{self.url(source, bucket=source_bucket)}/rewriteTo/b/{urllib.parse.quote(self.bucket, safe='')}/o/"
        url += urllib.parse.quote(target, safe="")
        params = {"ifGenerationMatch": "0", "ifSourceGenerationMatch": stored.etag, "sourceGeneration": stored.etag}
        done_before, tokens = 0, set()
        for _ in range(REWRITE_ROUNDS):
            answer = self.resource(
                "POST", url, target, writing=True, params=params, json={"metadata": {RUN_METADATA: self.run}}
            )
            done, total = answer.get("totalBytesRewritten"), answer.get("objectSize")
            if not (is_count(done) and total == str(stored.size)):
                raise OutputError(
                    "answered a rewrite without its progress and the object's size", path=self.where(target)
                )
            if not done_before <= int(done) <= stored.size:
                raise OutputError(f"answered a rewrite with {done} bytes done of {total}", path=self.where(target))
            self.count(copied=int(done) - done_before)
            done_before = int(done)
            if answer.get("done") is True:
                resource = answer.get("resource")
                if not isinstance(resource, dict) or resource.get("name") != target or int(done) != stored.size:
                    raise OutputError(
                        "answered a finished rewrite without the object it wrote", path=self.where(target)
                    )
                return resource
            token = answer.get("rewriteToken")
            if not isinstance(token, str) or not token or token in tokens:
                raise OutputError("answered an unfinished rewrite without a new token", path=self.where(target))
            tokens.add(token)
            params = {**params, "rewriteToken": token}
        raise OutputError(f"never finished a rewrite in {REWRITE_ROUNDS:,} rounds", path=self.where(target))

    def compose(
        self,
        key: str,
        head: bytes,
        original: tuple[Store, str, StoredObject],
        kept: tuple[int, int],
        tail: bytes,
        original_checksum: str | None,
    ) -> Composed:
        """The new object ``key``: the whole ``original`` (its store, key and generation) then ``tail``, composed
        inside GCS. The tail is uploaded to ``key`` first (alone, no zip reader takes it for an archive), then the
        original and it are composed into ``key``, each pinned to its generation; an original in another bucket is
        first rewritten beside it (``scratch_keys``), and that copy deleted once composed."""
        holder, source, stored = original
        if head or kept != (0, stored.size):
            raise ValueError("GCS composes whole objects: the original whole, then new bytes")
        with contextlib.ExitStack() as scratch:
            first = (source, stored.etag)
            if holder.bucket != self.bucket:
                part = self.scratch_keys(key)[0]
                copied = self.copy(source, stored, part, source_bucket=holder.bucket)
                scratch.callback(self.delete_own, part, copied.etag)
                first = (part, copied.etag)
            alone = self.put_bytes(key, tail)
            sources = [
                {"name": name, "generation": generation, "objectPreconditions": {"ifGenerationMatch": generation}}
                for name, generation in (first, (key, alone.etag))
            ]
            body = {"sourceObjects": sources, "destination": {"metadata": {RUN_METADATA: self.run}}}
            try:
                resource = self.resource(
                    "POST", f"{self.url(key)}/compose", key, writing=True, json=body,
                    params={"ifGenerationMatch": alone.etag},
                )  # fmt: skip
                written = self._wrote(resource, key)
            except ObjectExists:  # the answer lost, and its retry found the composed object: this run's own?
                found = self.owner(key)
                if found is None or found[0] != self.run or found[1].etag == alone.etag:
                    raise
                written = found[1]
            self.count(copied=stored.size)
        expected = None
        if original_checksum is not None:
            tail_crc = importlib.import_module("google_crc32c").value(tail)
            expected = encoded(crc.combine(decoded(original_checksum), tail_crc, len(tail), crc.CRC32C))
        return Composed(written, expected)

    def abort_uploads(self, prefix: str, *, exact: bool = False) -> int:
        """None to abort: GCS lists no unfinished resumable uploads; one a stopped run left is no object, holds
        nothing a listing shows, and expires after a week."""
        return 0

    def delete_own(self, key: str, etag: str) -> None:
        """Delete ``key`` if it is still the generation ``etag``; one replaced since, or gone, is left as it is."""
        try:
            self.send("DELETE", self.url(key), key, writing=True, params={"ifGenerationMatch": etag}).close()
        except ObjectExists:  # 412: another writer's object now
            return
        except InputError as exc:
            if "no such object" not in exc.reason:
                raise

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (what the user allowed replacing), ``WORKERS`` at a time."""
        for _ in self.each(lambda key: self.send("DELETE", self.url(key), key, writing=True).close(), list(keys)):
            pass
