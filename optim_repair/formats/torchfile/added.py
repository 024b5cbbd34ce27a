"""The tensors a plan adds to a torch file: each a new storage under a key the file does not use yet."""

from __future__ import annotations

from typing import Any

from optim_repair.formats.pickle_writing import new_tensor, storage_for
from optim_repair.formats.pickled import Reduced, StorageRef
from optim_repair.formats.torchfile.files import TorchFile
from optim_repair.formats.torchfile.legacy import LegacyTorchFile
from optim_repair.formats.torchfile.rewrite import NewStorage
from optim_repair.records import keys
from optim_repair.records.dtypes import numel
from optim_repair.records.repair_plan import Addition, FreshTensor


def sibling_location(optimizer: dict[Any, Any], key: str) -> str:
    """Where the optimizer keeps ``key`` for other parameters (``cuda:0``, or ``cpu`` for a CPU ``step``)."""
    if keys.is_nested(optimizer):
        values = (entry.get(key) for entry in optimizer[keys.STATE].values() if isinstance(entry, dict))
    else:
        values = (
            value
            for name, value in optimizer.items()
            if keys.section_of(name) == keys.STATE and keys.split_flat(name)[2] == key
        )
    for value in values:
        if isinstance(value, Reduced) and value.args and isinstance(value.args[0], StorageRef):
            return value.args[0].location
    return "cpu"


class NewStorages:
    """The storages the additions create, each under a key the file does not use yet."""

    def __init__(self, torch_file: TorchFile) -> None:
        self._legacy = isinstance(torch_file, LegacyTorchFile)
        self._taken = set(torch_file.graph.storages)
        self.created: list[NewStorage] = []

    def tensor(self, value: FreshTensor, location: str) -> Reduced:
        key = f"optim-repair-{len(self.created)}" if self._legacy else str(len(self._taken))
        while key in self._taken:
            key += "_"
        self._taken.add(key)
        ref = storage_for(key, value.dtype, numel(value.shape), legacy=self._legacy, location=location)
        self.created.append(NewStorage(ref, value.nbytes, value.chunks()))
        return new_tensor(ref, value.shape)

    def values(self, addition: Addition, optimizer: dict[Any, Any]) -> list[Any]:
        """The values of ``addition``'s entry in ``optimizer`` (as the file has it): each fresh tensor a new
        storage, on the device its siblings are on."""
        return [
            self.tensor(value, sibling_location(optimizer, key)) if isinstance(value, FreshTensor) else value
            for key, value in addition.state
        ]
