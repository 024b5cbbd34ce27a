"""Hand-crafted hostile and damaged inputs, each the smallest that showed a class of failure.

Every builder writes under a directory it is given and returns what to point the tool at. Pickles
are written opcode by opcode (``pickle`` itself would refuse to produce most of them).
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

PROTO2 = b"\x80\x02"


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
        PROTO2 + b"}" + b"\x8c\x05state" + b"}" + key_ops + b"}" + b"s" + b"s"
        + b"\x8c\x0cparam_groups" + b"]" + b"s."
    )  # fmt: skip


def optimizer_with_param(param_ops: bytes) -> bytes:
    """A pickle of ``{"state": {}, "param_groups": [{"params": [PARAM]}]}``, the param given as opcodes."""
    return (
        PROTO2 + b"}" + b"\x8c\x05state" + b"}" + b"s"
        + b"\x8c\x0cparam_groups" + b"]" + b"}" + b"\x8c\x06params" + b"]" + param_ops + b"a" + b"s" + b"a" + b"s."
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
