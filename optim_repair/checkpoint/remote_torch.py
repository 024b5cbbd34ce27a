"""Repairing a torch file inside a store: its new pickle uploaded, every other record copied there, byte for byte.

The repaired file is spliced (``formats.torchfile.splice``): a new pickle record, the original's bytes from its
second record to its central directory, the new storages and a new central directory. It is proven before a
byte is written, as a local copy is, by reading it back through a file joined from the new head and tail and
the original's kept range (read by ranges as the proof needs them): its graph, framing and new storages, every
original storage found where it was kept. The store then composes it (``storage.compose``), and its CRC-32,
derived from the original's, proves the kept bytes unchanged; ``read_back`` reads them back instead.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from optim_repair.checkpoint.adapters import PlannedTorchFile
from optim_repair.checkpoint.remote_reading import RemoteCheckpoint
from optim_repair.errors import Remedy, UsageError, VerificationError
from optim_repair.formats.pickle_writing import dump_graph
from optim_repair.formats.pickled import load_graph
from optim_repair.formats.ranges import Joined
from optim_repair.formats.torchfile.splice import Splice, splice
from optim_repair.formats.torchfile.verifier import verify_torch_file
from optim_repair.formats.torchfile.writer import edited_root
from optim_repair.formats.torchfile.zipformat import ZipTorchFile
from optim_repair.records.verification import Verification
from optim_repair.storage.compose import compose
from optim_repair.storage.objects import Copied
from optim_repair.storage.s3 import S3Store

_CHUNK = 8 << 20


@dataclass(frozen=True)
class PreparedSplice:
    """A torch file's repaired copy, spliced and proven, not yet written: its new head and tail (in a local
    scratch file) around the original's kept range, and the proof of the whole."""

    remote: RemoteCheckpoint
    name: str
    made: Splice
    scratch: Path
    proven: Verification

    def joined(self) -> BinaryIO:
        """The spliced file: the new head, the original's kept range (read by ranges), the new tail."""
        made, original = self.made, self.remote.opener(self.name)
        parts = [(self.scratch.open("rb"), 0, made.head), (original(), made.start, made.end - made.start)]
        return io.BufferedReader(Joined([*parts, (self.scratch.open("rb"), made.tail_at, made.tail)]))

    def write(self, store: S3Store, new_key: str, *, read_back: bool) -> Copied:
        """Compose it as the new object ``new_key`` of ``store`` and prove it there, as the module says."""
        made, remote = self.made, self.remote
        key, stored = remote.url.object(self.name) if self.name else remote.url.key, remote.listing[self.name]
        with self.scratch.open("rb") as stream:
            head = stream.read(made.head)
            stream.seek(made.tail_at)
            tail = stream.read(made.tail)
        composed = compose(store, new_key, head, (remote.store, key, stored), (made.start, made.end), tail,
                           remote.store.checksum(key).crc32)  # fmt: skip
        where = store.where(new_key)
        if read_back:
            _read_back(store, new_key, self.joined, where)
        elif composed.expected is None or composed.written.crc32 is None:
            remedy = Remedy("verify", "download", note=", to read it back")
            raise VerificationError("the store gives no CRC32 to prove the spliced copy by", path=where, remedy=remedy)
        elif composed.written.crc32 != composed.expected:
            raise VerificationError("its CRC32 is not the one its parts give", path=where)
        return composed.written


def prepare_splice(remote: RemoteCheckpoint, name: str, planned: PlannedTorchFile, scratch: Path) -> PreparedSplice:
    """Splice the repaired copy of the torch file ``name`` of ``remote`` and prove it, before anything is written
    to the store; ``scratch`` is a new local file for its head and tail. A repair that drops state is refused."""
    torch_file, source = planned.original, planned.source
    assert isinstance(torch_file, ZipTorchFile)  # a store's legacy-format files are not read
    root, created = edited_root(torch_file, planned.additions, planned.changes)
    data = dump_graph(root)
    if set(torch_file.graph.storages) - set(load_graph(data, source, ours=True).storages):
        raise UsageError(f"{source}: dropping state from a torch file in a store is done into a local copy")
    original = remote.opener(name)  # what reading fetched of it is not fetched again
    with original() as stream, zipfile.ZipFile(stream) as archive:
        directory_at = archive.start_dir
    with scratch.open("w+b") as written:
        made = splice(torch_file, directory_at, data, created, written.fileno(), source)
    prepared = PreparedSplice(remote, name, made, scratch, Verification(0, 0))
    proven = verify_torch_file(
        Path(source), Path(source), source, planned.additions, changes=planned.changes, parsed=torch_file,
        openers=(original, prepared.joined), kept=(made.start, made.end, made.moved),
    )  # fmt: skip
    return replace(prepared, proven=proven)


def _read_back(store: S3Store, key: str, copy: Callable[[], BinaryIO], where: str) -> None:
    """The new object, read back in chunks, holds the bytes of the joined file ``copy`` opens."""
    stored = store.head(key)
    with copy() as expected:
        size = expected.seek(0, 2)
        if stored.size != size:
            raise VerificationError(f"holds {stored.size} bytes, not {size}", path=where)
        expected.seek(0)
        for start in range(0, size, _CHUNK):
            end = min(start + _CHUNK, size)
            if store.get_range(key, stored, start, end) != expected.read(end - start):
                raise VerificationError("its bytes are not those of the spliced copy", path=where)
