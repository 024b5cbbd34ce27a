"""A mutation fuzzer for optim-repair's readers and writer: real checkpoints, mutated, run in a supervised worker.

Builds real seed checkpoints once with the test factories (zip and legacy torch files, name- and
index-keyed optimizers, DCP directories, whole checkpoint directories), then derives each case's
mutated input from ``(seed, case index)`` alone: byte flips, truncation, splicing, pickle opcode edits
(extreme lengths and memo indices, deep nesting, memo "billion laughs"), zip header and member edits,
DCP ``.metadata`` edits, and links, FIFOs and loops in place of files. A long-lived worker, forked
from a forkserver that has torch and optim_repair loaded, runs ``optim_repair.inspect`` on each case
(and every ``--fix-every``'th case ``optim_repair.fix``) under resource limits and an audit hook that
records every file touched outside the case's input and output directories:

    python scripts/fuzz.py --cases 20000 --seed 0 --out /tmp/fuzz-findings

A case ends ``ok``, ``error-<exit code>`` (an ``OptimRepairError`` with a one-line message), or in
findings: any other exception, a multi-line message, a signal, a hang, a memory blowup, a file outside
the input read or written, the input changed, output left behind by a failed fix. Each finding is
saved under ``--out`` (the mutated input and a ``case.json``); ``--only INDEX`` replays one case,
``--corpus DIR`` keeps the seeds so that cases replay bit for bit in a later run. Exit status 0 without
findings, 1 with. ``run()`` is the same, importable, for a fast slice in a test.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import errno
import faulthandler
import gc
import hashlib
import io
import json
import multiprocessing
import os
import pickle
import pickletools
import random
import re
import resource
import shutil
import signal
import site
import stat
import struct
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXIT_CODES = (2, 3, 4, 5)
"""The exit codes of documented errors (``optim_repair.errors.ExitCode``: usage, malformed, input, output)."""
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
POLL_S = 0.02
"""How often the supervisor looks at a busy worker's memory."""
SLOW_TIMEOUT_S = 2.0
"""The timeout for a mutator once it has used up its ``--hang-budget``."""
LOG_LIMIT = 1 << 20
OUTCOMES = ("ok", *(f"error-{code}" for code in EXIT_CODES), "finding")


# --------------------------------------------------------------------------- inputs as trees


@dataclass(frozen=True)
class Link:
    """A symbolic link to ``target``."""

    target: str


@dataclass(frozen=True)
class Fifo:
    """A named pipe: opening it for reading blocks until a writer comes."""


@dataclass(frozen=True)
class Dir:
    """A directory (its contents are the entries below it)."""


Node = bytes | Link | Fifo | Dir
Tree = dict[str, Node]
"""A case's input directory: path relative to it (``/`` separators) -> what lies there."""


@dataclass(frozen=True)
class Seed:
    """One real checkpoint: ``arg`` (a file or directory under the tree's root) is what the tool is given."""

    name: str
    kind: str
    """``zip``, ``legacy``, ``dcp`` or ``directory``."""
    arg: str
    tree: Mapping[str, Node]


def materialize(tree: Mapping[str, Node], root: Path) -> None:
    """Create ``tree`` under the (new or empty) directory ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for rel in sorted(tree):
        node, path = tree[rel], root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(node, bytes):
            path.write_bytes(node)
        elif isinstance(node, Dir):
            path.mkdir(exist_ok=True)
        elif isinstance(node, Link):
            os.symlink(node.target, path)
        else:
            os.mkfifo(path)


def read_tree(root: Path) -> Tree:
    """The tree under ``root``, links and FIFOs as such."""
    tree: Tree = {}
    for current, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(current, name)
            rel = path.relative_to(root).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                tree[rel] = Link(os.readlink(path))
            elif stat.S_ISDIR(mode):
                tree[rel] = Dir()
            elif stat.S_ISFIFO(mode):
                tree[rel] = Fifo()
            else:
                tree[rel] = path.read_bytes()
    return tree


Snapshot = dict[str, tuple[Any, ...]]


def snapshot(root: Path) -> Snapshot:
    """Every entry under ``root`` (and ``root``) with its type, mode, size, mtime and content hash; no link followed."""
    found: Snapshot = {}
    for current, dirs, files in os.walk(root):
        for name in ["", *dirs, *files] if current == str(root) else [*dirs, *files]:
            path = os.path.join(current, name) if name else current
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as stream:
                    digest = hashlib.blake2b(stream.read(), digest_size=16).hexdigest()
                found[rel] = ("file", st.st_mode, st.st_size, st.st_mtime_ns, digest)
            elif stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", st.st_mode, st.st_mtime_ns)
            else:
                found[rel] = ("special", st.st_mode, st.st_mtime_ns)
    return found


def _differences(before: Snapshot, after: Snapshot) -> list[str]:
    changed = [f"{rel}: {before[rel]} -> {after.get(rel, 'gone')}" for rel in before if before[rel] != after.get(rel)]
    return changed + [f"{rel}: new {after[rel]}" for rel in after if rel not in before]


# --------------------------------------------------------------------------- the seed corpus


def _seed_specs() -> list[tuple[str, str, Callable[[Path], Path]]]:
    """(name, kind, build) of every seed; ``build`` writes into a directory and returns what to give the tool."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests import checkpoints as ck
    from tests import dcp_checkpoints as dk

    def dcp_parent(root: Path) -> Path:
        run_dir = root / "run"
        dk.unirl_dcp(run_dir)
        (run_dir / "trainer_state.json").write_text('{"global_step": 3}\n')
        return run_dir

    return [
        ("unirl_torch.pt", "zip", lambda root: ck.unirl_torch(root).path / "checkpoint.pt"),
        ("hf_optimizer.pt", "zip", lambda root: ck.hf_trainer(root).path / "optimizer.pt"),
        ("lightning.ckpt", "zip", lambda root: ck.lightning(root).path),
        ("tricky_tensors.pt", "zip", lambda root: ck.tricky_tensors(root).path),
        ("multi_optimizer.pt", "zip", lambda root: ck.multi_optimizer(root).path),
        ("legacy.pt", "legacy", lambda root: ck.legacy_format(root).path),
        ("unirl_torch_legacy.pt", "legacy", lambda root: ck.unirl_torch(root, legacy=True).path / "checkpoint.pt"),
        ("unirl_dcp", "dcp", lambda root: dk.unirl_dcp(root).path),
        ("torchtitan_dcp", "dcp", lambda root: dk.torchtitan_dcp(root).path),
        ("sharded_dcp", "dcp", lambda root: dk.sharded_dcp(root).path),
        ("hf_trainer", "directory", lambda root: ck.hf_trainer(root).path),
        ("unirl_torch_dir", "directory", lambda root: ck.unirl_torch(root).path),
        ("accelerate", "directory", lambda root: ck.accelerate(root).path),
        ("dcp_parent", "directory", dcp_parent),
    ]


def import_torch() -> Any:
    """torch, and the DCP classes a ``.metadata`` pickle names, imported without torch's NumPy warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import torch.distributed.checkpoint.filesystem
        import torch.distributed.checkpoint.metadata

    return torch


def build_corpus(corpus: Path) -> None:
    """Write every seed under ``corpus/seeds/<name>/`` and a ``manifest.json``, with real torch."""
    torch = import_torch()

    manifest = []
    scratch = corpus / "scratch"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, kind, build in _seed_specs():
            random.seed(0)
            torch.manual_seed(0)
            try:
                built = build(scratch / name)
            except Exception as exc:  # a factory this torch cannot run (sharded DCP needs a fake process group)
                print(f"[fuzz] skipped seed {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            target = corpus / "seeds" / name / built.name
            target.parent.mkdir(parents=True)
            if built.is_dir():
                shutil.copytree(built, target, symlinks=True)
            else:
                shutil.copyfile(built, target)
            manifest.append({"name": name, "kind": kind, "arg": built.name})
    shutil.rmtree(scratch, ignore_errors=True)
    (corpus / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def load_corpus(corpus: Path) -> list[Seed]:
    """The seeds of a corpus ``build_corpus`` wrote, in memory."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    return [Seed(s["name"], s["kind"], s["arg"], read_tree(corpus / "seeds" / s["name"])) for s in manifest]


def corpus_digest(seeds: Sequence[Seed]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for seed in seeds:
        for rel in sorted(seed.tree):
            node = seed.tree[rel]
            digest.update(f"{seed.name}/{rel}\0".encode())
            digest.update(node if isinstance(node, bytes) else repr(node).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Outside:
    """Files outside every case's input, that mutations link to: reading them is a finding."""

    root: Path
    by_suffix: Mapping[str, str]
    """A suffix (``.pt``, ``.metadata``, ...) -> the absolute path of a real file of that kind."""
    directory: str
    """A real DCP checkpoint directory outside the input."""


def make_outside(seeds: Sequence[Seed], root: Path) -> Outside:
    root.mkdir(parents=True, exist_ok=True)
    by_suffix: dict[str, str] = {}
    for seed in seeds:
        for rel, node in seed.tree.items():
            suffix = ".metadata" if rel.endswith("/.metadata") else Path(rel).suffix
            if isinstance(node, bytes) and suffix and suffix not in by_suffix:
                path = root / f"victim{suffix}"
                path.write_bytes(node)
                by_suffix[suffix] = str(path)
    dcp = next(seed for seed in seeds if seed.kind == "dcp")
    materialize({rel: node for rel, node in dcp.tree.items()}, root / "dcp")
    return Outside(root, by_suffix, str(root / "dcp" / dcp.arg))


# --------------------------------------------------------------------------- pickle opcode mutations

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


# --------------------------------------------------------------------------- byte mutations

_BYTE_VALUES = (b"\x00", b"\xff", b"\x7f", b"\x80", b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80", b"\xff" * 8,
                b"\xff\xff\xff\xff\xff\xff\xff\x7f", b"PK\x03\x04", b"PK\x05\x06", b".", b"\x80\x02")  # fmt: skip


def flip(rng: random.Random, data: bytes, donor: bytes) -> tuple[bytes, str]:
    buf = bytearray(data or b"\0")
    spots = [rng.randrange(len(buf)) for _ in range(rng.choice((1, 1, 2, 4, 8)))]
    for spot in spots:
        buf[spot] ^= 1 << rng.randrange(8)
    return bytes(buf), f"flipped bits at {spots}"


def overwrite(rng: random.Random, data: bytes, donor: bytes) -> tuple[bytes, str]:
    at = rng.randrange(max(len(data), 1))
    new = rng.choice(_BYTE_VALUES) if rng.random() < 0.5 else rng.randbytes(rng.randint(1, 16))
    return data[:at] + new + data[at + len(new) :], f"overwrote {len(new)} bytes at {at}"


def truncate(rng: random.Random, data: bytes, donor: bytes) -> tuple[bytes, str]:
    size = len(data)
    at = rng.choice((0, 1, size // 2, max(size - 1, 0), max(size - 22, 0), rng.randrange(size + 1)))
    return data[:at], f"truncated {size} -> {at}"


def splice(rng: random.Random, data: bytes, donor: bytes) -> tuple[bytes, str]:
    at, start = rng.randrange(len(data) + 1), rng.randrange(len(donor) + 1)
    length = rng.randint(1, max(len(donor) - start, 1))
    if rng.random() < 0.5:  # the donor's tail for ours
        return data[:at] + donor[start:], f"spliced donor[{start}:] at {at}"
    return data[:at] + donor[start : start + length] + data[at + length :], f"spliced {length} donor bytes at {at}"


def insert(rng: random.Random, data: bytes, donor: bytes) -> tuple[bytes, str]:
    at = rng.randrange(len(data) + 1)
    length = rng.choice((1, 4, 64, 4096))
    choice = rng.randrange(3)
    run = rng.randbytes(length) if choice == 0 else bytes([rng.randrange(256)]) * length if choice == 1 else None
    if run is None:
        start = rng.randrange(len(data) + 1)
        run = data[start : start + length]
    return data[:at] + run + data[at:], f"inserted {len(run)} bytes at {at}"


def delete(rng: random.Random, data: bytes, donor: bytes) -> tuple[bytes, str]:
    at = rng.randrange(len(data) + 1)
    length = rng.choice((1, 4, 64, 4096))
    return data[:at] + data[at + length :], f"deleted {length} bytes at {at}"


BYTE_MUTATORS: dict[str, Callable[[random.Random, bytes, bytes], tuple[bytes, str]]] = {
    "flip": flip,
    "overwrite": overwrite,
    "truncate": truncate,
    "splice": splice,
    "insert": insert,
    "delete": delete,
}


# --------------------------------------------------------------------------- zip archives

_LOCAL_FIELDS = {"version": (4, 2), "flags": (6, 2), "method": (8, 2), "crc": (14, 4), "compressed": (18, 4),
                 "size": (22, 4), "name_length": (26, 2), "extra_length": (28, 2)}  # fmt: skip
_CENTRAL_FIELDS = {"version": (6, 2), "flags": (8, 2), "method": (10, 2), "crc": (16, 4), "compressed": (20, 4),
                   "size": (24, 4), "name_length": (28, 2), "extra_length": (30, 2), "comment_length": (32, 2),
                   "disk": (34, 2), "external": (38, 4), "offset": (42, 4)}  # fmt: skip
_END_FIELDS = {"disk": (4, 2), "cd_disk": (6, 2), "entries_disk": (8, 2), "entries": (10, 2), "cd_size": (12, 4),
               "cd_offset": (16, 4), "comment_length": (20, 2)}  # fmt: skip
_METHODS = (0, 1, 8, 9, 12, 14, 93, 95, 98, 99, 0xFFFF)


def zip_records(data: bytes) -> list[tuple[str, int, int]]:
    """(record type, offset, fixed size) of the end record, every central header and every local header."""
    end = data.rfind(b"PK\x05\x06")
    if end < 0 or end + 22 > len(data):
        return []
    records = [("end", end, 22)]
    count, cd_offset = struct.unpack_from("<H", data, end + 10)[0], struct.unpack_from("<I", data, end + 16)[0]
    position = cd_offset
    for _ in range(count):
        if data[position : position + 4] != b"PK\x01\x02" or position + 46 > len(data):
            break
        records.append(("central", position, 46))
        local = struct.unpack_from("<I", data, position + 42)[0]
        if data[local : local + 4] == b"PK\x03\x04":
            records.append(("local", local, 30))
        lengths = struct.unpack_from("<HHH", data, position + 28)
        position += 46 + sum(lengths)
    return records


def zip_header(rng: random.Random, data: bytes) -> tuple[bytes, str] | None:
    """Set one field of a zip record (local header, central header, end record) to an extreme value."""
    records = zip_records(data)
    if not records:
        return None
    kind, offset, size = rng.choice(records)
    if rng.random() < 0.15 and kind != "end":  # a byte of the name
        name_at = offset + size + rng.randrange(4)
        if name_at >= len(data):
            return None
        new = rng.choice((b"/", b"\x00", b".", b"\\", b"\xff"))
        return data[:name_at] + new + data[name_at + 1 :], f"zip {kind}@{offset} name byte -> {new!r}"
    fields = {"local": _LOCAL_FIELDS, "central": _CENTRAL_FIELDS, "end": _END_FIELDS}[kind]
    name = rng.choice(sorted(fields))
    at, width = fields[name]
    original = int.from_bytes(data[offset + at : offset + at + width], "little")
    top = 2 ** (8 * width)
    if name == "method":
        value = rng.choice(_METHODS)
    elif name == "flags":
        value = original ^ (1 << rng.choice((0, 1, 3, 6, 11, 13)))
    else:
        value = rng.choice((0, 1, top - 1, top - 2, top // 2, original + 1, original - 1, original * 2,
                            rng.randrange(top)))  # fmt: skip
    value %= top
    new = data[: offset + at] + value.to_bytes(width, "little") + data[offset + at + width :]
    return new, f"zip {kind}@{offset} {name}: {original} -> {value}"


def zip_members(data: bytes) -> list[tuple[str, bytes, int]] | None:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return [(info.filename, archive.read(info), info.compress_type) for info in archive.infolist()]
    except Exception:  # not a readable archive
        return None


def write_zip(members: Iterable[tuple[str, bytes, int]], *, zip64: bool = False, comment: bytes = b"") -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are the point
        with zipfile.ZipFile(buffer, "w", allowZip64=True) as archive:
            for name, payload, method in members:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = method
                with archive.open(info, "w", force_zip64=zip64) as stream:
                    stream.write(payload)
            archive.comment = comment
    return buffer.getvalue()


def _pickle_member(members: Sequence[tuple[str, bytes, int]]) -> int | None:
    return next((i for i, (name, _, _) in enumerate(members) if name.endswith("data.pkl")), None)


def zip_pickle(rng: random.Random, data: bytes) -> tuple[bytes, str] | None:
    """Mutate the archive's ``data.pkl`` at the opcode level and write the archive again, CRCs right."""
    members = zip_members(data)
    index = None if members is None else _pickle_member(members)
    if members is None or index is None:
        return None
    name, payload, method = members[index]
    mutated, note = mutate_pickle(rng, payload)
    members[index] = (name, mutated, method)
    return write_zip(members), note


def zip_rewrite(rng: random.Random, data: bytes) -> tuple[bytes, str] | None:
    """Write the archive again with a member compressed, duplicated, dropped, renamed or moved."""
    members = zip_members(data)
    if not members:
        return None
    pkl = _pickle_member(members)
    index = pkl if pkl is not None and rng.random() < 0.4 else rng.randrange(len(members))
    name, payload, method = members[index]
    action = rng.choice(("deflate", "deflate", "bzip2", "lzma", "duplicate", "drop", "rename", "second-prefix",
                         "reorder", "zip64", "comment"))  # fmt: skip
    zip64, comment = False, b""
    if action in ("deflate", "bzip2", "lzma"):
        methods = {"deflate": zipfile.ZIP_DEFLATED, "bzip2": zipfile.ZIP_BZIP2, "lzma": zipfile.ZIP_LZMA}
        members[index] = (name, payload, methods[action])
    elif action == "duplicate":
        other = rng.randrange(len(members))
        copy_payload = mutate_pickle(rng, payload)[0] if name.endswith("data.pkl") and rng.random() < 0.5 else payload
        if rng.random() < 0.5:
            members.insert(rng.randrange(len(members) + 1), (name, copy_payload, method))
        else:
            members[other] = (name, members[other][1], members[other][2])
    elif action == "drop":
        del members[index]
    elif action == "rename":
        new = rng.choice((name + "0", name.replace("/", "//"), "/" + name, "../" + name, name.replace("/", "\\"),
                          name.upper(), name[:-1], "x/" + name.partition("/")[2], name + "/"))  # fmt: skip
        members[index] = (new, payload, method)
        name = f"{name} -> {new}"
    elif action == "second-prefix":
        members.insert(0, ("other/" + name.partition("/")[2], mutate_pickle(rng, payload)[0], method))
    elif action == "reorder":
        rng.shuffle(members)
    elif action == "zip64":
        zip64 = True
    else:
        comment = rng.randbytes(rng.choice((1, 100, 65535)))
    return write_zip(members, zip64=zip64, comment=comment), f"zip rewrite {action} {name}"


# --------------------------------------------------------------------------- legacy files, safetensors

_LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)


def legacy_pickles(data: bytes) -> list[tuple[int, int]] | None:
    """The byte ranges of a legacy torch file's five pickles."""
    stream = io.BytesIO(data)
    spans = []
    try:
        for _ in range(5):
            start = stream.tell()
            for _op in pickletools.genops(stream):
                pass
            spans.append((start, stream.tell()))
    except Exception:  # not (any more) a legacy file
        return None
    return spans


def legacy_pickle(rng: random.Random, data: bytes) -> tuple[bytes, str] | None:
    spans = legacy_pickles(data)
    if spans is None:
        return None
    which = rng.choices(range(5), weights=(1, 1, 1, 6, 3))[0]
    start, end = spans[which]
    mutated, note = mutate_pickle(rng, data[start:end])
    return data[:start] + mutated + data[end:], f"legacy pickle {which}: {note}"


def legacy_numel(rng: random.Random, data: bytes) -> tuple[bytes, str] | None:
    spans = legacy_pickles(data)
    if spans is None or spans[4][1] + 8 > len(data):
        return None
    at = spans[4][1]
    original = struct.unpack_from("<q", data, at)[0]
    value = rng.choice((0, -1, 1, original + 1, original - 1, 2**62, -(2**63), 2**63 - 1))
    return data[:at] + struct.pack("<q", value) + data[at + 8 :], f"legacy first numel {original} -> {value}"


def safetensors_edit(rng: random.Random, data: bytes) -> tuple[bytes, str] | None:
    """Edit a safetensors header: its length, or a tensor's dtype, shape or offsets, or nest it deeply."""
    if len(data) < 8:
        return None
    length = struct.unpack_from("<Q", data)[0]
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError:
        return None
    names = [key for key in header if key != "__metadata__"] if isinstance(header, dict) else []
    action = rng.choice(("length", "dtype", "shape", "offsets", "deep", "metadata"))
    if action == "length":
        value = rng.choice((0, 1, length - 1, length + 1, len(data), 2**63, 2**64 - 1, 100_000_000))
        return struct.pack("<Q", value) + data[8:], f"safetensors header length {length} -> {value}"
    if action == "deep":
        depth = rng.choice((1000, 100_000))
        text = b"[" * depth + b"]" * depth
    else:
        if not names:
            return None
        entry = header[rng.choice(names)]
        if action == "dtype":
            entry["dtype"] = rng.choice(("F8_E4M3", "X", "", 1, None, "F64", "U64", "BOOL"))
        elif action == "shape":
            entry["shape"] = rng.choice(([2**62, 2**62], [-1], [], "3", [1.5], [0], [10**12]))
        elif action == "offsets":
            entry["data_offsets"] = rng.choice(([0, 2**63], [-1, 0], [5, 2], [0], None, [0, 10**12]))
        else:
            header["__metadata__"] = rng.choice(({"format": 1}, [], "x", {"a": {"b": 1}}))
        text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + length :], f"safetensors {action}"


# --------------------------------------------------------------------------- DCP metadata

_ZSTD_BOMB: dict[int, bytes] = {}


def zstd_bomb(size: int) -> bytes | None:
    """A zstd stream of ``size`` zero bytes (a few dozen KiB), made once."""
    if size not in _ZSTD_BOMB:
        try:
            import zstandard
        except ImportError:
            return None
        compressor = zstandard.ZstdCompressor(level=1).compressobj()
        chunk, parts = bytes(1 << 20), []
        for _ in range(size >> 20):
            parts.append(compressor.compress(chunk))
        parts.append(compressor.flush())
        _ZSTD_BOMB[size] = b"".join(parts)
    return _ZSTD_BOMB[size]


def zstd(data: bytes) -> bytes | None:
    try:
        import zstandard
    except ImportError:
        return None
    return bytes(zstandard.ZstdCompressor().compress(data))


def _dcp_classes() -> Any:
    return import_torch().distributed.checkpoint.metadata


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclass
class MutationContext:
    """What a mutator works on: the case's tree (a copy of the seed's), its random source, and what it can use."""

    rng: random.Random
    seed: Seed
    tree: Tree
    corpus: Sequence[Seed]
    outside: Outside
    notes: list[str] = field(default_factory=list)

    def files(self, predicate: Callable[[str, bytes], bool] = lambda rel, data: True) -> list[str]:
        return sorted(rel for rel, node in self.tree.items() if isinstance(node, bytes) and predicate(rel, node))

    def pick(self, rels: Sequence[str]) -> str:
        weights = [4 if rel.endswith((*TORCH_SUFFIXES, ".metadata", ".distcp", ".safetensors")) else 1 for rel in rels]
        return self.rng.choices(rels, weights=weights)[0]

    def data(self, rel: str) -> bytes:
        node = self.tree[rel]
        assert isinstance(node, bytes)
        return node

    def dcp_dirs(self) -> list[str]:
        return sorted(rel.rpartition("/")[0] for rel in self.files(lambda rel, data: rel.endswith("/.metadata")))

    def outside_for(self, rel: str) -> str:
        suffix = ".metadata" if rel.endswith(".metadata") else Path(rel).suffix
        return self.outside.by_suffix.get(suffix, self.outside.by_suffix.get(".pt", "/etc/hostname"))


_REL_PATHS = ("../outside.distcp", "/dev/zero", "/etc/hostname", "nonexistent.distcp", "", ".", "..", ".metadata",
              "sub/../__0_0.distcp", "./__0_0.distcp", "__0_0.distcp\x00x", "a\\b", "__0_0.distcp/",
              "//__0_0.distcp", None, 7, b"__0_0.distcp", "link.distcp", "fifo.distcp", "devzero.distcp",
              "loop.distcp", "dir.distcp")  # fmt: skip
_TRANSFORMS: tuple[Any, ...] = (["stream.zstd/1"], ["stream.zstd/2"], ["stream.zstd"], ["bogus/1"], "stream.zstd/1",
                                [None], ["stream.zstd/1", "stream.zstd/1"], [], None, ["stream.zstd/1.5"],
                                [7])  # fmt: skip


def _special_member(ctx: MutationContext, directory: str, name: Any) -> None:
    """Make the file a mutated ``relative_path`` names, when it names one of the special members."""
    target = f"{directory}/{name}"
    if name == "link.distcp":
        ctx.tree[target] = Link(ctx.outside.by_suffix.get(".distcp", "/etc/hostname"))
    elif name == "fifo.distcp":
        ctx.tree[target] = Fifo()
    elif name == "devzero.distcp":
        ctx.tree[target] = Link("/dev/zero")
    elif name == "loop.distcp":
        ctx.tree[target] = Link("loop.distcp")
    elif name == "dir.distcp":
        ctx.tree[target] = Dir()


def _edit_storage(ctx: MutationContext, meta: Any, directory: str) -> str:
    rng = ctx.rng
    key = rng.choice(list(meta.storage_data))
    info = meta.storage_data[key]
    shard = ctx.tree.get(f"{directory}/{info.relative_path}")
    size = len(shard) if isinstance(shard, bytes) else 0
    name = rng.choice(("relative_path", "offset", "length", "transform_descriptors"))
    value: Any
    if name == "relative_path":
        value = rng.choice([*_REL_PATHS, ctx.outside.by_suffix.get(".distcp", "/etc/hostname")])
        _special_member(ctx, directory, value)
    elif name == "offset":
        value = rng.choice((-1, -(2**63), 2**31, 2**32, 2**63 - 1, 2**64, size, size - 1, size + 1,
                            rng.randrange(size + 1), None, "0", 1.5, True))  # fmt: skip
    elif name == "length":
        value = rng.choice((-1, 0, 1, 2**31, 2**40, 2**62, 2**63 - 1, size + 1, info.length + 1, None, "5", 2.0))
    else:
        value = copy.copy(rng.choice(_TRANSFORMS))
    _set(info, name, value)
    return f"storage_data[{key.fqn}].{name} = {value!r}"


def _edit_index(ctx: MutationContext, meta: Any, directory: str) -> str:
    rng = ctx.rng
    keys = list(meta.storage_data)
    key = rng.choice(keys)
    new = copy.copy(key)
    name = rng.choice(("fqn", "offset", "swap"))
    if name == "swap":
        other = rng.choice(keys)
        first, second = meta.storage_data[key], meta.storage_data[other]
        meta.storage_data[key], meta.storage_data[other] = second, first
        return f"storage_data[{key.fqn}] <-> storage_data[{other.fqn}]"
    value: Any = (
        rng.choice(("nonexistent", "", rng.choice(keys).fqn, 0, None))
        if name == "fqn"
        else rng.choice(((10**12,), (-1,), (), ("a",), (0,), (0, 0, 0, 0), None))
    )
    _set(new, name, value)
    meta.storage_data = {(new if k is key else k): v for k, v in meta.storage_data.items()}
    return f"storage_data key {key.fqn}.{name} = {value!r}"


def _edit_item(ctx: MutationContext, meta: Any, directory: str) -> str:
    classes, rng, torch = _dcp_classes(), ctx.rng, import_torch()

    items = meta.state_dict_metadata
    key = rng.choice(sorted(items))
    item = items[key]
    if isinstance(item, classes.BytesStorageMetadata):
        tensors = [v for v in items.values() if isinstance(v, classes.TensorStorageMetadata)]
        if tensors and rng.random() < 0.5:
            items[key] = copy.deepcopy(rng.choice(tensors))
            return f"bytes entry {key} -> a tensor entry"
        del items[key]
        return f"deleted entry {key}"
    name = rng.choice(("size", "chunks", "chunk", "dtype", "bytes"))
    value: Any
    if name == "size":
        value = rng.choice(([2**62, 2**62], [-1], [], [0], [10**12], [4], [1, 1, 1, 1, 1]))
        value = torch.Size(value) if rng.random() < 0.7 else tuple(value)
        _set(item, "size", value)
    elif name == "chunks":
        value = rng.choice(([], None, "x", item.chunks * 2))
        _set(item, "chunks", value)
    elif name == "chunk" and item.chunks:
        chunk = rng.choice(item.chunks)
        part = rng.choice(("offsets", "sizes"))
        value = rng.choice(((-1,), (2**62,), (), (0, 0, 0), ("a",), (1,) * 64, [1.5]))
        _set(chunk, part, value)
        name = f"chunk.{part}"
    elif name == "dtype":
        names = ("bool", "complex128", "uint64", "float8_e4m3fn", "qint8", "float64", "int8", "bits8")
        value = getattr(torch, rng.choice(names), None)
        _set(item.properties, "dtype", value)
    else:
        items[key] = classes.BytesStorageMetadata()
        value = "BytesStorageMetadata()"
    return f"state_dict_metadata[{key}].{name} = {value!r}"


def _edit_planner(ctx: MutationContext, meta: Any, directory: str) -> str:
    rng = ctx.rng
    planner = meta.planner_data
    action = rng.choice(("delete", "empty", "short", "none", "float", "swap", "huge", "type", "add", "whole"))
    if action == "whole":
        value: Any = rng.choice((None, {}, [], "x"))
        meta.planner_data = value
        return f"planner_data = {value!r}"
    key = rng.choice(sorted(planner))
    path = tuple(planner[key])
    if action == "delete":
        del planner[key]
    elif action == "empty":
        planner[key] = ()
    elif action == "short":
        planner[key] = path[:1]
    elif action == "none":
        planner[key] = None
    elif action == "float":
        planner[key] = (*path[:-1], 1.5)
    elif action == "swap":
        other = rng.choice(sorted(planner))
        planner[key], planner[other] = planner[other], planner[key]
    elif action == "huge":
        planner[key] = path + ("x",) * rng.choice((100, 10_000))
    elif action == "type":
        planner[key] = tuple(int(p) if isinstance(p, str) and p.isdigit() else str(p) for p in path)
    else:
        planner[f"{key}.extra"] = (*path, "extra")
    return f"planner_data[{key}] {action}"


def _edit_structure(ctx: MutationContext, meta: Any, directory: str) -> str:
    rng = ctx.rng
    action = rng.choice(("drop-item", "drop-storage", "no-items", "no-storage", "bad-key", "storage-meta"))
    if action == "drop-item":
        key = rng.choice(sorted(meta.state_dict_metadata))
        del meta.state_dict_metadata[key]
        return f"deleted state_dict_metadata[{key}]"
    if action == "drop-storage":
        key = rng.choice(list(meta.storage_data))
        del meta.storage_data[key]
        return f"deleted storage_data[{key.fqn}]"
    if action == "no-items":
        meta.state_dict_metadata = rng.choice((None, {}, []))
    elif action == "no-storage":
        meta.storage_data = rng.choice((None, {}, []))
    elif action == "bad-key":
        key = rng.choice(sorted(meta.state_dict_metadata))
        meta.state_dict_metadata[rng.choice((1, None, b"x", ("a",)))] = meta.state_dict_metadata.pop(key)
    elif meta.storage_meta is not None:
        _set(meta.storage_meta, "checkpoint_id", rng.choice(("/etc", None, 7, "../..")))
    return action


METADATA_EDITS = (_edit_storage, _edit_storage, _edit_index, _edit_item, _edit_planner, _edit_structure)


def dcp_metadata_edit(ctx: MutationContext) -> bool:
    """Unpickle a DCP ``.metadata`` of a seed built here (plain pickle), edit fields, pickle it again."""
    dirs = ctx.dcp_dirs()
    if not dirs:
        return False
    directory = ctx.rng.choice(dirs)
    original = ctx.seed.tree[f"{directory}/.metadata"]
    assert isinstance(original, bytes)
    _dcp_classes()
    meta = pickle.loads(original)  # only ever a seed this process built
    for _ in range(ctx.rng.choice((1, 1, 1, 2, 3))):
        edit = ctx.rng.choice(METADATA_EDITS)
        try:
            ctx.notes.append(edit(ctx, meta, directory))
        except (TypeError, IndexError, KeyError, AttributeError, ValueError):  # an earlier edit took what it needs
            ctx.notes.append(f"{edit.__name__} skipped")
    ctx.tree[f"{directory}/.metadata"] = pickle.dumps(meta, protocol=ctx.rng.choice((2, 4, 4, 5)))
    return True


def dcp_metadata_pickle(ctx: MutationContext) -> bool:
    dirs = ctx.dcp_dirs()
    if not dirs:
        return False
    rel = f"{ctx.rng.choice(dirs)}/.metadata"
    ctx.tree[rel], note = mutate_pickle(ctx.rng, ctx.data(rel))
    ctx.notes.append(f"{rel}: {note}")
    return True


def dcp_bytes_entry(ctx: MutationContext) -> bool:
    """Mutate one bytes entry (a ``torch.save`` archive inside a shard); if it changes size, append it to the shard
    and point the metadata at it. Also: compress it with zstd (a valid transform), or replace it by a zstd bomb."""
    dirs = ctx.dcp_dirs()
    if not dirs:
        return False
    rng = ctx.rng
    directory = rng.choice(dirs)
    classes = _dcp_classes()
    original = ctx.seed.tree[f"{directory}/.metadata"]
    assert isinstance(original, bytes)
    meta = pickle.loads(original)
    entries = [
        (key, info)
        for key, info in meta.storage_data.items()
        if isinstance(meta.state_dict_metadata.get(key.fqn), classes.BytesStorageMetadata)
    ]
    if not entries:
        return False
    key, info = rng.choice(entries)
    shard_rel = f"{directory}/{info.relative_path}"
    shard = ctx.data(shard_rel)
    blob = shard[info.offset : info.offset + info.length]
    action = rng.choice(("pickle", "pickle", "rewrite", "header", "bytes", "zstd", "zstd-bytes", "zstd-bomb"))
    new: bytes | None
    transforms = None
    if action == "pickle":
        done = zip_pickle(rng, blob)
        new, note = done if done else (None, "")
    elif action == "rewrite":
        done = zip_rewrite(rng, blob)
        new, note = done if done else (None, "")
    elif action == "header":
        done = zip_header(rng, blob)
        new, note = done if done else (None, "")
    elif action == "bytes":
        new, note = rng.choice(list(BYTE_MUTATORS.values()))(rng, blob, blob)
    else:
        bomb = zstd_bomb(rng.choice((1 << 30, 2 << 30))) if action == "zstd-bomb" else None
        new = bomb if action == "zstd-bomb" else zstd(blob)
        if new is not None and action == "zstd-bytes":
            new = flip(rng, new, new)[0]
        transforms, note = ["stream.zstd/1"], action
    if new is None:
        return False
    if len(new) == len(blob) and transforms is None:
        ctx.tree[shard_rel] = shard[: info.offset] + new + shard[info.offset + info.length :]
    else:
        _set(info, "offset", len(shard))
        _set(info, "length", len(new))
        if transforms is not None:
            _set(info, "transform_descriptors", transforms)
        ctx.tree[shard_rel] = shard + new
        ctx.tree[f"{directory}/.metadata"] = pickle.dumps(meta)
    ctx.notes.append(f"bytes entry {key.fqn} in {shard_rel}: {note}")
    return True


# --------------------------------------------------------------------------- mutators over a case's tree


def _byte_mutator(name: str) -> Callable[[MutationContext], bool]:
    def mutate(ctx: MutationContext) -> bool:
        rels = ctx.files()
        if not rels:
            return False
        rel = ctx.pick(rels)
        donors = [node for seed in ctx.corpus for node in seed.tree.values() if isinstance(node, bytes) and node]
        ctx.tree[rel], note = BYTE_MUTATORS[name](ctx.rng, ctx.data(rel), ctx.rng.choice(donors))
        ctx.notes.append(f"{rel}: {note}")
        return True

    return mutate


def _is_zip(rel: str, data: bytes) -> bool:
    return data[:4] == b"PK\x03\x04" and not rel.endswith(".distcp")


def _file_mutator(
    predicate: Callable[[str, bytes], bool], mutate: Callable[[random.Random, bytes], tuple[bytes, str] | None]
) -> Callable[[MutationContext], bool]:
    def apply(ctx: MutationContext) -> bool:
        rels = ctx.files(predicate)
        if not rels:
            return False
        rel = ctx.pick(rels)
        done = mutate(ctx.rng, ctx.data(rel))
        if done is None:
            return False
        ctx.tree[rel] = done[0]
        ctx.notes.append(f"{rel}: {done[1]}")
        return True

    return apply


def _structural(variant: str) -> Callable[[MutationContext], bool]:
    """Replace a file inside a checkpoint directory (never the argument itself) by a link, a FIFO or a directory."""

    def apply(ctx: MutationContext) -> bool:
        if ctx.seed.kind not in ("dcp", "directory"):
            return False
        rels = [rel for rel in ctx.files() if rel != ctx.seed.arg]
        if variant == "link-dir-outside":
            ctx.tree[f"{ctx.seed.arg}/linked_dir"] = Link(ctx.outside.directory)
            ctx.notes.append(f"{ctx.seed.arg}/linked_dir -> {ctx.outside.directory}")
            return True
        if not rels:
            return False
        rel = ctx.pick(rels)
        node: Node
        if variant == "link-outside":
            node = Link(ctx.outside_for(rel))
        elif variant == "link-devzero":
            node = Link("/dev/zero")
        elif variant == "fifo":
            node = Fifo()
        elif variant == "link-loop":
            name = rel.rpartition("/")[2]
            if ctx.rng.random() < 0.5:
                node = Link(name)
            else:
                node = Link(f"{name}.loop")
                ctx.tree[f"{rel}.loop"] = Link(name)
        elif variant == "link-dangling":
            node = Link("does-not-exist" + Path(rel).suffix)
        else:
            node = Dir()
        ctx.tree[rel] = node
        ctx.notes.append(f"{rel} -> {node}")
        return True

    return apply


def neighbour(ctx: MutationContext) -> bool:
    """Beside a file argument, a ``.safetensors`` file (read for shapes) that is special or damaged."""
    if ctx.seed.kind not in ("zip", "legacy"):
        return False
    rel = ctx.rng.choice(("model.safetensors", "a.safetensors"))
    variant = ctx.rng.choice(("fifo", "devzero", "outside", "loop", "dir", "damaged"))
    node: Node
    if variant == "fifo":
        node = Fifo()
    elif variant == "devzero":
        node = Link("/dev/zero")
    elif variant == "outside":
        node = Link(ctx.outside.by_suffix.get(".safetensors", "/etc/hostname"))
    elif variant == "loop":
        node = Link(rel)
    elif variant == "dir":
        node = Dir()
    else:
        source = ctx.outside.by_suffix.get(".safetensors")
        done = safetensors_edit(ctx.rng, Path(source).read_bytes()) if source else None
        if done is None:
            return False
        node = done[0]
    ctx.tree[rel] = node
    ctx.notes.append(f"neighbour {rel}: {variant}")
    return True


def root_special(ctx: MutationContext) -> bool:
    """The argument itself is a FIFO, a link loop, a dangling link or a directory."""
    if ctx.seed.kind not in ("zip", "legacy"):
        return False
    variant = ctx.rng.choice(("fifo", "loop", "dangling", "dir"))
    arg = ctx.seed.arg
    nodes: dict[str, Node] = {"fifo": Fifo(), "loop": Link(arg), "dangling": Link("gone.pt"), "dir": Dir()}
    node = nodes[variant]
    ctx.tree[arg] = node
    ctx.notes.append(f"argument {arg}: {variant}")
    return True


def _is_legacy(rel: str, data: bytes) -> bool:
    return data.startswith(_LEGACY_MAGIC)


STRUCTURAL = ("link-outside", "link-devzero", "fifo", "link-loop", "link-dangling", "dir-for-file", "link-dir-outside")


@dataclass(frozen=True)
class Mutator:
    apply: Callable[[MutationContext], bool]
    weight: float
    kinds: tuple[str, ...] = ("zip", "legacy", "dcp", "directory")


MUTATORS: dict[str, Mutator] = {
    **{name: Mutator(_byte_mutator(name), 2.0) for name in BYTE_MUTATORS},
    "zip-header": Mutator(_file_mutator(_is_zip, zip_header), 3.0, ("zip", "directory")),
    "zip-rewrite": Mutator(_file_mutator(_is_zip, zip_rewrite), 3.0, ("zip", "directory")),
    "zip-pickle": Mutator(_file_mutator(_is_zip, zip_pickle), 8.0, ("zip", "directory")),
    "legacy-pickle": Mutator(_file_mutator(_is_legacy, legacy_pickle), 10.0, ("legacy",)),
    "legacy-numel": Mutator(_file_mutator(_is_legacy, legacy_numel), 2.0, ("legacy",)),
    "safetensors": Mutator(
        _file_mutator(lambda rel, data: rel.endswith(".safetensors"), safetensors_edit), 1.5, ("directory",)
    ),
    "dcp-metadata-pickle": Mutator(dcp_metadata_pickle, 6.0, ("dcp", "directory")),
    "dcp-metadata-edit": Mutator(dcp_metadata_edit, 8.0, ("dcp", "directory")),
    "dcp-bytes-entry": Mutator(dcp_bytes_entry, 5.0, ("dcp", "directory")),
    **{variant: Mutator(_structural(variant), 0.5, ("dcp", "directory")) for variant in STRUCTURAL},
    "neighbour": Mutator(neighbour, 0.7, ("zip", "legacy")),
    "root-special": Mutator(root_special, 0.3, ("zip", "legacy")),
}
"""Every mutator by name, with its relative weight and the seed kinds it applies to."""
HAVOC = 0.1
"""The chance of a byte mutation after a case's mutator."""


@dataclass
class Case:
    """One fuzz case: everything here follows from (seed, index) and the corpus."""

    index: int
    seed: Seed
    tree: Tree
    mutator: str
    notes: list[str]
    fix: bool
    fill: str | None
    link: bool


def make_case(corpus: Sequence[Seed], outside: Outside, seed: int, index: int, fix_every: int) -> Case:
    """The case ``index`` of the run with ``seed``: a seed checkpoint, mutated."""
    rng = random.Random(f"optim-repair-fuzz/{seed}/{index}")
    kind = rng.choice(sorted({s.kind for s in corpus}))
    chosen = rng.choice([s for s in corpus if s.kind == kind])
    names = [name for name, mutator in MUTATORS.items() if chosen.kind in mutator.kinds]
    weights = [MUTATORS[name].weight for name in names]
    ctx = MutationContext(rng, chosen, dict(chosen.tree), corpus, outside)
    label = "flip"
    for _ in range(8):
        name = rng.choices(names, weights=weights)[0]
        try:
            if MUTATORS[name].apply(ctx):
                label = name
                break
        except Exception as exc:  # a bug of this fuzzer: note it, try another mutator
            ctx.notes.append(f"fuzzer error in {name}: {type(exc).__name__}: {exc}")
        ctx.tree = dict(chosen.tree)
    else:
        MUTATORS["flip"].apply(ctx)
    if rng.random() < HAVOC:
        MUTATORS[rng.choice(list(BYTE_MUTATORS))].apply(ctx)
        ctx.notes.append("(havoc)")
    fix = fix_every > 0 and index % fix_every == 0
    fill = rng.choice((None, "empty", "fresh"))
    return Case(index, chosen, ctx.tree, label, ctx.notes, fix, fill, rng.random() < 0.3)


# --------------------------------------------------------------------------- the worker process

_PATH_EVENTS: dict[str, tuple[tuple[tuple[int, str], ...], int | None]] = {
    "shutil.copyfile": (((0, "read"), (1, "write")), None),
    "shutil.copymode": (((0, "read"), (1, "write")), None),
    "shutil.copystat": (((0, "read"), (1, "write")), None),
    "shutil.copytree": (((0, "read"), (1, "write")), None),
    "shutil.rmtree": (((0, "write"),), 1),
    "os.link": (((0, "read"), (1, "write")), 2),
    "os.symlink": (((1, "write"),), 2),
    "os.rename": (((0, "write"), (1, "write")), 2),
    "os.remove": (((0, "write"),), 1),
    "os.rmdir": (((0, "write"),), 1),
    "os.mkdir": (((0, "write"),), 2),
    "os.truncate": (((0, "write"),), None),
    "os.chmod": (((0, "write"),), 2),
    "os.chown": (((0, "write"),), 3),
    "os.utime": (((0, "write"),), 3),
    "os.listdir": (((0, "read"),), None),
    "os.scandir": (((0, "read"),), None),
}
"""Audit events that name paths: (argument position, access) of each path, and the position of a ``dir_fd``."""
_NOFOLLOW_EVENTS = frozenset({"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.symlink", "shutil.rmtree"})
"""Events that act on a link itself, not on what it points to."""
_EXEC_EVENTS = frozenset({"os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                          "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen", "socket.connect", "socket.bind",
                          "socket.getaddrinfo", "urllib.Request", "webbrowser.open"})  # fmt: skip
_IMPORTS_ALLOWED = frozenset({"optim_repair", "torch", "zstandard", "compression", "bz2", "_bz2", "lzma",
                              "_lzma", "zlib", "_compression", "encodings", "safetensors", "rich", "typer",
                              "numpy"})  # fmt: skip
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _in_rmtree() -> bool:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name.startswith("_rmtree") and frame.f_code.co_filename == shutil.__file__:
            return True
        frame = frame.f_back
    return False


class Auditor:
    """An audit hook: while armed, records every path touched outside the case's directories, and worse."""

    def __init__(self, static_roots: Sequence[str], package_dir: str) -> None:
        self.armed = False
        self.busy = False
        self.static_roots = tuple(static_roots)
        self.package_dir = package_dir
        self.input_dir = ""
        self.case_roots: tuple[str, ...] = ()
        self.events: list[dict[str, str]] = []
        self._seen: set[tuple[str, ...]] = set()

    def arm(self, input_dir: str, output_dir: str) -> None:
        self.input_dir = os.path.realpath(input_dir)
        self.case_roots = (self.input_dir, os.path.realpath(output_dir))
        self.events, self._seen = [], set()
        self.armed = True

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.armed or self.busy:
            return
        self.busy = True
        try:
            self._audit(event, args)
        except Exception:  # an audit hook must never break the code under test
            pass
        finally:
            self.busy = False

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            mode, flags = args[1], args[2]
            writes = bool(set(mode) & set("wax+")) if isinstance(mode, str) else bool(flags & _WRITE_FLAGS)
            follow = not (isinstance(flags, int) and flags & getattr(os, "O_NOFOLLOW", 0))
            self._path(event, args[0], "write" if writes else "read", follow=follow)
        elif event in _PATH_EVENTS:
            paths, dir_fd = _PATH_EVENTS[event]
            relative_to_fd = dir_fd is not None and len(args) > dir_fd and args[dir_fd] is not None
            for position, access in paths:
                value = args[position] if len(args) > position else None
                if relative_to_fd and isinstance(value, (str, bytes)) and not os.path.isabs(value):
                    continue
                value = "." if value is None and event in ("os.listdir", "os.scandir") else value
                follow = event not in _NOFOLLOW_EVENTS and (event, position) != ("os.link", 1)
                self._path(event, value, access, follow=follow)
        elif event in _EXEC_EVENTS:
            if event == "ctypes.dlopen" and args[0] is None:
                return  # dlopen(NULL): the symbols already loaded (staging's renameat2), no new code
            self._record("exec", event, repr(args)[:200])
        elif event == "pickle.find_class":
            self._record("plain-unpickle", event, f"{args[0]}.{args[1]}")
        elif event == "import":
            top = str(args[0]).partition(".")[0]
            if top not in _IMPORTS_ALLOWED:
                self._record("import", event, str(args[0]))

    def _path(self, event: str, value: Any, access: str, *, follow: bool = True) -> None:
        if value is None or isinstance(value, int):
            return
        text = os.fsdecode(os.fspath(value))
        if not os.path.isabs(text) and _in_rmtree():
            return  # shutil.rmtree opens names relative to a directory descriptor; its root was audited
        if follow:
            real = os.path.realpath(text)
        else:  # O_NOFOLLOW: a link as the last component is not followed (the open fails)
            real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(text))), os.path.basename(text))
        if any(_under(real, root) for root in self.case_roots):
            if access == "write" and _under(real, self.input_dir):
                self._record("input-write", event, real)
            return
        if access == "read" and any(_under(real, root) for root in self.static_roots):
            return
        if real == "/dev/null":
            return
        self._record(f"outside-{access}", event, real)

    def _record(self, kind: str, event: str, detail: str) -> None:
        where = ""
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.package_dir):
                rel = os.path.relpath(frame.f_code.co_filename, os.path.dirname(self.package_dir))
                where = f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
                break
            frame = frame.f_back
        key = (kind, event, detail, where)
        if key not in self._seen:
            self._seen.add(key)
            self.events.append({"kind": kind, "event": event, "path": detail, "where": where})


def _status_kib(pid: int | str, field_name: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as stream:
            for line in stream:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _frames(tb: TracebackType | None, package_dir: str) -> tuple[str, str]:
    """(innermost optim_repair frame, innermost frame) of a traceback, as ``file:function``."""
    ours = last = ""
    for frame, _line in traceback.walk_tb(tb):
        name = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
        last = name
        if frame.f_code.co_filename.startswith(package_dir):
            rel = os.path.relpath(frame.f_code.co_filename, os.path.dirname(package_dir))
            ours = f"{rel}:{frame.f_code.co_name}"
    return ours, last


def _causes(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _describe(exc: BaseException | None, package_dir: str) -> dict[str, Any]:
    """A call's outcome as plain data (called with the audit hook disarmed: formatting reads source files)."""
    if exc is None:
        return {"status": "ok"}
    from optim_repair.errors import OptimRepairError

    try:
        message = str(exc)
    except Exception as error:  # str() of a library error must not fail, but may
        message = f"<str() raised {type(error).__name__}: {error}>"
    chain = _causes(exc)
    deepest = chain[-1]
    where, innermost = _frames(deepest.__traceback__, package_dir)
    if not where:
        where = _frames(exc.__traceback__, package_dir)[0]
    record: dict[str, Any] = {
        "type": type(exc).__name__,
        "message": message,
        "causes": [f"{type(c).__name__}" + (f"[errno {c.errno}]" if isinstance(c, OSError) else "") for c in chain],
        "where": where,
        "innermost": innermost,
    }
    if isinstance(exc, OptimRepairError):
        record.update(status="error", exit_code=int(exc.exit_code))
        suspicious = "\n" in message or int(exc.exit_code) not in EXIT_CODES or len(chain) > 1
    else:
        record["status"] = "exception"
        suspicious = True
    if suspicious:
        text = "".join(traceback.format_exception(exc))
        record["traceback"] = text if len(text) < 20_000 else text[:4_000] + "\n...\n" + text[-12_000:]
    return record


def _guarded(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # everything, SystemExit and RecursionError included, is an outcome
        return None, exc


def _open_fds() -> dict[str, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return fds


@dataclass(frozen=True)
class WorkerConfig:
    log: str
    cwd: str
    """An empty directory to work in, so that a relative path resolves to nothing of the fuzzer's."""
    rss_mib: int
    fsize_mib: int


def _set_limits(config: WorkerConfig) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    fsize = config.fsize_mib << 20
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize if hard == resource.RLIM_INFINITY else min(fsize, hard), hard))
    # A backstop under the supervisor's RSS watch: allocations far beyond --rss-mib fail at once.
    data = (_status_kib("self", "VmData") << 10) + (4 * config.rss_mib << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data if hard == resource.RLIM_INFINITY else min(data, hard), hard))


def preload_modules() -> list[str]:
    """What the forkserver imports once, so that a new worker is a fork, not a Python start-up."""
    own = "__main__" if __name__ in ("__main__", "__mp_main__") else __name__
    return [own, "optim_repair", "optim_repair.formats.dcp.writer", "optim_repair.render", "torch",
            "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem", "zstandard", "bz2",
            "lzma"]  # fmt: skip


def worker_main(conn: Connection, config: WorkerConfig) -> None:
    """The worker: limits, audit hook, then one case per request until the pipe closes."""
    log = open(config.log, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.chdir(config.cwd)
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    warnings.simplefilter("ignore")
    for module in preload_modules()[1:]:
        with contextlib.suppress(ImportError):
            __import__(module)
    import optim_repair

    optim_repair.versions()  # reads the environment's package metadata (sys.path) once, before any case
    package_dir = os.path.dirname(os.path.realpath(optim_repair.__file__))
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, package_dir, "/proc/self",
             f"/proc/{os.getpid()}", "/dev/urandom", "/sys/devices/system/cpu", *site.getsitepackages()}  # fmt: skip
    auditor = Auditor(sorted(os.path.realpath(root) for root in roots), package_dir)
    sys.addaudithook(auditor)
    _set_limits(config)
    conn.send({"ready": os.getpid()})
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        os.write(log.fileno(), f"\n@@@ case {request['index']} @@@\n".encode())
        conn.send(run_request(request, auditor, package_dir))


def run_request(request: Mapping[str, Any], auditor: Auditor, package_dir: str) -> dict[str, Any]:
    """Run one case in this process: inspect, and maybe fix and inspect the copy; what happened, as plain data."""
    import optim_repair
    from optim_repair.render import inspect_document

    try:
        with open("/proc/self/clear_refs", "w") as stream:
            stream.write("5")  # VmHWM becomes this case's peak
    except OSError:
        pass
    fds = _open_fds()
    path, out = request["path"], request["out"]
    auditor.arm(request["in_dir"], request["out_dir"])
    diagnosis, inspected = _guarded(lambda: optim_repair.inspect(path))
    rendered: BaseException | None = None
    if inspected is None:
        rendered = _guarded(lambda: json.dumps(inspect_document(diagnosis)))[1]
    fixed = reinspected = None
    if request["fix"]:
        _, fixed = _guarded(lambda: optim_repair.fix(path, out, fill=request["fill"], link=request["link"]))
        if fixed is None:
            _, reinspected = _guarded(lambda: optim_repair.inspect(out))
    auditor.armed = False
    events = auditor.events
    response: dict[str, Any] = {
        "inspect": _describe(inspected, package_dir),
        "render": _describe(rendered, package_dir) if inspected is None else None,
        "fix": _describe(fixed, package_dir) if request["fix"] else None,
        "reinspect": _describe(reinspected, package_dir) if request["fix"] and fixed is None else None,
        "events": events,
    }
    diagnosis = inspected = rendered = fixed = reinspected = None
    leaked = {fd: target for fd, target in _open_fds().items() if fd not in fds}
    if leaked:
        gc.collect()
        leaked = {fd: target for fd, target in _open_fds().items() if fd not in fds}
    response["leaked_fds"] = sorted(leaked.values())
    response["hwm_mib"] = _status_kib("self", "VmHWM") / 1024
    return response


# --------------------------------------------------------------------------- supervision


@dataclass
class Raw:
    """What the supervisor saw of one case: the worker's response, or how the worker died."""

    response: dict[str, Any] | None
    death: str | None = None
    log: str = ""
    peak_rss_mib: float = 0.0
    seconds: float = 0.0


class Supervisor:
    """Runs cases in a worker forked from a forkserver; kills and replaces it on a hang, a crash or a blowup."""

    def __init__(self, workdir: Path, rss_mib: int, fsize_mib: int) -> None:
        self.log = workdir / "worker.log"
        self.rss_mib = rss_mib
        (workdir / "cwd").mkdir(exist_ok=True)
        self.config = WorkerConfig(str(self.log), str(workdir / "cwd"), rss_mib, fsize_mib)
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(preload_modules())
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None
        self.starts = 0

    def start(self) -> None:
        """Start a worker now (the first start also starts the forkserver, which imports torch)."""
        if self.process is None:
            self._start()

    def _start(self) -> tuple[BaseProcess, Connection]:
        parent, child = self.context.Pipe()
        saved = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = "ignore"  # the forkserver's own imports (torch's NumPy warning)
        try:
            process = self.context.Process(target=worker_main, args=(child, self.config), daemon=True)
            process.start()
        finally:
            if saved is None:
                del os.environ["PYTHONWARNINGS"]
            else:
                os.environ["PYTHONWARNINGS"] = saved
        child.close()
        if not parent.poll(300):
            process.kill()
            raise RuntimeError(f"the fuzz worker did not start; see {self.log}")
        parent.recv()
        self.starts += 1
        self.process, self.conn = process, parent
        return process, parent

    def run(self, request: dict[str, Any], timeout: float) -> Raw:
        process, conn = (self.process, self.conn) if self.process and self.conn else self._start()
        start = time.monotonic()
        peak = 0.0
        try:
            conn.send(request)
        except OSError:
            process, conn = self._start()
            conn.send(request)
        pid = process.pid or 0
        while True:
            if conn.poll(POLL_S):
                try:
                    response = conn.recv()
                except (EOFError, OSError):
                    return self._dead(request, self._exit_reason(), start, peak)
                return Raw(response, peak_rss_mib=max(peak, response.get("hwm_mib", 0.0)),
                           seconds=time.monotonic() - start)  # fmt: skip
            rss = _status_kib(pid, "VmRSS") / 1024
            peak = max(peak, rss)
            if rss > self.rss_mib:
                self._kill(dump=True)
                return self._dead(request, "memory", start, peak)
            if not process.is_alive():
                return self._dead(request, self._exit_reason(), start, peak)
            if time.monotonic() - start > timeout:
                self._kill(dump=True)
                return self._dead(request, "hang", start, peak)

    def _exit_reason(self) -> str:
        process = self.process
        self.process = self.conn = None
        if process is None:
            return "exit-unknown"
        process.join(5)
        code = process.exitcode
        if code is None:
            process.kill()
            return "exit-unknown"
        if code < 0:
            try:
                return f"signal-{signal.Signals(-code).name}"
            except ValueError:
                return f"signal-{-code}"
        return f"exit-{code}"

    def _kill(self, *, dump: bool) -> None:
        process = self.process
        if process is not None and process.pid is not None and process.is_alive():
            if dump:  # faulthandler writes every thread's stack to the log first
                os.kill(process.pid, signal.SIGUSR1)
                time.sleep(0.3)
            process.kill()
            process.join(5)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None

    def _dead(self, request: Mapping[str, Any], death: str, start: float, peak: float) -> Raw:
        self._kill(dump=False)
        return Raw(None, death, self._log_since(request["index"]), peak, time.monotonic() - start)

    def _log_since(self, index: int) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        marker = f"@@@ case {index} @@@"
        tail = text[text.rfind(marker) + len(marker) :] if marker in text else text[-20_000:]
        return tail.strip()[-20_000:]

    def trim_log(self) -> None:
        try:
            if self.log.stat().st_size > LOG_LIMIT:
                os.truncate(self.log, 0)
        except OSError:
            pass

    def stop(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.send(None)
        if self.process is not None:
            self.process.join(2)
        self._kill(dump=False)


# --------------------------------------------------------------------------- findings and the summary


@dataclass(frozen=True)
class Finding:
    kind: str
    phase: str
    detail: str
    where: str = ""
    traceback: str = ""

    @property
    def signature(self) -> str:
        return f"{self.kind} | {self.phase} | {self.where}"


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _where_from_log(log: str, package_dir: str) -> str:
    """The innermost optim_repair frame (and the innermost frame) of a faulthandler dump."""
    frames = _FRAME.findall(log)
    if not frames:
        return ""
    first = f"{os.path.basename(frames[0][0])}:{frames[0][2]}"
    ours = next((f for f in frames if f[0].startswith(package_dir)), None)
    if ours is None:
        return first
    return f"{os.path.relpath(ours[0], os.path.dirname(package_dir))}:{ours[2]} > {first}"


def _call_findings(phase: str, record: Mapping[str, Any] | None) -> list[Finding]:
    if not record or record["status"] == "ok":
        return []
    where = record["where"] + (f" > {record['innermost']}" if record.get("innermost") else "")
    tb = record.get("traceback", "")
    detail = f"{record['type']}: {record['message']}"[:500]
    if record["status"] == "exception":
        return [Finding(f"exception-{record['type']}", phase, detail, where, tb)]
    found = []
    if "\n" in record["message"]:
        found.append(Finding("multi-line-message", phase, detail, where, tb))
    if record["exit_code"] not in EXIT_CODES:
        found.append(Finding("bad-exit-code", phase, detail, where, tb))
    for cause in record["causes"][1:]:
        if cause in ("MemoryError", "RecursionError"):
            found.append(Finding(f"swallowed-{cause}", phase, detail, where, tb))
        if cause.endswith(f"[errno {errno.EFBIG}]"):
            found.append(Finding("runaway-write", phase, detail, where, tb))
    return found


def classify(case: Case, raw: Raw, changed: list[str], out_left: list[str], rss_mib: int, package_dir: str,
             workdir: str) -> list[Finding]:  # fmt: skip
    """Every finding of a case, from the worker's response (or death) and the supervisor's checks."""
    found: list[Finding] = []
    if raw.response is None:
        found.append(Finding(raw.death or "death", "worker", raw.death or "", _where_from_log(raw.log, package_dir),
                             raw.log))  # fmt: skip
    else:
        response = raw.response
        for phase in ("inspect", "render", "fix", "reinspect"):
            found += _call_findings(phase, response.get(phase))
        inspected, again = response["inspect"], response.get("reinspect")
        if again and again["status"] == "error" and inspected["status"] == "ok":
            found.append(Finding("fixed-copy-rejected", "reinspect", again["message"][:500], again["where"]))
        for event in response["events"]:
            path = event["path"]
            shown = "<work>" + path[len(workdir) :] if _under(path, workdir) else path
            found.append(Finding(event["kind"], event["event"], path, f"{event['where']} [{shown}]"))
        if response["leaked_fds"]:
            found.append(Finding("fd-leak", "inspect/fix", ", ".join(response["leaked_fds"])))
        if response["hwm_mib"] > rss_mib:
            found.append(Finding("memory-peak", "inspect/fix", f"{response['hwm_mib']:.0f} MiB"))
    if changed:
        found.append(Finding("input-changed", "fix" if case.fix else "inspect", "; ".join(changed)[:1000]))
    if out_left:
        found.append(Finding("output-left", "fix" if case.fix else "inspect", ", ".join(out_left)[:1000]))
    return found


def _output_left(case: Case, raw: Raw, out_dir: Path, out_name: str) -> list[str]:
    """What is in the output directory that should not be: anything after a failure, extras after success."""
    if raw.response is None:
        return []  # a killed worker cannot clean up
    names = sorted(os.listdir(out_dir))
    fixed = raw.response.get("fix")
    if fixed is not None and fixed["status"] == "ok":
        return [name for name in names if name != out_name]
    return names


@dataclass
class Group:
    """One distinct finding: its signature, how often, in which cases, and where reproducers were saved."""

    kind: str
    signature: str
    detail: str
    count: int = 0
    cases: list[int] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)


@dataclass
class Summary:
    """What a run found; ``findings`` is the number of cases with at least one."""

    seed: int
    cases: int = 0
    seconds: float = 0.0
    by_kind: Counter[tuple[str, str]] = field(default_factory=Counter)
    by_mutator: Counter[tuple[str, str]] = field(default_factory=Counter)
    fix: Counter[str] = field(default_factory=Counter)
    groups: dict[str, Group] = field(default_factory=dict)
    findings: int = 0
    worker_starts: int = 0
    fuzzer_errors: int = 0
    """Cases in which a mutator of this fuzzer failed (another one was used instead)."""
    setup_seconds: float = 0.0
    """Building or loading the seeds and starting the worker, before the first case."""
    slowest: list[tuple[float, int, str]] = field(default_factory=list)
    interrupted: bool = False

    @property
    def rate(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0


def _label(record: Mapping[str, Any] | None) -> str:
    if record is None:
        return "none"
    return "ok" if record["status"] == "ok" else f"error-{record['exit_code']}" if "exit_code" in record else "finding"


def _slug(finding: Finding) -> str:
    digest = hashlib.sha1(finding.signature.encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{finding.kind}-{finding.phase}")[:60] + f"-{digest}"


def _relink(tree: Mapping[str, Node], outside: Outside, saved_outside: Path) -> Tree:
    """The tree with links into the (temporary) outside directory pointing at its saved copy instead."""
    moved: Tree = {}
    for rel, node in tree.items():
        if isinstance(node, Link) and _under(node.target, str(outside.root)):
            node = Link(str(saved_outside) + node.target[len(str(outside.root)) :])
        moved[rel] = node
    return moved


def save_reproducer(out: Path, finding: Finding, case: Case, raw: Raw, seed: int, corpus: Path,
                    outside: Outside) -> Path:  # fmt: skip
    """``<out>/<finding>/case-<index>/``: the mutated input under ``input/`` and a ``case.json``."""
    saved_outside = out / "_outside"
    if not saved_outside.exists():
        shutil.copytree(outside.root, saved_outside, symlinks=True)
    directory = out / _slug(finding) / f"case-{case.index}"
    if directory.exists():
        shutil.rmtree(directory)
    materialize(_relink(case.tree, outside, saved_outside), directory / "input")
    path = directory / "input" / case.seed.arg
    call = f"optim_repair.inspect({str(path)!r})"
    if case.fix:
        call += f"; optim_repair.fix({str(path)!r}, OUT, fill={case.fill!r}, link={case.link})"
    document = {
        "seed": seed,
        "case": case.index,
        "corpus_seed": case.seed.name,
        "kind": case.seed.kind,
        "mutator": case.mutator,
        "notes": case.notes,
        "fix": {"fill": case.fill, "link": case.link} if case.fix else None,
        "finding": dataclasses.asdict(finding),
        "signature": finding.signature,
        "death": raw.death,
        "response": raw.response,
        "worker_log": raw.log,
        "seconds": raw.seconds,
        "call": call,
        "replay": f"{sys.executable} {Path(__file__).resolve()} --seed {seed} --only {case.index} "
        f"--corpus {corpus} --fix-every {1 if case.fix else 0}",
    }
    (directory / "case.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    return directory


def _table(title: str, counts: Counter[tuple[str, str]]) -> str:
    rows = sorted({row for row, _ in counts})
    width = max([len(title), *(len(row) for row in rows)])
    lines = [f"{title:<{width}} | {'cases':>6} | " + " | ".join(f"{o:>7}" for o in OUTCOMES)]
    lines.append("-" * len(lines[0]))
    for row in rows:
        total = sum(counts[row, o] for o in OUTCOMES)
        lines.append(f"{row:<{width}} | {total:>6} | " + " | ".join(f"{counts[row, o]:>7}" for o in OUTCOMES))
    return "\n".join(lines)


def format_summary(summary: Summary, out: Path) -> str:
    parts = [
        _table("kind", summary.by_kind),
        "",
        _table("mutator", summary.by_mutator),
        "",
        "fix: " + (", ".join(f"{label} {count}" for label, count in sorted(summary.fix.items())) or "not run"),
        "",
    ]
    if summary.groups:
        parts.append(f"{len(summary.groups)} distinct findings in {summary.findings} cases (reproducers under {out}):")
        for group in sorted(summary.groups.values(), key=lambda g: -g.count):
            example = group.saved[0] if group.saved else f"case {group.cases[0]}"
            parts.append(f"  {group.count:>5}x {group.signature}\n         {group.detail[:160]}\n         {example}")
    else:
        parts.append("no findings")
    slow = ", ".join(f"case {index} ({seconds:.2f}s, {m})" for seconds, index, m in sorted(summary.slowest)[::-1][:3])
    parts += [
        "",
        f"slowest: {slow}",
        f"{summary.cases} cases in {summary.seconds:.1f}s: {summary.rate:.1f} cases/s "
        f"(+{summary.setup_seconds:.1f}s setup); worker started {summary.worker_starts}x; "
        f"fuzzer errors {summary.fuzzer_errors}" + ("; interrupted" if summary.interrupted else ""),
    ]
    return "\n".join(parts)


def _write_index(out: Path, summary: Summary) -> None:
    groups = [dataclasses.asdict(g) for g in sorted(summary.groups.values(), key=lambda g: -g.count)]
    document = {"seed": summary.seed, "cases": summary.cases, "findings": summary.findings, "groups": groups}
    (out / "findings.json").write_text(json.dumps(document, indent=2) + "\n")


def run(
    cases: int,
    seed: int = 0,
    out: Path | str = "fuzz-findings",
    *,
    start: int = 0,
    fix_every: int = 10,
    timeout: float = 10.0,
    rss_mib: int = 1024,
    fsize_mib: int = 256,
    corpus: Path | str | None = None,
    keep: int = 10,
    hang_budget: int = 3,
    progress: bool = False,
    verbose: bool = False,
) -> Summary:
    """Run cases ``start .. start+cases-1`` of the run ``seed`` in a supervised worker; save findings under ``out``.

    ``corpus``: a directory of seeds, built there when it has none yet (default: a temporary one).
    ``keep``: reproducers saved per distinct finding (each finding's cases are all listed in findings.json).
    ``hang_budget``: after this many hangs or deaths of one mutator, its cases get a timeout of 2 s.
    """
    out = Path(out)
    if (out / "findings.json").exists():
        shutil.rmtree(out)  # a previous run's findings, not anything else
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(seed)
    setup = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="optim-repair-fuzz-") as tmp:
        workdir = Path(tmp)
        corpus_dir = Path(corpus) if corpus is not None else workdir / "corpus"
        if not (corpus_dir / "manifest.json").exists():
            build_corpus(corpus_dir)
        seeds = load_corpus(corpus_dir)
        outside = make_outside(seeds, workdir / "outside")
        outside_before = snapshot(outside.root)
        supervisor = Supervisor(workdir, rss_mib, fsize_mib)
        import optim_repair

        package_dir = os.path.dirname(os.path.realpath(optim_repair.__file__))
        case_dir = workdir / "case"
        deaths: Counter[str] = Counter()
        supervisor.start()
        began = last_report = time.monotonic()
        summary.setup_seconds = began - setup
        try:
            for index in range(start, start + cases):
                case = make_case(seeds, outside, seed, index, fix_every)
                shutil.rmtree(case_dir, ignore_errors=True)
                in_dir, out_dir = case_dir / "in", case_dir / "out"
                materialize(case.tree, in_dir)
                out_dir.mkdir()
                before = snapshot(in_dir)
                out_name = Path(case.seed.arg).name
                request = {
                    "index": index,
                    "path": str(in_dir / case.seed.arg),
                    "in_dir": str(in_dir),
                    "out_dir": str(out_dir),
                    "out": str(out_dir / out_name),
                    "fix": case.fix,
                    "fill": case.fill,
                    "link": case.link,
                }
                limit = timeout if deaths[case.mutator] < hang_budget else min(timeout, SLOW_TIMEOUT_S)
                raw = supervisor.run(request, limit)
                if raw.death is not None:
                    deaths[case.mutator] += 1
                changed = _differences(before, snapshot(in_dir))
                outside_changed = _differences(outside_before, snapshot(outside.root))
                left = _output_left(case, raw, out_dir, out_name)
                findings = classify(case, raw, changed, left, rss_mib, package_dir, os.path.realpath(workdir))
                if outside_changed:
                    findings.append(Finding("outside-changed", "inspect/fix", "; ".join(outside_changed)[:1000]))
                    outside = make_outside(seeds, workdir / "outside")
                    outside_before = snapshot(outside.root)
                _tally(summary, case, raw, findings)
                for finding in findings:
                    group = summary.groups.setdefault(
                        finding.signature, Group(finding.kind, finding.signature, finding.detail)
                    )
                    group.count += 1
                    group.cases.append(index)
                    if len(group.saved) < keep:
                        saved = save_reproducer(out, finding, case, raw, seed, corpus_dir.resolve(), outside)
                        group.saved.append(str(saved))
                if verbose:
                    record = {"case": index, "seed": case.seed.name, "mutator": case.mutator, "notes": case.notes,
                              "death": raw.death, "response": raw.response,
                              "findings": [dataclasses.asdict(f) for f in findings]}  # fmt: skip
                    print(json.dumps(record, indent=2, default=str))
                if index % 200 == 0:
                    supervisor.trim_log()
                if progress and time.monotonic() - last_report > 5:
                    last_report = time.monotonic()
                    elapsed = last_report - began
                    print(f"[fuzz] {summary.cases}/{cases} cases, {summary.findings} with findings "
                          f"({len(summary.groups)} distinct), {summary.cases / elapsed:.1f}/s",
                          file=sys.stderr, flush=True)  # fmt: skip
        except KeyboardInterrupt:
            summary.interrupted = True
        finally:
            summary.seconds = time.monotonic() - began
            summary.worker_starts = supervisor.starts
            supervisor.stop()
            shutil.rmtree(case_dir, ignore_errors=True)
    _write_index(out, summary)
    return summary


def _tally(summary: Summary, case: Case, raw: Raw, findings: Sequence[Finding]) -> None:
    summary.cases += 1
    summary.findings += bool(findings)
    summary.fuzzer_errors += any(note.startswith("fuzzer error") for note in case.notes)
    outcome = "finding" if findings else _label(raw.response["inspect"] if raw.response else None)
    summary.by_kind[case.seed.kind, outcome] += 1
    summary.by_mutator[case.mutator, outcome] += 1
    if case.fix:
        summary.fix[raw.death or _label(raw.response.get("fix") if raw.response else None)] += 1
    summary.slowest = sorted([*summary.slowest, (raw.seconds, case.index, case.mutator)])[-3:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("fuzz-findings"))
    parser.add_argument("--start", type=int, default=0, help="the first case index")
    parser.add_argument("--only", type=int, default=None, help="run just this case index, and print what happened")
    parser.add_argument("--fix-every", type=int, default=10, help="also fix every N'th case (0: never)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a case may take")
    parser.add_argument("--rss-mib", type=int, default=1024, help="the worker's memory limit (resident)")
    parser.add_argument("--fsize-mib", type=int, default=256, help="the largest file the worker may write")
    parser.add_argument("--corpus", type=Path, default=None, help="keep (or reuse) the seed checkpoints here")
    parser.add_argument("--keep", type=int, default=10, help="reproducers saved per distinct finding")
    parser.add_argument("--hang-budget", type=int, default=3)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    start, cases = (args.only, 1) if args.only is not None else (args.start, args.cases)
    summary = run(
        cases,
        args.seed,
        args.out,
        start=start,
        fix_every=args.fix_every,
        timeout=args.timeout,
        rss_mib=args.rss_mib,
        fsize_mib=args.fsize_mib,
        corpus=args.corpus,
        keep=args.keep,
        hang_budget=args.hang_budget,
        progress=not args.quiet,
        verbose=args.only is not None,
    )
    print(format_summary(summary, args.out))
    if summary.interrupted:
        return 130
    return 1 if summary.findings else 0


if __name__ == "__main__":
    sys.exit(main())
