"""What a repair of one torch file would refuse, found before anything is written.

``fix``, ``fix --dry-run`` and ``optim_repair.plan`` all run it: a refusal is the same in each, and a copy
is begun only for a plan every file accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, BinaryIO

from optim_repair.errors import Remedy, RepairRefused, shown
from optim_repair.formats.addresses import resolve
from optim_repair.formats.pickled import is_dtensor, tensor_meta
from optim_repair.formats.torchfile.files import TorchFile
from optim_repair.formats.torchfile.legacy import LegacyTorchFile
from optim_repair.records import keys
from optim_repair.records.dtypes import CHUNK, itemsize
from optim_repair.records.repair_plan import Addition, FreshTensor, ParamChange
from optim_repair.storage.disk import open_regular


def entry_values(optimizer: dict[Any, Any], param: object) -> list[tuple[str, Any]]:
    """The keys and values of ``param``'s state entry in an optimizer state dict, nested or flattened."""
    if keys.is_nested(optimizer):
        entry = optimizer[keys.STATE].get(param, {})
        return list(entry.items()) if isinstance(entry, dict) else [("", entry)]
    found = []
    for key, value in optimizer.items():
        leaf = keys.leaf_of(key, keys.STATE, param)
        if leaf is not None:
            found.append((leaf, value))
    return found


def _moments_are_zero(torch_file: TorchFile, stream: BinaryIO, old: Sequence[tuple[str, Any]]) -> bool:
    """Whether every byte of an entry's moments (all but ``step``) is zero: inspect read only their heads."""
    for key, value in old:
        meta = tensor_meta(value)
        if meta is None or key == "step":
            continue
        offset, _ = torch_file.storage_range(meta.storage)
        stream.seek(offset + meta.storage_offset * itemsize(meta.dtype))
        left = meta.nbytes
        while left:
            chunk = stream.read(min(left, CHUNK))
            if not chunk or any(chunk):
                return False
            left -= len(chunk)
    return True


def _holds_dtensors(optimizer: dict[Any, Any]) -> bool:
    if keys.is_nested(optimizer):
        entries = (entry for entry in optimizer[keys.STATE].values() if isinstance(entry, dict))
        return any(is_dtensor(value) for entry in entries for value in entry.values())
    return any(is_dtensor(value) for key, value in optimizer.items() if keys.section_of(key) == keys.STATE)


def _refuse_fresh_dtensors(torch_file: TorchFile, source: str, additions: Sequence[Addition]) -> None:
    """Fresh state for a parameter of DTensor state must be a DTensor sharded as that parameter is; a plain
    tensor is not what its loader expects, and no DTensor is made here."""
    addresses = {
        addition.address for addition in additions if any(isinstance(v, FreshTensor) for _, v in addition.state)
    }
    for address in addresses:  # each optimizer once: its state is walked once, whatever it adds
        addition = next(addition for addition in additions if addition.address == address)
        if _holds_dtensors(resolve(torch_file.graph.root, address)):
            raise RepairRefused(
                f"{addition.location or 'the top level'} holds DTensor state (FSDP2, saved per rank): fresh state "
                "would have to be a DTensor sharded as its parameter is, which optim-repair does not write; "
                "optimizer.load_state_dict resumes {} entries as the optimizer would have created them",
                path=source,
                remedy=Remedy("fill", "empty"),
            )


def plan_torch_file(
    torch_file: TorchFile, source: str, additions: Sequence[Addition], changes: Sequence[ParamChange]
) -> None:
    """Refuse (``RepairRefused``) what the writer could not do to ``torch_file``: drop a storage of a legacy file,
    or reset an entry whose moments are not all zero (every byte of them is read here), or add fresh state to
    DTensor state."""
    _refuse_fresh_dtensors(torch_file, source, additions)
    replacing = [addition for addition in additions if addition.replaces]
    if (replacing or any(change.new is None for change in changes)) and isinstance(torch_file, LegacyTorchFile):
        raise RepairRefused(
            "resetting a phantom step or dropping a parameter drops storages, which a legacy-format file must all "
            "keep (torch.load refuses a storage the pickle does not name); save it with torch.save's zip format",
            path=source,
        )
    if not replacing:
        return
    with open_regular(torch_file.path, source) as stream:
        for addition in replacing:
            optimizer = resolve(torch_file.graph.root, addition.address)
            was = {c.new: c.old for c in changes if c.address == addition.address}  # additions name new names
            old = entry_values(optimizer, was.get(addition.param, addition.param))
            if not _moments_are_zero(torch_file, stream, old):
                raise RepairRefused(
                    f"{shown(addition.param)} at {addition.location or 'the top level'} has a moment that is not all "
                    "zero: not a phantom step's state, so it is not reset"
                )
