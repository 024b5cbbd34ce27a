"""Files written by ``torch.save``, zip or legacy: read without torch, rewritten with additions.

Reading parses only the pickle (and, for the legacy format, the few bytes that say how long each
storage is): cost grows with the number of entries, not with the gigabytes. Writing copies every
storage's bytes as they are and pickles the edited object graph anew; nothing is ever unpickled
unsafely and torch is never imported.
"""

from optim_repair.formats.torchfile.files import TORCH_SUFFIXES, TorchFile, open_torch_file
from optim_repair.formats.torchfile.legacy import LegacyTorchFile
from optim_repair.formats.torchfile.planning import plan_torch_file
from optim_repair.formats.torchfile.reader import read_inventory
from optim_repair.formats.torchfile.writer import write_torch_file
from optim_repair.formats.torchfile.zipformat import ZipTorchFile

__all__ = [
    "TORCH_SUFFIXES",
    "LegacyTorchFile",
    "TorchFile",
    "ZipTorchFile",
    "open_torch_file",
    "plan_torch_file",
    "read_inventory",
    "write_torch_file",
]
