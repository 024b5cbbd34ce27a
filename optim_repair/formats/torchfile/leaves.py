"""A torch file's leaves: every tensor at the bytes of its storage, every other value as it was pickled."""

from __future__ import annotations

from optim_repair.errors import InputError, shown
from optim_repair.formats.leaves import graph_leaves
from optim_repair.formats.torchfile.files import TorchFile
from optim_repair.formats.torchfile.legacy import LegacyTorchFile
from optim_repair.records.inventory import TensorMeta
from optim_repair.records.leaves import Leaf, LeafPath, Piece


def torch_leaves(torch_file: TorchFile, rel: str, source: str) -> dict[LeafPath, Leaf]:
    """The leaves of a parsed torch file (``rel``: its path relative to the argument); a tensor that does not
    lie inside its storage, which torch's loader refuses, is refused here too."""

    def placed(meta: TensorMeta) -> Piece:
        if not meta.in_bounds:
            raise InputError(
                f"a {meta.dtype} tensor of shape {shown(meta.shape)} lies outside its storage", path=source
            )
        base, _ = torch_file.storage_range(meta.storage)
        start = (0,) * len(meta.shape)
        return Piece(start, meta.shape, rel, base, meta.stride, meta.storage_offset)

    return graph_leaves(torch_file.graph.root, source, placed, pickled_bytes(torch_file))


def pickled_bytes(torch_file: TorchFile) -> int:
    """How many bytes a torch file's object graph was pickled in: its ``data.pkl``, or the legacy file's pickle."""
    if isinstance(torch_file, LegacyTorchFile):
        return torch_file.storage_start - torch_file.main_start
    return next(info.file_size for info in torch_file.records if info.filename == f"{torch_file.prefix}data.pkl")
