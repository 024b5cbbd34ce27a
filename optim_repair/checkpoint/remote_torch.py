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
from pathlib import Path
from typing import BinaryIO

from optim_repair.checkpoint.adapters import PlannedTorchFile
from optim_repair.checkpoint.remote_reading import RemoteCheckpoint
from optim_repair.errors import Remedy, UsageError, VerificationError
from optim_repair.formats.pickle_writing import dump_graph
from optim_repair.formats.pickled import load_graph
from optim_repair.formats.ranges import Joined
from optim_repair.formats.torchfile.splice import splice
from optim_repair.formats.torchfile.verifier import verify_torch_file
from optim_repair.formats.torchfile.writer import edited_root
from optim_repair.formats.torchfile.zipformat import ZipTorchFile
from optim_repair.records.verification import Verification
from optim_repair.storage.compose import compose
from optim_repair.storage.s3 import S3Store

_CHUNK = 8 << 20


def spliced_copy(
    remote: RemoteCheckpoint, name: str, planned: PlannedTorchFile, target: tuple[S3Store, str], scratch: Path,
    *, read_back: bool,
) -> Verification:  # fmt: skip
    """Write the repaired copy of the torch file ``name`` of ``remote`` as the new object ``target`` (its store and
    key), proven as the module says; ``scratch`` is a new local file for its head and tail."""
    torch_file, source = planned.original, planned.source
    assert isinstance(torch_file, ZipTorchFile)  # a store's legacy-format files are not read
    root, created = edited_root(torch_file, planned.additions, planned.changes)
    data = dump_graph(root)
    if set(torch_file.graph.storages) - set(load_graph(data, source, ours=True).storages):
        raise UsageError(f"{source}: dropping state from a torch file in a store is done into a local copy")
    key, stored = remote.url.object(name) if name else remote.url.key, remote.listing[name]
    original = remote.opener(name)  # what reading fetched of it is not fetched again
    with original() as stream, zipfile.ZipFile(stream) as archive:
        directory_at = archive.start_dir
    with scratch.open("w+b") as written:
        made = splice(torch_file, directory_at, data, created, written.fileno(), source)

    def copy() -> BinaryIO:
        parts = [(scratch.open("rb"), 0, made.head), (original(), made.start, made.end - made.start)]
        return io.BufferedReader(Joined([*parts, (scratch.open("rb"), made.tail_at, made.tail)]))  # whole reads

    proven = verify_torch_file(
        Path(source), Path(source), source, planned.additions, changes=planned.changes, parsed=torch_file,
        openers=(original, copy), kept=(made.start, made.end, made.moved),
    )  # fmt: skip
    with scratch.open("rb") as stream:
        head = stream.read(made.head)
        stream.seek(made.tail_at)
        tail = stream.read(made.tail)
    store, new_key = target
    composed = compose(store, new_key, head, (remote.store, key, stored), (made.start, made.end), tail,
                       remote.store.checksum(key).crc32)  # fmt: skip
    where = store.where(new_key)
    if read_back:
        _read_back(store, new_key, copy, where)
        return proven
    if composed.expected is None or composed.crc32 is None:
        remedy = Remedy("verify", "download", note=", to read it back")
        raise VerificationError("the store gives no CRC32 to prove the spliced copy by", path=where, remedy=remedy)
    if composed.crc32 != composed.expected:
        raise VerificationError("its CRC32 is not the one its parts give", path=where)
    return proven


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
