"""Splicing a torch file's zip archive: a new pickle record, then every other record of the original byte for byte.

``torch.save`` writes ``data.pkl`` first. A repair that changes the pickle and keeps every storage can write
the new pickle record, keep the original's bytes from its second record to its central directory as they
are (one range the kernel copies on a disk, or a store copies inside itself), and end with the new storages'
records and a new central directory. The pickle record is padded so that every kept record moves by a multiple
of 64 bytes and its storages stay aligned as torch aligns them.

A store that composes only whole objects (GCS) is served by ``append``: the whole original, then the new pickle
record, the new storages and a new central directory that names the new pickle and every kept record where it
lies. The original's own pickle record and central directory stay, unread, as dead space: zip readers (miniz,
torch's, and ``zipfile``) find an archive's records through the central directory at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from optim_repair.errors import RepairRefused
from optim_repair.formats.torchfile.rewrite import NewStorage
from optim_repair.formats.torchfile.zipformat import ZipTorchFile, kept_records
from optim_repair.formats.torchfile.zipwriter import ALIGNMENT, ZipWriter
from optim_repair.storage.disk import kernel_copy, open_regular

_LOCAL_FIXED = 30 + 4
"""A local header's fixed part, and the padding field's own header."""


@dataclass(frozen=True)
class Splice:
    """A new archive: ``head`` bytes of the scratch file, the original's bytes ``start`` to ``end``, then the
    scratch file's ``tail`` bytes from ``tail_at``."""

    head: int
    start: int
    end: int
    tail_at: int
    tail: int

    @property
    def moved(self) -> int:
        """How far every kept record moved: a multiple of ``ALIGNMENT``."""
        return self.head - self.start


def splice(torch_file: ZipTorchFile, data: bytes, created: Sequence[NewStorage], scratch: int, source: str) -> Splice:
    """Write into the descriptor ``scratch`` the head and tail of ``torch_file`` with ``data`` as its pickle and the
    ``created`` storages added. Raises ``RepairRefused`` for an archive torch did not lay out so (``kept_records``)."""
    kept = kept_records(torch_file)
    if kept is None:
        raise RepairRefused(
            "its records are not laid out as torch.save lays them out (the pickle first, all stored)", path=source
        )
    first, directory_at = next(info for info in torch_file.records if info.header_offset == 0), torch_file.directory_at
    start = kept[0].header_offset
    writer = ZipWriter(scratch)
    fixed = _LOCAL_FIXED + len(first.filename.encode("utf-8"))
    writer.add_bytes(
        first.filename, data, first.date_time, first.external_attr, padding=(start - fixed - len(data)) % ALIGNMENT
    )
    head = writer.position
    writer.skip(directory_at - start, kept, head - start)
    for ref, size, chunks in created:
        writer.add_chunks(f"{torch_file.prefix}data/{ref.key}", size, chunks, first.date_time, first.external_attr)
    end = writer.finish()
    tail_at = head + directory_at - start
    return Splice(head, start, directory_at, tail_at, end - tail_at)


def append(
    torch_file: ZipTorchFile, size: int, data: bytes, created: Sequence[NewStorage], scratch: int, source: str
) -> Splice:
    """Write into the descriptor ``scratch``, past its first ``size`` bytes (the original's, left unwritten), the
    tail that follows the whole original (of ``size`` bytes) when ``data`` replaces its pickle and the ``created``
    storages are added. Raises ``RepairRefused`` as ``splice`` does."""
    kept = kept_records(torch_file)
    if kept is None:
        raise RepairRefused(
            "its records are not laid out as torch.save lays them out (the pickle first, all stored)", path=source
        )
    first = next(info for info in torch_file.records if info.header_offset == 0)
    writer = ZipWriter(scratch)
    writer.skip(size, kept, 0)
    writer.add_bytes(first.filename, data, first.date_time, first.external_attr)
    for ref, nbytes, chunks in created:
        writer.add_chunks(f"{torch_file.prefix}data/{ref.key}", nbytes, chunks, first.date_time, first.external_attr)
    end = writer.finish()
    return Splice(0, 0, size, size, end - size)


_STEP = 64 << 20
"""How much of the kept range the kernel copies between two reports of progress."""


def write_spliced(
    torch_file: ZipTorchFile,
    data: bytes,
    created: Sequence[NewStorage],
    target: int,
    on_bytes: Callable[[int], None] = lambda nbytes: None,
) -> None:
    """Write ``torch_file`` spliced to the descriptor ``target``: the new head and tail, and between them the
    original's kept records as one range, moved by the kernel (``kept_records`` must have found them)."""
    name = str(torch_file.path)
    made = splice(torch_file, data, created, target, name)
    with open_regular(torch_file.path, name) as raw:
        for done in range(0, made.end - made.start, _STEP):
            size = min(_STEP, made.end - made.start - done)
            kernel_copy(raw.fileno(), target, made.start + done, size, made.head + done, name=name)
            on_bytes(size)
    for storage in created:
        on_bytes(storage.nbytes)
