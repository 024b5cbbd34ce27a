"""What torch's loader checks, checked from metadata alone: a file torch refuses gets no verdict, but exit 4.

Each case is a real ``torch.save`` output with one field damaged; each test proves against torch itself that
``torch.load(weights_only=True)`` refuses it before it asserts that ``inspect`` says so.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.factories import trainers
from tests.factories.support import overwrite, rewrite_pickle
from tests.factories.trainers import single_file

_FALSE_HOOKS = b"\x89h\x02)R"
"""``requires_grad=False, backward_hooks=OrderedDict()`` as torch.save pickles them (the class memoized as 2)."""


def _first(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        assert old in data
        return data.replace(old, new, 1)

    return edit


def refused_as_torch_would(path: Path, reason: str) -> None:
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        torch.load(path, weights_only=True)
    result = run_cli(["inspect", path], code=4)
    assert result.stderr.count("\n") == 1 and f"{path}: torch will refuse this file: {reason}" in result.stderr


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        (_FALSE_HOOKS, b"K\x01h\x02)R", "a tensor of storage 0 has requires_grad 1, not a bool"),
        (_FALSE_HOOKS, b"Nh\x02)R", "a tensor of storage 0 has requires_grad None, not a bool"),
        (b"QK\x00", b"QK\x01", "a tensor's size (8, 4), stride (4, 1) and offset 1 reach past its storage 0"),
    ],
    ids=["requires-grad-int", "requires-grad-none", "past-its-storage"],
)
def test_a_tensor_torch_cannot_rebuild(tmp_path: Path, old: bytes, new: bytes, reason: str) -> None:
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    rewrite_pickle(path, _first(old, new))
    refused_as_torch_would(path, reason)


def test_a_tensor_rebuilt_with_metadata_that_is_no_dict(tmp_path: Path) -> None:
    """Found by the fuzzer: torch's set_tensor_metadata asserts a dict (an AssertionError, refused all the same),
    and inspect called the file healthy."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    rewrite_pickle(path, _first(_FALSE_HOOKS, _FALSE_HOOKS + b"K\x01\x85"))  # a seventh argument: (1,)
    with pytest.raises(AssertionError, match="expected dict"):
        torch.load(path, weights_only=True)
    result = run_cli(["inspect", path], code=4)
    assert "torch will refuse this file: a tensor of storage 0 has the metadata (1,), not a dict" in result.stderr


def test_an_integer_tensor_that_requires_grad(tmp_path: Path) -> None:
    path = single_file(tmp_path, "counts.pt", {"counts": torch.zeros(3, dtype=torch.int64)})
    rewrite_pickle(path, _first(b"\x89ccollections\nOrderedDict\n", b"\x88ccollections\nOrderedDict\n"))
    refused_as_torch_would(path, "a int64 tensor of storage 0 requires grad")


def rezipped(
    path: Path,
    edit: Callable[[zipfile.ZipInfo, bytes], bytes] = lambda info, data: data,
    comment: bytes = b"",
) -> None:
    """Write the zip torch file at ``path`` again with Python's zipfile, each record through ``edit`` (which may
    rename it), and the archive ``comment``."""
    with zipfile.ZipFile(path) as archive:
        records = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in records:
            archive.writestr(info, edit(info, data))
        archive.comment = comment


def central_entry(path: Path, name: str) -> int:
    """Where the central-directory entry of the record ``name`` starts in the zip file at ``path``."""
    data = path.read_bytes()
    entry = data.index(b"PK\x01\x02")
    while data[entry + 46 : entry + 46 + struct.unpack_from("<H", data, entry + 28)[0]] != name.encode():
        entry = data.index(b"PK\x01\x02", entry + 4)
    return entry


def test_a_legacy_file_of_another_protocol_version(tmp_path: Path) -> None:
    path = trainers.unirl_torch(tmp_path, legacy=True).path / "checkpoint.pt"
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
    assert path.read_bytes()[len(magic) :].startswith(pickle.dumps(1001, protocol=2))
    overwrite(path, len(magic), pickle.dumps(7, protocol=2))  # as long as 1001's: BININT2
    refused_as_torch_would(path, "its protocol version is 7, not 1001")


def test_a_byteorder_neither_little_nor_big(tmp_path: Path) -> None:
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    rezipped(path, lambda info, data: b"middle" if info.filename.endswith("/byteorder") else data)
    refused_as_torch_would(path, "its byteorder record says b'middle', neither little nor big")


def test_a_framing_record_that_fails_its_crc_names_the_input(tmp_path: Path) -> None:
    """Once read only by the verifier, from both files: "the copy cannot be read back" (exit 5)."""
    path = trainers.unirl_torch(tmp_path / "in").path / "checkpoint.pt"
    with zipfile.ZipFile(path) as archive:
        info = next(info for info in archive.infolist() if info.filename.split("/", 1)[1] == "version")
    data = path.read_bytes()
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)  # its local header's
    start = info.header_offset + 30 + name_length + extra_length
    overwrite(path, start, bytes([data[start] ^ 0x01]))
    out = tmp_path / "out.pt"
    result = run_cli(["fix", path, "--out", out], code=4)
    assert f"{path}: damaged zip archive (record '{info.filename}' fails its size or CRC)" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("flag", [0x1, 0x20, 0x40, 0x2000])
def test_a_record_marked_encrypted_or_patched(tmp_path: Path, flag: int) -> None:
    """miniz refuses these flags in the central directory ("unsupported encryption"); found by the fuzzer."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    with zipfile.ZipFile(path) as archive:
        storage = next(info for info in archive.infolist() if "/data/" in info.filename)
    entry = central_entry(path, storage.filename)
    flags = struct.unpack_from("<H", path.read_bytes(), entry + 8)[0]
    overwrite(path, entry + 8, struct.pack("<H", flags | flag))
    refused_as_torch_would(path, f"record '{storage.filename}' is marked encrypted or patched")


def test_a_central_directory_placing_a_record_before_the_file() -> None:
    """Four bytes cut before the central directory of a DCP bytes entry: zipfile computes a negative offset for
    its first record, which crashed the reader (found by the fuzzer)."""
    from optim_repair.errors import InputError
    from optim_repair.formats.dcp.storage import read_saved_object

    buffer = io.BytesIO()
    torch.save(1e-8, buffer)
    data = buffer.getvalue()
    cut = data.index(b"PK\x01\x02")
    with pytest.raises(InputError, match=r"damaged zip record 'archive/data\.pkl' \(it begins before the file\)"):
        read_saved_object(data[: cut - 4] + data[cut:], "entry")


@pytest.mark.parametrize(
    ("rename", "reason"),
    [
        (
            lambda name: "x/data.pkl" if name.endswith("/data.pkl") else name,
            "record 'checkpoint/.format_version' is not in the archive's folder 'x/'",
        ),
        (lambda name: name.replace("/version", "/versio"), "it has no version record"),
    ],
)
def test_an_archive_layout_torch_refuses(tmp_path: Path, rename: Callable[[str], str], reason: str) -> None:
    """torch takes the first record's folder for the archive's, and needs data.pkl and a version there (the
    first found by the fuzzer in a DCP bytes entry)."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"

    def renamed(info: zipfile.ZipInfo, data: bytes) -> bytes:
        info.filename = rename(info.filename)
        return data

    rezipped(path, renamed)
    refused_as_torch_would(path, reason)


def test_a_record_on_another_disk(tmp_path: Path) -> None:
    """miniz refuses a central-directory entry whose disk is neither 0 nor 1 ("unsupported multidisk archive");
    Python's zipfile reads it (found by the fuzzer)."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    entry = path.read_bytes().index(b"PK\x01\x02")
    overwrite(path, entry + 34, struct.pack("<H", 65535))
    refused_as_torch_would(path, "record 'checkpoint/data.pkl' is on disk 65535 of several")


def test_a_storage_record_marked_a_directory(tmp_path: Path) -> None:
    """miniz takes a record whose external attributes say directory for one, and torch then reads uninitialized
    memory for the tensor (two loads differ); its copy, written with plain attributes, would read the real
    bytes (found by the fuzzer's torch oracle as a copy that differs)."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    overwrite(path, central_entry(path, "checkpoint/data/0") + 38, struct.pack("<I", 0x10))
    result = run_cli(["inspect", path], code=4)
    assert "record 'checkpoint/data/0' is marked a directory: torch reads none of it" in result.stderr


def test_an_entry_whose_comment_runs_past_the_directory(tmp_path: Path) -> None:
    """Python's zipfile reads the comment from what follows; miniz says "invalid header" (found by the fuzzer)."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    data = path.read_bytes()
    last = data.rindex(b"PK\x01\x02")
    overwrite(path, last + 32, struct.pack("<H", 65535))
    refused_as_torch_would(path, "the entries of its directory run past the size its end record gives it")


def test_a_zip64_end_record_of_another_disk(tmp_path: Path) -> None:
    """torch writes a zip64 end record, whose disk numbers miniz reads instead of the classic one's."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    end64 = path.read_bytes().rindex(b"PK\x06\x06")
    overwrite(path, end64 + 16, struct.pack("<I", 2))  # the number of this disk
    refused_as_torch_would(path, "its end record describes an archive of several disks")


def test_a_stored_record_whose_sizes_differ(tmp_path: Path) -> None:
    """miniz refuses a stored record whose compressed size is not its size (found by the fuzzer)."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    overwrite(path, central_entry(path, "checkpoint/data/0") + 20, struct.pack("<I", 1))
    refused_as_torch_would(path, "record 'checkpoint/data/0' is stored, yet its directory gives 1 stored bytes for")


def test_a_storage_type_called_as_a_function(tmp_path: Path) -> None:
    """The weights-only loader gives a storage type, not a callable ("'StorageType' object is not callable";
    found by the fuzzer: the hooks' OrderedDict renamed)."""
    path = single_file(tmp_path, "checkpoint.pt", {"w": torch.zeros(2)})
    rewrite_pickle(path, _first(b"ccollections\nOrderedDict\n", b"ctorch\nBFloat16Storage\n"))
    refused_as_torch_would(path, "its pickle calls torch.BFloat16Storage, which torch's loader cannot call")


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (b")", "()"),
        (b"X\x03\x00\x00\x00cpu\x88\x86", "('cpu', True)"),
        (b"G?\xf8\x00\x00\x00\x00\x00\x00\x85", "(1.5,)"),
    ],
    ids=["no-arguments", "a-bool-index", "a-float"],
)
def test_a_device_torch_cannot_construct(tmp_path: Path, args: bytes, shown: str) -> None:
    """``torch.device`` is allowlisted, and called with the arguments the pickle gives: torch refuses others with a
    TypeError, which a fix would have copied into the repaired file."""
    path = single_file(tmp_path, "checkpoint.pt", {"w": torch.zeros(2), "device": torch.device("cpu")})
    # the string's memo entry is kept, holding the new arguments, so that the memo stays numbered as torch's
    edit = re.compile(rb"X\x03\x00\x00\x00cpu(q.)\x85", re.DOTALL)
    rewrite_pickle(path, lambda data: edit.sub(lambda found: args + found.group(1), data, count=1))
    refused_as_torch_would(path, f"its pickle calls torch.device with {shown}, arguments it refuses")


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (
            _first(b"ctorch\nSize\n", b"ctorch\nper_tensor_affine\n"),
            "its pickle calls torch.per_tensor_affine, which torch's loader cannot call",
        ),
        (
            _first(b"K\x02\x85q\x03\x85", b"K\x02q\x03\x85"),
            "its pickle calls torch.Size with (2,), arguments it refuses",
        ),
    ],
    ids=["a-qscheme-called", "a-size-of-an-int"],
)
def test_an_allowlisted_torch_global_called_as_torch_would_refuse(
    tmp_path: Path, edit: Callable[[bytes], bytes], reason: str
) -> None:
    """torch's weights-only loader gives a quantization scheme as a value (calling it is a TypeError), and
    ``torch.Size`` takes one iterable of integers."""
    path = single_file(tmp_path, "checkpoint.pt", {"size": torch.Size([2])})
    rewrite_pickle(path, edit)
    refused_as_torch_would(path, reason)


def test_a_layout_is_named_as_torch_names_it(tmp_path: Path) -> None:
    """torch pickles a layout through ``torch.serialization._get_layout``, and its weights-only loader refuses the
    global ``torch.strided`` itself."""
    path = single_file(tmp_path, "checkpoint.pt", {"layout": torch.strided})
    torch.load(path, weights_only=True)
    rewrite_pickle(path, _first(b"ctorch.serialization\n_get_layout\n", b"ctorch\nstrided\n"))
    with pytest.raises(pickle.UnpicklingError, match=r"Unsupported global: GLOBAL torch\.strided"):
        torch.load(path, weights_only=True)
    result = run_cli(["inspect", path], code=4)
    assert "refuses to load global torch.strided" in result.stderr


def test_an_archive_comment_is_refused(tmp_path: Path) -> None:
    """torch.save writes none, and torch's reader fails on some lengths ("Invalid argument"; found by the fuzzer)."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    rezipped(path, comment=bytes(10000))
    result = run_cli(["inspect", path], code=4)
    assert "damaged zip archive (a comment of 10000 bytes, which torch.save never writes)" in result.stderr


def test_a_rebuild_function_called_with_the_wrong_count(tmp_path: Path) -> None:
    """Every rebuild function torch allows takes a fixed number of arguments ("_rebuild_qtensor() missing 7
    required positional arguments"; found by the fuzzer: the hooks' OrderedDict renamed)."""
    path = single_file(tmp_path, "checkpoint.pt", {"w": torch.zeros(2)})
    rewrite_pickle(path, _first(b"ccollections\nOrderedDict\n", b"ctorch._utils\n_rebuild_qtensor\n"))
    refused_as_torch_would(path, "a tensor is rebuilt by _rebuild_qtensor with 0 arguments")


def _storage_ids(data: bytes) -> list[int]:
    """Where each storage's persistent id ends in a pickle: its TUPLE (then a memo store, then BINPERSID)."""
    return [
        at
        for at in range(len(data) - 3)
        if data[at] == ord("t") and data[at + 1] == ord("q") and data[at + 3] == ord("Q")
    ]


def test_a_storage_id_of_the_other_format_is_refused(tmp_path: Path) -> None:
    """torch's legacy loader unpacks five fields after "storage" (the last a view), its zip loader four: an id of
    the other length makes either raise, so each is refused as damaged, exit 4 (found by the fuzzer)."""
    legacy = trainers.unirl_torch(tmp_path / "legacy", legacy=True).path / "checkpoint.pt"
    data = legacy.read_bytes()
    view = _storage_ids(data)[0] - 1
    assert data[view : view + 1] == b"N"  # no view
    legacy.write_bytes(data[:view] + data[view + 1 :])
    with pytest.raises(ValueError, match="not enough values to unpack"):
        torch.load(legacy, weights_only=False)
    assert "unexpected persistent id" in run_cli(["inspect", legacy], code=4).stderr

    zipped = trainers.unirl_torch(tmp_path / "zip").path / "checkpoint.pt"
    rewrite_pickle(
        zipped, lambda pickled: pickled[: _storage_ids(pickled)[0]] + b"N" + pickled[_storage_ids(pickled)[0] :]
    )
    with pytest.raises(ValueError, match="too many values to unpack"):
        torch.load(zipped, weights_only=True)
    assert "unexpected persistent id" in run_cli(["inspect", zipped], code=4).stderr


def test_a_zip64_end_locator_pointing_past_the_archive(tmp_path: Path) -> None:
    """zipfile reads the zip64 end record just before the locator, miniz where the locator says (found by the
    fuzzer, in a DCP bytes entry)."""
    path = trainers.unirl_torch(tmp_path).path / "checkpoint.pt"
    locator = path.read_bytes().rindex(b"PK\x06\x07")
    overwrite(path, locator + 8 + 4, b"\xff")  # the high half of the record's offset
    refused_as_torch_would(path, "its zip64 end locator puts the zip64 end record at ")
