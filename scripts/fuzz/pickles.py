"""Opcode-level pickle mutations: extreme lengths and memo indices, deep nesting, memo "billion laughs"."""

from __future__ import annotations

import pickletools
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_INTS = (0, -1, 1, 255, 256, 2**15, 2**16, 2**20, 2**28, 2**31 - 1, -(2**31), 2**31, 2**32, 2**53 + 1, 2**62,
         2**63 - 1, -(2**63), 2**63, 2**64, 10**30, -(10**30))  # fmt: skip
_MEMO_INDICES = (0, 1, 255, 256, 2**20, 2**28, 2**31, 2**32 - 1)
_LENGTH_FIELDS = {"SHORT_BINUNICODE": 1, "BINUNICODE": 4, "BINUNICODE8": 8, "SHORT_BINBYTES": 1,
                  "BINBYTES": 4, "BINBYTES8": 8, "BYTEARRAY8": 8, "SHORT_BINSTRING": 1, "BINSTRING": 4, "LONG1": 1,
                  "LONG4": 4}  # fmt: skip
_INT_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"})
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING"})
_SCALAR_OPS = _INT_OPS | _STRING_OPS | {"NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT", "SHORT_BINSTRING",
                                        "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8"}  # fmt: skip
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_NO_ARG_CODES = tuple(op.code.encode("latin-1") for op in pickletools.opcodes if op.arg is None and op.code != ".")
_GLOBALS = (
    ("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "getattr"), ("subprocess", "Popen"),
    ("torch", "load"), ("torch", "__builtins__"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils",
    "_rebuild_parameter"), ("torch._utils", "_rebuild_qtensor"), ("torch._utils", "_rebuild_sparse_tensor"),
    ("torch._utils", "_rebuild_wrapper_subclass"), ("torch._tensor", "_rebuild_from_type_v2"), ("torch",
    "FloatStorage"), ("torch", "BFloat16Storage"), ("torch", "UntypedStorage"), ("torch", "Tensor"), ("torch",
    "Size"), ("torch", "device"), ("torch", "strided"), ("torch", "float64"), ("torch", "complex32"), ("torch",
    "uint64"), ("torch", "float8_e4m3fn"), ("collections", "OrderedDict"), ("builtins", "set"), ("__builtin__",
    "set"), ("builtins", "bytearray"), ("copy_reg", "_reconstructor"), ("numpy.core.multiarray", "_reconstruct"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("torch.distributed.checkpoint.metadata",
    "Metadata"), ("torch.distributed.checkpoint.metadata", "MetadataIndex"), ("torch.distributed.checkpoint."
    "metadata", "TensorStorageMetadata"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)  # fmt: skip


@dataclass(frozen=True)
class Op:
    """One opcode of a pickle and the bytes it spans."""

    name: str
    arg: Any
    start: int
    end: int


def pickle_ops(data: bytes) -> list[Op]:
    """The opcodes of the pickle at the start of ``data`` whose extent is known (all of them, up to STOP)."""
    found: list[tuple[str, Any, int]] = []
    try:
        for opcode, arg, pos in pickletools.genops(data):
            found.append((opcode.name, arg, pos if pos is not None else 0))
    except Exception:  # a damaged pickle: keep what parsed
        found = found[:-1]
    ops = []
    for index, (name, arg, pos) in enumerate(found):
        end = found[index + 1][2] if index + 1 < len(found) else pos + 1
        if index + 1 < len(found) or name == "STOP":
            ops.append(Op(name, arg, pos, end))
    return ops


def _enc_int(value: int) -> bytes:
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw if len(raw) < 256 else b"\x8b" + struct.pack("<i", len(raw)) + raw


def _enc_put(index: int) -> bytes:
    if index < 256:
        return b"q" + bytes([index])
    return b"r" + struct.pack("<I", index) if index < 2**32 else b"p%d\n" % index


def _enc_get(index: int) -> bytes:
    if index < 256:
        return b"h" + bytes([index])
    return b"j" + struct.pack("<I", index) if index < 2**32 else b"g%d\n" % index


def _enc_str(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def _laughs(base: int, depth: int, container: str) -> bytes:
    """A tuple (or list) of two references to a tuple of two references to ... ``depth`` levels: 2**depth leaves."""
    out = (b")" if container == "tuple" else b"]") + _enc_put(base)
    for level in range(1, depth + 1):
        ref = _enc_get(base + level - 1)
        out += (ref + ref + b"\x86" if container == "tuple" else b"(" + ref + ref + b"l") + _enc_put(base + level)
    return out


def _memo_base(rng: random.Random, ops: Sequence[Op], position: int) -> int:
    """A memo index for inserted entries: at the opcode count (plausible), or above every index in use."""
    if rng.random() < 0.5:
        return position
    used = [op.arg for op in ops if op.name in _PUT_OPS | _GET_OPS and isinstance(op.arg, int)]
    return max(used, default=0) + 1


def _value_push(rng: random.Random, ops: Sequence[Op]) -> int | None:
    """The index of an opcode that pushes one plain value (a dict key, more often than not)."""
    strings = [i for i, op in enumerate(ops) if op.name in _STRING_OPS]
    scalars = [i for i, op in enumerate(ops) if op.name in _SCALAR_OPS]
    pool = strings if strings and rng.random() < 0.6 else scalars
    return rng.choice(pool) if pool else None


def _replace(data: bytes, op: Op, new: bytes) -> bytes:
    return data[: op.start] + new + data[op.end :]


def _pickle_value(rng: random.Random, data: bytes, ops: list[Op], kind: str) -> tuple[bytes, str] | None:
    """Replace one plain value with something built to hurt: deep, exponential or self-referencing."""
    index = _value_push(rng, ops)
    if index is None:
        return None
    op = ops[index]
    if kind == "deep-tuple":
        depth = rng.choice((150, 250, 1000, 10_000, 100_000))
        new = b")" + b"\x85" * depth if rng.random() < 0.7 else b"(" * depth + b")" + b"t" * depth
    elif kind == "deep-list":
        depth = rng.choice((1000, 10_000, 100_000))
        new = b"]" * depth + b"a" * (depth - 1) if rng.random() < 0.5 else b"}" + b"K\x00}" * depth + b"s" * depth
    elif kind in ("laughs-tuple", "laughs-list"):
        depth = rng.choice((16, 24, 32, 48, 64))
        new = _laughs(_memo_base(rng, ops, index), depth, kind.partition("-")[2])
    elif kind == "self-reference":
        base = _memo_base(rng, ops, index)
        new = (
            b"]" + _enc_put(base) + _enc_get(base) + b"a"
            if rng.random() < 0.5
            else b"}" + _enc_put(base) + b"K\x00" + _enc_get(base) + b"s"
        )
    else:  # type confusion: another plain value in its place
        choices = [b"N", b"\x88", b"\x89", _enc_int(rng.choice(_INTS)), b"G" + struct.pack(">d", float("nan")),
                   b"G" + struct.pack(">d", 1e308), _enc_str(""), _enc_str("x" * rng.choice((1, 300, 70_000))),
                   _enc_str("\udcff"), b"C\x00", b"}", b"]", b")", b"\x8f"]  # fmt: skip
        new = rng.choice(choices)
    return _replace(data, op, new), f"{kind} at op {index} ({op.name} {str(op.arg)[:40]!r}), {len(new)} bytes"


def _pickle_field(rng: random.Random, data: bytes, ops: list[Op], kind: str) -> tuple[bytes, str] | None:
    """Give one opcode's argument an extreme value: an integer, a memo index, a length, a protocol, a frame size."""
    if kind == "int":
        pool = [i for i, op in enumerate(ops) if op.name in _INT_OPS]
        if not pool:
            return None
        index = rng.choice(pool)
        original = ops[index].arg if isinstance(ops[index].arg, int) else 0
        value = rng.choice([*_INTS, original + 1, original - 1, original * 2**20, -original])
        return _replace(data, ops[index], _enc_int(value)), f"int at op {index}: {original} -> {value}"
    if kind == "memo":
        pool = [i for i, op in enumerate(ops) if op.name in _PUT_OPS | _GET_OPS]
        if not pool:
            return None
        index = rng.choice(pool)
        op = ops[index]
        original = op.arg if isinstance(op.arg, int) else 0
        value = rng.choice([*_MEMO_INDICES, original + 1, original + 10**6, 2**40])
        new = _enc_put(value) if op.name in _PUT_OPS else _enc_get(value)
        return _replace(data, op, new), f"memo at op {index} ({op.name}): {original} -> {value}"
    if kind == "length":
        sized = [op for op in ops if op.name in _LENGTH_FIELDS]
        if not sized:
            return None
        op = rng.choice(sized)
        width = _LENGTH_FIELDS[op.name]
        original = int.from_bytes(data[op.start + 1 : op.start + 1 + width], "little")
        top = 2 ** (8 * width)
        value = rng.choice([0, 1, original - 1, original + 1, original * 2, top - 1, top // 2 - 1, top // 2]) % top
        new = data[op.start : op.start + 1] + value.to_bytes(width, "little") + data[op.start + 1 + width : op.end]
        return _replace(data, op, new), f"length of {op.name} at {op.start}: {original} -> {value}"
    if kind == "proto":
        protos = [op for op in ops if op.name == "PROTO"]
        if not protos:
            return None
        value = rng.choice((0, 1, 2, 3, 4, 5, 6, 0x7F, 0xFF))
        return _replace(data, protos[0], b"\x80" + bytes([value])), f"protocol -> {value}"
    if kind == "frame":
        frames = [op for op in ops if op.name == "FRAME"]
        if not frames:
            return None
        op = rng.choice(frames)
        original = op.arg if isinstance(op.arg, int) else 0
        value = rng.choice((0, 1, original - 1, original + 1, original * 2, 2**63 - 1, 2**64 - 1)) % 2**64
        return _replace(data, op, b"\x95" + struct.pack("<Q", value)), f"frame at {op.start}: {original} -> {value}"
    if kind == "global":
        pool = [i for i, op in enumerate(ops) if op.name in ("GLOBAL", "STACK_GLOBAL", "INST")]
        if not pool:
            return None
        index = rng.choice(pool)
        module, name = rng.choice(_GLOBALS)
        text = f"{module}\n{name}\n".encode()
        new = b"c" + text if ops[index].name != "STACK_GLOBAL" else b"00c" + text
        return _replace(data, ops[index], new), f"global at op {index} ({ops[index].arg}) -> {module}.{name}"
    return None


def _pickle_stream(rng: random.Random, data: bytes, ops: list[Op], kind: str) -> tuple[bytes, str] | None:
    """Change the opcode stream: swap, replace, drop, duplicate or cut opcodes."""
    body = [i for i, op in enumerate(ops) if op.name != "STOP"]
    if not body:
        return None
    index = rng.choice(body)
    op = ops[index]
    if kind == "swap-ops":
        other = ops[index + 1] if rng.random() < 0.6 and index + 1 < len(ops) - 1 else ops[rng.choice(body)]
        first, second = sorted((op, other), key=lambda o: o.start)
        if first is second:
            return None
        swapped = (
            data[: first.start] + data[second.start : second.end] + data[first.end : second.start]
            + data[first.start : first.end] + data[second.end :]
        )  # fmt: skip
        return swapped, f"swapped op {first.name}@{first.start} with {second.name}@{second.start}"
    if kind == "replace-op":
        pool = [i for i in body if ops[i].end - ops[i].start == 1]
        if not pool:
            return None
        op = ops[rng.choice(pool)]
        code = rng.choice(_NO_ARG_CODES)
        return _replace(data, op, code), f"{op.name}@{op.start} -> {code!r}"
    if kind == "drop-op":
        return _replace(data, op, b""), f"dropped {op.name}@{op.start}"
    if kind == "dup-op":
        span = data[op.start : op.end]
        return _replace(data, op, span * rng.choice((2, 3, 1000))), f"repeated {op.name}@{op.start}"
    if kind == "cut-ops":
        return data[: op.start] + (b"." if rng.random() < 0.5 else b""), f"cut at {op.name}@{op.start}"
    return None


PICKLE_KINDS: dict[str, Callable[[random.Random, bytes, list[Op], str], tuple[bytes, str] | None]] = {
    **{k: _pickle_field for k in ("int", "memo", "length", "proto", "frame", "global")},
    **{k: _pickle_value for k in ("deep-tuple", "deep-list", "laughs-tuple", "laughs-list", "self-reference", "type")},
    **{k: _pickle_stream for k in ("swap-ops", "replace-op", "drop-op", "dup-op", "cut-ops")},
}


def mutate_pickle(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One opcode-level mutation of the pickle at the start of ``data`` (bytes after its STOP are kept)."""
    ops = pickle_ops(data)
    kinds = list(PICKLE_KINDS)
    rng.shuffle(kinds)
    for kind in kinds:
        if not ops:
            break
        done = PICKLE_KINDS[kind](rng, data, ops, kind)
        if done is not None:
            return done[0], f"pickle {done[1]}"
    position = rng.randrange(max(len(data), 1))
    return data[:position] + bytes([rng.randrange(256)]) + data[position + 1 :], f"pickle byte {position}"
