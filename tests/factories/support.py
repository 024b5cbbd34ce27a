"""Helpers for the torch-format tests: input guards, tensor comparison and byte surgery on files.

Nothing here mocks torch: originals and copies are read back with ``torch.load`` and compared
bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import stat
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import optim_repair
from optim_repair.api import FixResult
from optim_repair.checkpoint.discovery import discover
from optim_repair.checkpoint.reading import DiskListing, read_parsed
from optim_repair.formats.torchfile import open_torch_file
from optim_repair.records.inventory import CheckpointInventory, ParamGroup
from optim_repair.records.repair_plan import Addition, Fill
from tests.factories.built import Built
from tests.factories.models import ParamKey

Snapshot = dict[str, tuple[str, int, int, int]]


def snapshot(path: Path) -> Snapshot:
    """Every file and directory under ``path`` (or the file): (sha256, size, mtime_ns, mode)."""
    found: Snapshot = {}
    entries = [path] if path.is_file() else [path, *sorted(path.rglob("*"))]
    for entry in entries:
        info = entry.lstat()
        rel = entry.relative_to(path).as_posix() if entry != path else "."
        digest = hashlib.sha256(entry.read_bytes()).hexdigest() if entry.is_file() else "dir"
        found[rel] = (digest, info.st_size if entry.is_file() else 0, info.st_mtime_ns, stat.S_IMODE(info.st_mode))
    return found


@contextmanager
def untouched(*paths: Path) -> Iterator[None]:
    """Assert that nothing under ``paths`` changed (content, mtime, mode), whatever happens inside."""
    before = {path: snapshot(path) for path in paths}
    try:
        yield
    finally:
        for path in paths:
            assert snapshot(path) == before[path], f"{path} was modified"


def leftovers(out: Path) -> list[Path]:
    """Temporary siblings the writer may have left beside ``out``."""
    return sorted(out.parent.glob(f".{out.name}.optim-repair-*"))


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was written"
    assert leftovers(out) == [], f"temporary files left: {leftovers(out)}"


def fix(path: Path, out: Path, **options: Any) -> FixResult:
    """``optim_repair.fix`` with the input guarded: it must be unchanged afterwards, even on error."""
    with untouched(path):
        result = optim_repair.fix(path, out, **options)
    assert leftovers(out) == []
    return result


def installed_command() -> list[str]:
    """The ``optim-repair`` console script installed beside this interpreter (else ``python -m optim_repair``)."""
    command = shutil.which("optim-repair", path=str(Path(sys.executable).parent))
    return [command] if command else [sys.executable, "-m", "optim_repair"]


def load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def resolve(obj: Any, address: tuple[ParamKey, ...]) -> Any:
    for part in address:
        obj = obj[part]
    return obj


def storage_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's whole untyped storage."""
    storage = t.untyped_storage()
    return bytes(storage) if storage.nbytes() else b""


def fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), type(t), t.requires_grad, storage_bytes(t))


def _float_bits(value: float) -> bytes:
    return struct.pack("<d", value)


class Comparison:
    """Compares an original object with its copy; the copy may only hold ``added`` state entries."""

    def __init__(self, added: Mapping[tuple[Any, ...], set[ParamKey]] | None = None) -> None:
        self.added = {address: set(params) for address, params in (added or {}).items()}
        self.storages: dict[int, int] = {}
        self.reverse: dict[int, int] = {}
        self.tensors = 0
        self.seen_added: dict[tuple[Any, ...], set[ParamKey]] = {}

    def same(self, a: Any, b: Any, path: tuple[Any, ...] = ()) -> None:
        assert type(a) is type(b), f"{path}: {type(a).__name__} became {type(b).__name__}"
        if isinstance(a, torch.Tensor):
            assert fingerprint(a) == fingerprint(b), f"{path}: tensor changed"
            self.tensors += 1
            pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
            if a.untyped_storage().nbytes():
                assert self.storages.setdefault(pa, pb) == pb, f"{path}: a shared storage was split"
                assert self.reverse.setdefault(pb, pa) == pa, f"{path}: storages were merged"
        elif isinstance(a, dict):
            extra = [key for key in b if key not in a]
            assert [key for key in b if key in a] == list(a), f"{path}: key order changed"
            allowed = self.added.get(path, set())
            assert set(extra) <= allowed, f"{path}: unexpected keys {extra}"
            if extra:
                self.seen_added.setdefault(path, set()).update(extra)
            for key in a:
                self.same(a[key], b[key], (*path, key))
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), f"{path}: length changed"
            for index, (x, y) in enumerate(zip(a, b, strict=True)):
                self.same(x, y, (*path, index))
        elif isinstance(a, float):
            assert _float_bits(a) == _float_bits(b), f"{path}: {a!r} became {b!r}"
        elif isinstance(a, complex):
            assert _float_bits(a.real) + _float_bits(a.imag) == _float_bits(b.real) + _float_bits(b.imag)
        else:
            assert a == b, f"{path}: {a!r} became {b!r}"


def assert_copy_faithful(
    original: Any, copy: Any, added: Mapping[tuple[Any, ...], set[ParamKey]] | None = None
) -> Comparison:
    """Everything in ``original`` is in ``copy`` unchanged (tensors bit for bit, sharing kept)."""
    comparison = Comparison(added)
    comparison.same(original, copy)
    assert comparison.seen_added == {k: v for k, v in comparison.added.items() if v}, "planned entries not added"
    return comparison


def assert_fixed_copy(built: Built, out: Path, fill: Fill = "empty") -> None:
    """``out`` mirrors ``built.path``: each optimizer file has exactly its missing entries added (as ``{}``, or with
    ``fill="fresh"`` as a first step's state: ``step`` 0 and more), everything else (and every other file) is
    unchanged."""
    for site, missing in built.missing.items():
        copy_file = out / site.file if site.file else out
        sd = resolve(load(copy_file), site.address)
        for param in missing:
            entry = sd["state"][param]
            if fill == "empty":
                assert entry == {}, f"{site}: {param!r} not added as {{}}"
            else:
                assert len(entry) > 1 and float(entry["step"]) == 0, f"{site}: {param!r} not added as fresh state"
    files = sorted({site.file for site in built.sites})
    for file in files:
        original, copy = built.path / file if file else built.path, out / file if file else out
        added = {(*site.address, "state"): set(m) for site, m in built.missing.items() if site.file == file}
        assert_copy_faithful(load(original), load(copy), added)
    if built.path.is_dir():
        originals = {p.relative_to(built.path) for p in built.path.rglob("*")}
        copies = {p.relative_to(out) for p in out.rglob("*")}
        assert originals == copies
        for rel in originals:
            if (built.path / rel).is_file() and rel.as_posix() not in files:
                assert (built.path / rel).read_bytes() == (out / rel).read_bytes(), f"{rel} changed"


def storage_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Byte offset and length of every storage in a torch file, from the tool's own reader."""
    torch_file = open_torch_file(path, path.name)
    return {key: torch_file.storage_range(key) for key in torch_file.graph.storages}


def tensor_storage_key(path: Path, address: tuple[Any, ...]) -> str:
    """The storage key of the tensor at ``address`` in a torch file."""
    from optim_repair.formats.addresses import resolve as resolve_graph
    from optim_repair.formats.pickled import tensor_meta

    torch_file = open_torch_file(path, path.name)
    meta = tensor_meta(resolve_graph(torch_file.graph.root, address))
    assert meta is not None
    return meta.storage


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as stream:
        stream.seek(offset)
        stream.write(data)


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as stream:
        stream.seek(offset)
        value = stream.read(1)[0]
        stream.seek(offset)
        stream.write(bytes([value ^ 0x01]))


def rewrite_pickle(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """Rewrite a zip torch file with its ``data.pkl`` edited; every other record as it was."""
    with zipfile.ZipFile(path) as archive:
        records = [(info, archive.read(info)) for info in archive.infolist()]
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as archive:
        for info, data in records:
            archive.writestr(info, edit(data) if info.filename.endswith("/data.pkl") else data)
    os.replace(tmp, path)


def binfloat(value: float) -> bytes:
    """A float as pickle's BINFLOAT opcode writes it."""
    return b"G" + struct.pack(">d", value)


def next_float(value: float) -> float:
    return math.nextafter(value, math.inf)


def make_read_only(path: Path) -> None:
    """Remove every write bit under ``path`` (directories too)."""
    entries = [path] if path.is_file() else [*sorted(path.rglob("*"), reverse=True), path]
    for entry in entries:
        entry.chmod(stat.S_IMODE(entry.stat().st_mode) & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def make_writable(path: Path) -> None:
    entries = [path] if path.is_file() else [path, *sorted(path.rglob("*"))]
    for entry in entries:
        entry.chmod(stat.S_IMODE(entry.stat().st_mode) | stat.S_IWUSR)


def group_of(group: dict[str, Any]) -> ParamGroup:
    """The inventory's view of one saved param group (its options as plain values)."""
    options = tuple((k, v) for k, v in group.items() if k not in ("params", "param_names"))
    return ParamGroup(params=tuple(group["params"]), options=options)


def read_checkpoint(path: Path) -> CheckpointInventory:
    """The inventory of every optimizer under ``path``, as ``inspect`` reads it."""
    return read_parsed(DiskListing(discover(path)))[0]


def unprivileged(probe: Path) -> list[str]:
    """A command prefix under which file modes bind (as root: drop the capabilities that bypass them)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv is not None, "as root, setpriv (util-linux) is needed to make file modes bind"
    prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
    check = subprocess.run(
        [*prefix, sys.executable, "-c", f"open({str(probe)!r}, 'ab')"], capture_output=True, text=True
    )
    assert check.returncode != 0 and "PermissionError" in check.stderr, f"{probe} is still writable"
    return prefix


def empty_additions(built: Built) -> list[Addition]:
    """A ``{}`` entry for every parameter ``built`` leaves without state."""
    return [
        Addition(site.file, site.location, site.address, param, ())
        for site, missing in built.missing.items()
        for param in missing
    ]
