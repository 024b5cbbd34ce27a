"""Hand-crafted hostile and damaged inputs, each the smallest that showed a class of failure.

Every builder writes under a directory it is given and returns what to point the tool at. Pickles
are written opcode by opcode (``pickle`` itself would refuse to produce most of them).
"""

from __future__ import annotations

import os
import shlex
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

from tests.factories.built import Built, Site
from tests.factories.models import absent_entries, run
from tests.factories.trainers import OPT_SITE, single_file, unirl_payload

PROTO2 = b"\x80\x02"


def text(value: str) -> bytes:
    """BINUNICODE of ``value``: a string as torch's pickler writes it."""
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def torch_zip(path: Path, data_pkl: bytes, records: dict[str, bytes] | None = None) -> Path:
    """A zip-format torch file holding ``data_pkl`` (and ``records``, by name under ``archive/``)."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        for name, data in (records or {}).items():
            archive.writestr(f"archive/{name}", data)
        archive.writestr("archive/version", "3\n")
    return path


def binput(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def binget(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def billion_laughs(levels: int = 60) -> bytes:
    """Opcodes that push a tuple of 2**levels leaves, built from memo references (about 12 bytes a level)."""
    ops = b"K\x01" + binput(0)
    for level in range(levels):
        ops += binget(level) + binget(level) + b"\x86" + binput(level + 1)
    return ops


def optimizer_with_key(key_ops: bytes) -> bytes:
    """A pickle of ``{"state": {KEY: {}}, "param_groups": []}``, the key given as opcodes."""
    return (
        PROTO2 + b"}" + text("state") + b"}" + key_ops + b"}" + b"s" + b"s"
        + text("param_groups") + b"]" + b"s."
    )  # fmt: skip


def optimizer_with_param(param_ops: bytes) -> bytes:
    """A pickle of ``{"state": {}, "param_groups": [{"params": [PARAM]}]}``, the param given as opcodes."""
    return (
        PROTO2 + b"}" + text("state") + b"}" + b"s"
        + text("param_groups") + b"]" + b"}" + text("params") + b"]" + param_ops + b"a" + b"s" + b"a" + b"s."
    )  # fmt: skip


def deep_tuple(depth: int) -> bytes:
    return b"K\x01" + b"\x85" * depth


def deep_list(depth: int) -> bytes:
    return b"]" * depth + b"a" * (depth - 1)


def memo_bomb() -> bytes:
    return PROTO2 + b"K\x01" + binput(1 << 28) + b"."


def bytearray_bomb() -> bytes:
    """``bytearray(2**32)``: four GiB of zeros from one call of an allowlisted global."""
    return PROTO2 + b"cbuiltins\nbytearray\n" + b"\x8a\x05\x00\x00\x00\x00\x01" + b"\x85R."


def billion_laughs_persistent_id() -> bytes:
    return PROTO2 + billion_laughs() + b"Q."


def _text(value: str) -> bytes:
    return b"X" + struct.pack("<I", len(value)) + value.encode()


def deepened_and_shared(count: int) -> bytes:
    """An optimizer state dict (torch's weights-only opcodes alone) with ``refs``: a dict of ``count`` keys, put in
    the memo, made deeper once taken from it (a list set under one more key), then fetched ``count`` times more:
    depths the pre-scan cannot know, in a graph of ``count`` references to one wide dict."""
    keys = b"".join(b"J" + struct.pack("<i", key) + b"N" for key in range(count))
    wide = b"}" + b"r" + struct.pack("<I", 0) + b"(" + keys
    deepened = wide + b"u" + binget(0) + b"J" + struct.pack("<i", count) + b"]" + b"s"
    return (
        PROTO2 + b"}" + _text("state") + b"}" + b"s" + _text("param_groups") + b"]" + b"s"
        + _text("refs") + b"]" + b"(" + deepened + binget(0) * count + b"e" + b"s."
    )  # fmt: skip


def _central_entry(data: bytes | bytearray, name: str) -> int:
    """Where the central directory entry of the record ``name`` starts in a zip archive's bytes."""
    return data.rindex(b"PK\x01\x02", 0, data.rindex(name.encode()))


def claim_size(path: Path, name: str, size: int) -> Path:
    """The archive at ``path`` with its directory claiming that the record ``name`` unpacks to ``size`` bytes."""
    data = bytearray(path.read_bytes())
    entry = _central_entry(data, name)
    data[entry + 24 : entry + 28] = struct.pack("<I", size)
    path.write_bytes(bytes(data))
    return path


def deflated_pickle(path: Path, size: int) -> Path:
    """A torch zip whose ``data.pkl``, deflated, unpacks to ``size`` bytes of POP opcodes (a thousandth on disk)."""
    info = zipfile.ZipInfo("archive/data.pkl")
    info.compress_type = zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w") as archive:
        with archive.open(info, "w", force_zip64=True) as record:
            record.write(PROTO2)
            chunk = b"N0" * (1 << 20)
            for _ in range((size - 4) // len(chunk)):
                record.write(chunk)
            record.write(b"N0" * (((size - 4) % len(chunk)) // 2) + b"N.")
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


def shared_record(path: Path, target: str, names: list[str]) -> Path:
    """The zip archive at ``path`` with the directory entries of the records ``names`` pointing at the record
    ``target`` (its local header, CRC and sizes): many storages read from, and copied from, one record."""
    data = bytearray(path.read_bytes())
    first = _central_entry(data, target)
    for name in names:
        entry = _central_entry(data, name)
        data[entry + 16 : entry + 28] = data[first + 16 : first + 28]  # CRC and sizes
        data[entry + 42 : entry + 46] = data[first + 42 : first + 46]  # where its local header is
    path.write_bytes(bytes(data))
    return path


def safetensors_entries(path: Path, count: int) -> Path:
    """A safetensors file whose header describes ``count`` one-element tensors over the same four bytes."""
    header = (
        b"{" + b",".join(b'"w%d":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}' % i for i in range(count)) + b"}"
    )
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    return path


# --------------------------------------------------------------------------- unsafe pickles


class ShellOnLoad:
    """Pickles as ``os.system(command)``: unpickling it runs the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return (os.system, (self.command,))


def _unsafe(root: Path, marker: Path, name: str, legacy: bool) -> Built:
    r = run()
    payload = unirl_payload(r)
    payload["callback"] = ShellOnLoad(f"touch {shlex.quote(str(marker))}")
    path = single_file(root, name, payload, legacy=legacy)
    return Built(path, {Site("", OPT_SITE): absent_entries(r.model, r.optimizer, "name")})


def unsafe_pickle(root: Path, marker: Path) -> Built:
    """``unsafe.pt``: a sparse UniRL payload that runs ``touch <marker>`` if unpickled."""
    return _unsafe(root, marker, "unsafe.pt", legacy=False)


def unsafe_legacy_pickle(root: Path, marker: Path) -> Built:
    """``unsafe_legacy.pt``: ``unsafe_pickle`` in the legacy (non-zip) serialization."""
    return _unsafe(root, marker, "unsafe_legacy.pt", legacy=True)


def with_pickle(path: Path, data_pkl: bytes) -> Path:
    """The torch file ``path`` rewritten with ``data_pkl`` in place of its pickle (its other records as they were)."""
    with zipfile.ZipFile(path) as original:
        records = [(info, original.read(info)) for info in original.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in records:
            archive.writestr(info, data_pkl if info.filename.endswith("/data.pkl") else data)
    return path


OUTSIDE_WEIGHTS_ONLY = {
    "POP": b"NN0",
    "POP_MARK": b"(N1N",
    "DUP": b"N2\x86",
    "MEMOIZE": b"N\x94",
    "FRAME": b"\x95" + struct.pack("<Q", 1) + b"N",
    "SHORT_BINUNICODE": b"\x8c\x01x",
    "LONG4": b"\x8b" + struct.pack("<I", 1) + b"\x05",
    "STACK_GLOBAL": b"X\x0b\x00\x00\x00collectionsX\x0b\x00\x00\x00OrderedDict\x93)R",
}
"""Opcodes that push one value, each using an opcode torch's weights-only unpickler does not implement."""


def with_opcode(path: Path, name: str) -> Path:
    """The torch file ``path`` with one more entry in its root dict, whose value is pickled with opcode ``name``
    (``OUTSIDE_WEIGHTS_ONLY``): ``pickle`` reads it, ``torch.load(weights_only=True)`` refuses it."""
    with zipfile.ZipFile(path) as archive:
        (pkl,) = (name for name in archive.namelist() if name.endswith("/data.pkl"))
        data = archive.read(pkl)
    assert data.endswith(b".")
    return with_pickle(path, data[:-1] + b"X\x05\x00\x00\x00extra" + OUTSIDE_WEIGHTS_ONLY[name] + b"s.")
