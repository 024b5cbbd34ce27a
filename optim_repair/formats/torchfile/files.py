"""Opening a file written by ``torch.save``, in either of its formats."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import BinaryIO

from optim_repair.errors import InputError, os_error_reason
from optim_repair.formats.torchfile.legacy import LegacyTorchFile, open_legacy
from optim_repair.formats.torchfile.zipformat import ZIP_MAGIC, GraphOf, ZipTorchFile, open_zip
from optim_repair.storage.disk import open_regular

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
"""Names of the torch files a directory argument reads (UniRL, HF Trainer, Accelerate, Lightning)."""

TorchFile = ZipTorchFile | LegacyTorchFile
"""A parsed torch file: ``graph``, ``kind``, ``path`` and ``storage_range(key)`` in both formats."""


Opener = Callable[[], BinaryIO]
"""Opens a torch file for reading: a local file (``open_regular``), or an object of a store read by ranges."""


def open_torch_file(
    path: Path, source: str, *, ours: bool = False, opener: Opener | None = None, graph_of: GraphOf | None = None
) -> TorchFile:
    """Parse ``path`` (or what ``opener`` opens) without reading tensor bytes. Raises InputError / UnsafeInputError.

    ``ours``: a file this run wrote, read back for verification (its pickle needs no bounding); ``graph_of``: how a
    zip-format file's pickle becomes its graph, where not by ``load_graph``.
    """
    try:
        with (opener or partial(open_regular, path, source))() as stream:
            if stream.read(len(ZIP_MAGIC)) == ZIP_MAGIC:
                return open_zip(stream, path, source, ours=ours, graph_of=graph_of)
            stream.seek(0)
            return open_legacy(stream, path, source, ours=ours)
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=source) from exc
