"""Mutations of one file: its bytes, a zip archive's headers and members, a legacy torch file, safetensors."""

from __future__ import annotations

import io
import json
import pickle
import pickletools
import random
import struct
import warnings
import zipfile
from collections.abc import Callable, Iterable, Sequence

from fuzz.pickles import mutate_pickle

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

LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)


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
