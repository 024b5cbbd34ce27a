"""Verifying a torch file written with additions: the object graph, every storage, and the framing.

The copy is parsed back from disk and compared with the original as reading parsed it (never anything the
writer made): the object graph (floats bit for bit, key order, tuple-vs-list, storage identity), every
storage's bytes, and the byteorder/version records or the legacy header. What the copy may differ by is derived
here from the plan alone, through the key grammar (``records.keys``), not from the writer's edits. A copy whose
pickle is the original's with entries appended is proven by its kept bytes and its appendix (``appendix_proof``);
one that keeps the original's records after the pickle as one range (``splice``) by comparing that range whole.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from optim_repair.errors import InputError, VerificationError, shown
from optim_repair.formats.addresses import describe_address, resolve
from optim_repair.formats.pickled import PickleGraph, Reduced, StorageRef, global_name, load_graph, tensor_meta
from optim_repair.formats.safe_globals import PickledObject
from optim_repair.formats.torchfile.appendix_proof import Appended, appended_entries
from optim_repair.formats.torchfile.files import Opener, TorchFile, open_torch_file
from optim_repair.formats.torchfile.legacy import LegacyTorchFile
from optim_repair.formats.torchfile.planning import entry_values
from optim_repair.formats.torchfile.zipformat import ZipTorchFile, kept_records, read_record
from optim_repair.formats.unpickling import ZIP_ERRORS
from optim_repair.records import keys
from optim_repair.records.repair_plan import Addition, FreshTensor, ParamChange
from optim_repair.records.verification import READ_EVERYTHING, HolderProof, Verification
from optim_repair.storage.disk import open_regular, same_range


def _float_bits(value: float | complex) -> bytes:
    if isinstance(value, complex):
        return struct.pack("<dd", value.real, value.imag)
    return struct.pack("<d", value)


class _GraphComparison:
    """Walks the original and the copy together; the copy may differ only by the planned changes and additions."""

    def __init__(self, source: str, additions: Sequence[Addition], changes: Sequence[ParamChange] = ()) -> None:
        self.source = source
        self.edited: dict[tuple[Any, ...], tuple[list[ParamChange], list[Addition]]] = {}
        """The optimizers the plan renames, drops from or adds to, by address: compared by ``_same_optimizer``,
        which maps each original name to its new one and expects the planned entries."""
        for address in dict.fromkeys([*(c.address for c in changes), *(a.address for a in additions)]):
            mine = [c for c in changes if c.address == address], [a for a in additions if a.address == address]
            self.edited[address] = mine
        self.tensors = 0
        self._seen: set[tuple[int, int]] = set()

    def fail(self, path: tuple[Any, ...], what: str) -> None:
        where = describe_address(path) or "the top level"
        raise VerificationError(f"the copy differs at {where}: {what}", path=self.source)

    def same(self, a: Any, b: Any, path: tuple[Any, ...]) -> None:
        name, twin = global_name(a), global_name(b)
        if name is not None or twin is not None:  # a reference to a class or a function: by its name
            if name != twin:
                self.fail(path, f"{name or shown(a)} became {twin or shown(b)}")
            return
        if type(a) is not type(b):
            self.fail(path, f"{type(a).__name__} became {type(b).__name__}")
        pair = (id(a), id(b))
        if pair in self._seen:
            return
        if isinstance(a, (dict, list, tuple, Reduced, StorageRef, PickledObject)):
            self._seen.add(pair)
        if isinstance(a, dict) and path in self.edited:
            self._same_optimizer(a, b, path)
        elif isinstance(a, dict):
            if list(a) != list(b):
                self.fail(path, f"keys {shown(list(a))} became {shown(list(b))}")
            for key in a:
                self.same(a[key], b[key], (*path, key))
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                self.fail(path, f"length {len(a)} became {len(b)}")
            for index, (x, y) in enumerate(zip(a, b, strict=True)):
                self.same(x, y, (*path, index))
        elif isinstance(a, Reduced):
            if a.func != b.func or a.has_state != b.has_state:
                self.fail(path, f"{a.func.qualname} became {b.func.qualname}")
            if tensor_meta(a) is not None:
                self.tensors += 1
            self.same(a.args, b.args, path)
            self.same(a.state, b.state, path)
        elif isinstance(a, StorageRef):
            self.same(a.pid, b.pid, path)
        elif isinstance(a, PickledObject):  # its class is its type, compared above
            if a.has_state != b.has_state:
                self.fail(path, f"the state of a {a.qualname()} was {'dropped' if a.has_state else 'added'}")
            self.same(a.args, b.args, path)
            self.same(a.state, b.state, path)
        elif isinstance(a, (float, complex)):
            if _float_bits(a) != _float_bits(b):
                self.fail(path, f"{shown(a)} became {shown(b)}")
        elif isinstance(a, (int, str, bytes, bytearray, set, frozenset)) or a is None:
            if a != b:
                self.fail(path, f"{shown(a)} became {shown(b)}")
        else:
            self.fail(path, f"cannot compare a {type(a).__name__}")

    def _same_optimizer(self, a: dict[Any, Any], b: dict[Any, Any], path: tuple[Any, ...]) -> None:
        changes, additions = self.edited[path]
        mapping = {change.old: change.new for change in changes}
        replaced = {addition.param for addition in additions if addition.replaces}
        if not keys.is_nested(a):
            self._same_flattened(a, b, path, mapping, additions)
            return
        if list(a) != list(b):
            self.fail(path, f"keys {shown(list(a))} became {shown(list(b))}")
        for key in a:
            if key not in ("state", "param_groups"):
                self.same(a[key], b[key], (*path, key))
        kept = [_renamed(mapping, name) for name in a["state"] if _renamed(mapping, name) is not None]
        expected = kept + [x.param for x in additions if x.param not in kept]
        if list(b["state"]) != expected:
            self.fail((*path, "state"), f"keys {shown(list(a['state']))} became {shown(list(b['state']))}")
        for name, value in a["state"].items():
            new = _renamed(mapping, name)
            if new is not None and new not in replaced:
                self.same(value, b["state"][new], (*path, "state", new))
        groups_a, groups_b = a["param_groups"], b["param_groups"]
        if len(groups_a) != len(groups_b):
            self.fail((*path, "param_groups"), f"{len(groups_a)} groups became {len(groups_b)}")
        for index, (group, twin) in enumerate(zip(groups_a, groups_b, strict=True)):
            where = (*path, "param_groups", index)
            if list(group) != list(twin):
                self.fail(where, f"keys {shown(list(group))} became {shown(list(twin))}")
            params = [_renamed(mapping, p) for p in group["params"] if _renamed(mapping, p) is not None]
            params += [x.param for x in additions if x.group == index]
            if list(twin["params"]) != params:
                self.fail((*where, "params"), f"{shown(group['params'])} became {shown(twin['params'])}")
            for key in group:
                if key != "params":
                    self.same(group[key], twin[key], (*where, key))

    def _same_flattened(
        self, a: dict[Any, Any], b: dict[Any, Any], path: tuple[Any, ...], mapping: dict[Any, Any], additions: Any
    ) -> None:
        renamed = {key: new for key in a if (new := keys.renamed_flat(key, mapping)) is not None}
        replaced = {x.param for x in additions if x.replaces}
        planned: list[str] = []  # each addition's state keys, then the hyperparameters it repeats
        copied: dict[str, Any] = {}  # a joining parameter's hyperparameters: its group member's, as they were
        for x in additions:
            planned += [keys.flat_key(keys.STATE, x.param, k) for k in x.keys]
            if x.like is not None:
                for key, new in renamed.items():
                    leaf = keys.leaf_of(new, keys.PARAM_GROUPS, x.like)
                    if leaf is not None:
                        copied[keys.flat_key(keys.PARAM_GROUPS, x.param, leaf)] = key
                        planned.append(keys.flat_key(keys.PARAM_GROUPS, x.param, leaf))
        new_keys = set(planned)
        kept = [
            new
            for new in renamed.values()
            if new in new_keys or not any(keys.leaf_of(new, keys.STATE, param) is not None for param in replaced)
        ]
        expected = kept + [key for key in planned if key not in set(kept)]
        if list(b) != expected:
            self.fail(path, f"keys {shown(list(a))} became {shown(list(b))}")
        for key, new in renamed.items():
            if new not in new_keys and new in b:
                self.same(a[key], b[new], (*path, new))
        for new, key in copied.items():
            self.same(a[key], b[new], (*path, new))


def _renamed(mapping: dict[Any, Any], name: Any) -> Any:
    return mapping.get(name, name)


def _graph_entry(root: Any, addition: Addition) -> list[tuple[Any, Any]]:
    """The keys and values of ``addition``'s entry in the copy's graph."""
    optimizer = resolve(root, addition.address)
    if keys.is_nested(optimizer):
        state = optimizer[keys.STATE].get(addition.param)
        return list(state.items()) if isinstance(state, dict) else []
    return [(key, optimizer[keys.flat_key(keys.STATE, addition.param, key)]) for key in addition.keys]


def _check_additions(
    copy: TorchFile,
    copy_stream: BinaryIO,
    additions: Sequence[Addition],
    source: str,
    entry_of: Callable[[Addition], list[tuple[Any, Any]]],
) -> None:
    for addition in additions:
        where = f"added entry {shown(addition.param)} at {addition.location or 'the top level'}"
        entry = entry_of(addition)
        if [key for key, _ in entry] != list(addition.keys):
            raise VerificationError(f"{where} is not what was planned", path=source)
        values = [value for _, value in entry]
        for (key, planned), value in zip(addition.state, values, strict=True):
            if isinstance(planned, FreshTensor):
                meta = tensor_meta(value)
                if meta is None or (meta.dtype, meta.shape) != (planned.dtype, planned.shape):
                    raise VerificationError(
                        f"{where}: {key} is not a {planned.dtype} tensor of shape {planned.shape}", path=source
                    )
                offset, length = copy.storage_range(meta.storage)
                copy_stream.seek(offset)
                if length != planned.nbytes or any(copy_stream.read(len(c)) != c for c in planned.chunks()):
                    raise VerificationError(f"{where}: {key} does not hold the planned values", path=source)
            elif value != planned:
                raise VerificationError(f"{where}: {key} is {shown(value)}, planned {shown(planned)}", path=source)


def _replaced_storages(original: TorchFile, additions: Sequence[Addition], changes: Sequence[ParamChange]) -> set[str]:
    """The storages of the original entries that planned replacements take the place of, or drops remove."""
    gone = [(c.address, c.old) for c in changes if c.new is None]
    for addition in additions:
        if addition.replaces:
            was = {c.new: c.old for c in changes if c.address == addition.address}
            gone.append((addition.address, was.get(addition.param, addition.param)))
    found: set[str] = set()
    for address, param in gone:
        values = [value for _, value in entry_values(resolve(original.graph.root, address), param)]
        found.update(meta.storage for meta in map(tensor_meta, values) if meta is not None)
    return found


def _same_framing(before: TorchFile, after: TorchFile, a: BinaryIO, b: BinaryIO, source: str) -> None:
    """What torch reads besides the pickle and the storages is unchanged: the legacy header (magic,
    protocol, ``little_endian``), or the zip records ``byteorder``, ``version``, ``.format_version``, ..."""

    def changed(what: str) -> VerificationError:
        return VerificationError(f"the copy's {what} differs from the original's", path=source)

    if isinstance(before, LegacyTorchFile) or isinstance(after, LegacyTorchFile):
        if not (isinstance(before, LegacyTorchFile) and isinstance(after, LegacyTorchFile)):
            raise changed("format")
        length = before.main_start
        if after.main_start != length or not same_range(a, 0, b, 0, length):
            raise changed("header")
        return
    copied = after.framing()
    for name, info in before.framing().items():
        twin = copied.get(name)
        if twin is None or twin.file_size != info.file_size:
            raise changed(f"record {name}")
        if read_record(a, info, source) != read_record(b, twin, source):
            raise changed(f"record {name}")


_STEP = 64 << 20
"""How much of a kept range is compared between two reports of progress."""


def _kept_in_place(
    before: ZipTorchFile, after: ZipTorchFile, a: BinaryIO, b: BinaryIO, on_bytes: Callable[[int], None]
) -> tuple[int, int, int] | None:
    """``(start, end, moved)`` where the copy holds every byte of the original from its second record to its
    central directory, read and compared here, ``moved`` bytes on, and its directory places every one of those
    records there; None where it does not (a copy written record by record, or one whose bytes differ: each
    storage is then compared on its own, and the one that differs named)."""
    kept = kept_records(before)
    twins = {info.filename: info for info in after.records}
    if kept is None or kept[0].filename not in twins:
        return None
    start, end = kept[0].header_offset, before.directory_at
    moved = twins[kept[0].filename].header_offset - start
    for info in kept:
        twin = twins.get(info.filename)
        if twin is None or (twin.header_offset, twin.CRC, twin.file_size) != (
            info.header_offset + moved,
            info.CRC,
            info.file_size,
        ):
            return None
    for done in range(0, end - start, _STEP):
        size = min(_STEP, end - start - done)
        if not same_range(a, start + done, b, start + moved + done, size):
            return None
        on_bytes(size)
    return start, end, moved


def verify_torch_file(
    original: Path,
    copy: Path,
    source: str,
    additions: Sequence[Addition],
    *,
    changes: Sequence[ParamChange] = (),
    parsed: TorchFile | None = None,
    on_bytes: Callable[[int], None] = lambda nbytes: None,
    openers: tuple[Opener, Opener] | None = None,
    holder: HolderProof = READ_EVERYTHING,
) -> Verification:
    """Prove ``copy`` equals ``original`` with ``changes`` (renames, drops) and ``additions`` applied; raise
    VerificationError otherwise.

    ``parsed`` is the original as reading parsed it (parsed anew when not given), never a graph the
    writer had; ``on_bytes`` hears of every storage compared, by its size. ``openers`` open the original and the
    copy (by default, the files at their paths). What the ``holder`` of the copy proves itself
    (``HolderProof.kept``: a store's checksum of a spliced copy) is checked for where it lies, not read.
    """
    first, second = openers or (partial(open_regular, original, source), partial(open_regular, copy, source))
    before = parsed or open_torch_file(original, source, opener=first)
    appended: list[Appended] = []

    def graph_of(data: bytes) -> PickleGraph:
        found = None
        if isinstance(before, ZipTorchFile) and not changes:
            found = appended_entries(before, data, additions, source)
        if found is None:
            return load_graph(data, source, ours=True)
        appended.append(found)
        return found.graph

    try:
        after = open_torch_file(copy, source, ours=True, opener=second, graph_of=graph_of)
    except VerificationError:
        raise
    except InputError as exc:
        raise VerificationError(f"the copy cannot be read back ({exc})") from exc
    with first() as a, second() as b:
        try:
            _same_framing(before, after, a, b, source)
        except (*ZIP_ERRORS, InputError) as exc:
            raise VerificationError(f"the copy cannot be read back ({exc})", path=source) from exc
    if appended:  # the original's pickle kept byte for byte: its graph is the same graph
        tensors, entry_of = appended[0].tensors, appended[0].entry
    else:
        comparison = _GraphComparison(source, additions, changes)
        comparison.same(before.graph.root, after.graph.root, ())
        tensors, entry_of = comparison.tensors, partial(_graph_entry, after.graph.root)
    total = 0
    replaced = _replaced_storages(before, additions, changes)
    with first() as a, second() as b:
        kept, read = holder.kept, False
        if kept is None and isinstance(before, ZipTorchFile) and isinstance(after, ZipTorchFile):
            kept = _kept_in_place(before, after, a, b, on_bytes)
            read = kept is not None
        for key, ref in before.graph.storages.items():
            twin = after.graph.storages.get(key)
            if twin is None and key in replaced:
                continue  # held only by a phantom-step entry the plan replaced
            if twin is None or twin.nbytes != ref.nbytes:
                raise VerificationError(f"storage {key} is missing from the copy", path=source)
            offset, length = before.storage_range(key)
            if kept is not None and kept[0] <= offset and offset + length <= kept[1]:
                if after.storage_range(key)[0] != offset + kept[2]:
                    raise VerificationError(f"storage {key} does not lie where it was kept", path=source)
                if not read:
                    on_bytes(length)
            elif not same_range(a, offset, b, after.storage_range(key)[0], length):
                raise VerificationError(f"the bytes of storage {key} changed", path=source)
            else:
                on_bytes(length)
            total += length
        _check_additions(after, b, additions, source, entry_of)
    return Verification(tensors, total)
