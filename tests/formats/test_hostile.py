"""Hostile and damaged input: a one-line error and exit 3 or 4, never a crash, a hang or a memory blowup.

Each case is the smallest input that showed a class of failure. They run in a child process with a
time limit and an address-space limit, so that a regression fails the test instead of the test run.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import struct
import subprocess
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from optim_repair.errors import InputError, OutOfMemory
from optim_repair.formats import pickle_limits
from optim_repair.formats.pickle_limits import LIVE_BYTES, MAX_LIVE
from optim_repair.formats.safetensors import read_weights
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import defects, hostile, trainers
from tests.factories.support import installed_command

LIMIT_BYTES = 3 << 30
TIGHT_LIMIT_BYTES = 1 << 30
"""For the inputs that once made a small file take more than a GiB: the tool itself needs far less."""


def _limits(memory: int) -> Callable[[], None]:
    def set_limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, LIMIT_BYTES))

    return set_limits


def refused(*args: str | Path, codes: tuple[int, ...] = (3, 4), timeout: float = 60, memory: int = LIMIT_BYTES) -> str:
    """Run the installed command under limits; assert a documented exit code and one error line; return it."""
    result = subprocess.run(
        [*installed_command(), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_limits(memory),
    )
    assert result.returncode in codes, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("optim-repair: error: "), result.stderr[-2000:]
    if "--json" in map(str, args):  # the error as one JSON document too
        error = json.loads(result.stdout)["error"]
        assert (error["exit_code"], error["message"]) == (result.returncode, lines[0][len("optim-repair: error: ") :])
    else:
        assert result.stdout == ""
    return lines[0]


CRAFTED = {
    "deep-tuple-key": hostile.optimizer_with_key(hostile.deep_tuple(500_000)),
    "billion-laughs-key": hostile.optimizer_with_key(hostile.billion_laughs()),
    "memo-index-2**28": hostile.memo_bomb(),
    "bytearray-2**32": hostile.bytearray_bomb(),
    "billion-laughs-persistent-id": hostile.billion_laughs_persistent_id(),
    "deep-list": hostile.PROTO2 + hostile.deep_list(100_000) + b".",
    "frame-of-8-GiB": b"\x80\x04\x95" + struct.pack("<Q", 8 << 30) + b"N.",
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_pickles_are_refused_in_bounded_time_and_memory(tmp_path: Path, name: str) -> None:
    path = hostile.torch_zip(tmp_path / "crafted.pt", CRAFTED[name])
    line = refused("inspect", path, codes=(4,))
    assert "crafted.pt: " in line


def test_an_opcode_across_the_end_of_its_frame_is_refused(tmp_path: Path) -> None:
    # The C unpickler reads the rest of this LONG_BINPUT's index afresh from past the frame, and
    # allocates a memo of 2**30 entries; read in order, the same bytes are a harmless pickle.
    crossing = b"\x80\x04\x95" + struct.pack("<Q", 4) + b"]r\x00\x00" + b"\x00\x000N."
    nested = b"\x80\x04\x95" + struct.pack("<Q", 10) + b"\x95" + struct.pack("<Q", 1) + b"N."
    metadata = dk.unirl_dcp(tmp_path / "dcp").path / ".metadata"  # pickle.load reads frames: so is it read
    for data, reason in ((crossing, "an opcode crosses the end of its frame"), (nested, "a frame inside another")):
        metadata.write_bytes(data)
        assert reason in refused("inspect", metadata.parent, codes=(4,))
        path = hostile.torch_zip(tmp_path / "framed.pt", data)  # torch's weights-only unpickler reads none
        assert "it holds the opcode FRAME (b'\\x95'), which torch's weights-only" in refused(
            "inspect", path, codes=(4,)
        )


def test_a_wide_dict_shared_after_it_was_made_deeper_is_walked_once(tmp_path: Path) -> None:
    """A dict of 100,000 keys, made deeper after a GET, then fetched 100,000 times (1.1 MB, a file torch loads): the
    pre-scan cannot know its depths, so the graph's are measured; that walk once rebuilt the dict's items for every
    reference to it (still running after 90 s). Each container is now expanded once."""
    path = hostile.torch_zip(tmp_path / "shared.pt", hostile.deepened_and_shared(100_000))
    loaded = torch.load(path, weights_only=True)
    assert len(loaded["refs"]) == 100_002 and len(loaded["refs"][0]) == 100_001
    del loaded
    result = subprocess.run(
        [*installed_command(), "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_limits(TIGHT_LIMIT_BYTES),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["verdict"] == "healthy"


def test_a_fifo_is_never_opened(tmp_path: Path) -> None:
    """A FIFO would block open() forever: as the argument, in a directory, as --model or as a DCP shard."""
    built = trainers.hf_trainer(tmp_path / "hf")
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    assert "fifo.pt: is a FIFO, not a file or directory" in refused("inspect", fifo, timeout=20)
    os.mkfifo(built.path / "extra.pt")
    os.mkfifo(built.path / "extra.safetensors")
    document = json.loads(run_cli(["inspect", built.path, "--json"], code=None).stdout)
    assert {"file": "extra.pt", "kind": "other", "reason": "is a FIFO, not a regular file"} in document["skipped"]
    assert "extra.pt: is a FIFO; optim-repair copies only" in refused("fix", built.path, "--out", tmp_path / "o")
    alone = trainers.unirl_torch(tmp_path / "u").path / "checkpoint.pt"
    line = refused("fix", alone, "--out", tmp_path / "f.pt", "--fill", "fresh", "--model", fifo, timeout=20)
    assert "is a FIFO" in line
    dcp = dk.unirl_dcp(tmp_path / "d").path
    (dcp / "__0_0.distcp").unlink()
    os.mkfifo(dcp / "__0_0.distcp")
    assert "__0_0.distcp: is a FIFO, not a regular file" in refused("inspect", dcp, timeout=20)


def test_a_link_is_read_through_only_to_a_regular_file(tmp_path: Path) -> None:
    """A link to a FIFO or a device is never opened, in a directory, as a DCP shard, or followed with -L."""
    built = trainers.hf_trainer(tmp_path / "hf")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (built.path / "extra.pt").symlink_to(fifo)
    (built.path / "zeros.safetensors").symlink_to("/dev/zero")
    document = json.loads(run_cli(["inspect", built.path, "--json"], code=None).stdout)
    assert {"file": "extra.pt", "kind": "other", "reason": "is a link to a FIFO, not a regular file"} in document[
        "skipped"
    ]
    assert {
        "file": "zeros.safetensors",
        "kind": "other",
        "reason": "is a link to a character device, not a regular file",
    } in document["skipped"]
    line = refused("fix", built.path, "--out", tmp_path / "o", "--dereference", timeout=20)
    assert "extra.pt: is a link to a FIFO; optim-repair copies only" in line
    dcp = dk.unirl_dcp(tmp_path / "d").path
    (dcp / "__0_0.distcp").unlink()
    (dcp / "__0_0.distcp").symlink_to(fifo)
    assert "__0_0.distcp: is a FIFO, not a regular file" in refused("inspect", dcp, timeout=20)


def test_a_link_loop_is_a_short_error(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    line = refused("inspect", loop)
    assert "loop: cannot read (Too many levels of symbolic links)" in line and len(line) < 200


def _zip_with(path: Path, name: str, data: bytes, compress: int = zipfile.ZIP_DEFLATED) -> Path:
    """A copy of a real torch file with one more record (or a replaced one), written with ``compress``."""
    source = defects.healthy(path.parent / "seed").path
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(path, "w") as archive:
        for info in original.infolist():
            if not info.filename.endswith(name):
                archive.writestr(info, original.read(info), compress_type=info.compress_type)
        prefix = original.infolist()[0].filename.split("/")[0]
        archive.writestr(f"{prefix}/{name}", data, compress_type=compress)
    return path


def test_compressed_records_cannot_expand_without_bound(tmp_path: Path) -> None:
    """A deflated pickle or framing record is read only up to a cap, and never written out expanded."""
    pickle_bomb = _zip_with(tmp_path / "pickle.pt", "data.pkl", b"\x80\x02" + b"N0" * 1000 + b"N.")
    data = bytearray(pickle_bomb.read_bytes())
    entry = data.rindex(b"PK\x01\x02", 0, data.rindex(b"data.pkl"))  # its central directory entry
    data[entry + 24 : entry + 28] = struct.pack("<I", 3 << 30)  # claims to expand to 3 GiB
    pickle_bomb.write_bytes(bytes(data))
    assert "its pickle holds 3221225472 bytes" in refused("inspect", pickle_bomb, codes=(4,))
    framing_bomb = _zip_with(tmp_path / "framing.pt", "extra", bytes(2 << 20))
    assert "record" in refused("fix", framing_bomb, "--out", tmp_path / "out.pt", codes=(4,))
    assert not (tmp_path / "out.pt").exists()


def test_a_deflated_pickle_unpacks_to_no_more_than_a_multiple_of_its_size(tmp_path: Path) -> None:
    """500 MiB of pickle in half a megabyte once took 1.5 GiB; now a GiB of address space is more than enough."""
    bomb = hostile.deflated_pickle(tmp_path / "bomb.pt", 500 << 20)
    assert bomb.stat().st_size < 1 << 20
    line = refused("inspect", bomb, codes=(4,), memory=TIGHT_LIMIT_BYTES)
    assert "bomb.pt: its pickle holds 524288000 bytes packed in" in line
    hostile.claim_size(bomb, "data.pkl", 1000)  # the directory lies: it is unpacked only up to its limit
    line = refused("fix", bomb, "--out", tmp_path / "out.pt", codes=(4,), memory=TIGHT_LIMIT_BYTES)
    assert "bomb.pt: damaged zip archive (record 'archive/data.pkl' fails its size or CRC)" in line
    assert not (tmp_path / "out.pt").exists()


def test_records_that_share_bytes_are_refused(tmp_path: Path) -> None:
    """Storages whose directory entries all name one record: each copied whole, a small file wrote a huge one."""
    path = trainers.unirl_torch(tmp_path / "u").path / "checkpoint.pt"
    by_size: dict[int, list[str]] = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if "/data/" in info.filename:
                by_size.setdefault(info.file_size, []).append(info.filename)
    alike = max(by_size.values(), key=len)  # storages of one size: nothing but the overlap is wrong
    hostile.shared_record(path, alike[0], alike[1:])
    line = refused("fix", path, "--out", tmp_path / "out.pt", codes=(4,))
    assert "checkpoint.pt: damaged zip archive (records 'checkpoint/data/" in line and "overlap" in line
    assert not (tmp_path / "out.pt").exists()
    assert "overlap" in refused("inspect", path, codes=(4,))


def test_duplicate_record_names_are_refused(tmp_path: Path) -> None:
    path = _zip_with(tmp_path / "twice.pt", "byteorder", b"little", zipfile.ZIP_STORED)
    with zipfile.ZipFile(path, "a") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        archive.writestr(archive.infolist()[0].filename.rsplit("/", 1)[0] + "/byteorder", b"big")
    assert "two records are named" in refused("inspect", path, codes=(4,))


def test_a_zstd_entry_is_decompressed_only_up_to_a_cap(tmp_path: Path) -> None:
    import zstandard
    from torch.distributed.checkpoint.metadata import MetadataIndex

    path = dk.unirl_dcp(tmp_path).path
    bomb = zstandard.ZstdCompressor().compress(bytes(600 << 20))
    (path / "bomb.distcp").write_bytes(bomb)
    with (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    info = metadata.storage_data[MetadataIndex("optim.param_groups.0.lr")]
    info.relative_path, info.offset, info.length = "bomb.distcp", 0, len(bomb)
    info.transform_descriptors = ["stream.zstd/1"]
    with (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    assert "decompresses to more than" in refused("inspect", path, codes=(4,))


def test_odd_parameter_keys_are_refused_or_shown_escaped(tmp_path: Path) -> None:
    """bytes and NaN keys are damage (exit 4); a lone surrogate in a name is a name, shown escaped."""
    as_bytes = (
        b"c_codecs\nencode\n" + hostile.text("abc") + hostile.text("latin1") + b"\x86R"
    )  # as torch pickles b"abc"
    odd = {"bytes": as_bytes, "nan": b"G\x7f\xf8\x00\x00\x00\x00\x00\x00", "list": b"]", "dict": b"}"}
    for name, key in odd.items():
        path = hostile.torch_zip(tmp_path / f"{name}.pt", hostile.optimizer_with_param(key))
        assert "neither a name nor an index" in refused("inspect", path, "--json", codes=(4,)), name
        if name in ("bytes", "nan"):  # hashable: a state key too
            path = hostile.torch_zip(tmp_path / f"{name}-key.pt", hostile.optimizer_with_key(key))
            assert "neither a name nor an index" in refused("inspect", path, codes=(4,)), name
    surrogate = b"X\x03\x00\x00\x00\xed\xa0\x80"  # BINUNICODE of '\ud800', which pickle allows (surrogatepass)
    path = hostile.torch_zip(tmp_path / "surrogate.pt", hostile.optimizer_with_key(surrogate))
    for extra in ((), ("--json",)):
        result = subprocess.run([*installed_command(), "inspect", str(path), *extra], capture_output=True, text=True)
        assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr  # orphan-state
        assert "\\ud800" in result.stdout


def test_a_safetensors_header_is_refused_when_deep_or_larger_than_its_bytes(tmp_path: Path) -> None:
    built = trainers.unirl_torch(tmp_path / "u")
    weights = tmp_path / "model.safetensors"
    deep = b"[" * 100_000 + b"]" * 100_000
    weights.write_bytes(struct.pack("<Q", len(deep)) + deep)
    model = ["--fill", "fresh", "--model", weights]
    assert "not a safetensors file (bad header)" in refused("fix", built.path, "--out", tmp_path / "a", *model)
    header = json.dumps({"head_unused.weight": {"dtype": "F32", "shape": [1 << 31, 4], "data_offsets": [0, 16]}})
    weights.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(16))
    assert "does not fit its bytes" in refused("fix", built.path, "--out", tmp_path / "b", *model)


def test_a_safetensors_header_whose_metadata_is_no_map_of_strings_is_refused_as_the_library_refuses_it(
    tmp_path: Path,
) -> None:
    """The safetensors library refuses ``"__metadata__": []`` ("invalid type: sequence, expected a map"): a file it
    cannot load gives no shapes here either (found by fuzz --s3, where a store's reading and a disk's disagreed)."""
    import safetensors.torch
    import torch

    weights = tmp_path / "model.safetensors"
    for metadata in ([], {"format": 1}):
        header = json.dumps({"__metadata__": metadata, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
        weights.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(8))
        with pytest.raises(Exception):  # noqa: B017 (the library's own error type is not public)
            safetensors.torch.load_file(weights)
        with pytest.raises(InputError, match=r"not a safetensors file \(its __metadata__ is no map of strings\)"):
            read_weights(weights, "model.safetensors")
    safetensors.torch.save_file({"w": torch.zeros(2)}, weights, metadata={"format": "pt"})
    assert read_weights(weights, "model.safetensors").tensors


def test_a_safetensors_header_of_too_many_entries_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """1.4 million entries in a 100 MB header once took 1.4 GiB as --model."""
    built = trainers.unirl_torch(tmp_path / "u")
    weights = hostile.safetensors_entries(tmp_path / "model.safetensors", 1_400_000)
    line = refused("inspect", built.path, "--model", weights, codes=(4,), memory=TIGHT_LIMIT_BYTES)
    assert "model.safetensors: its safetensors header describes more than 262144 tensors" in line


def test_no_fill_is_sized_by_a_dcp_chunk_stored_in_fewer_bytes_than_it_holds(tmp_path: Path) -> None:
    # Read as a tensor subclass's own encoding (torchao's), but a fresh fill sized by it would be 32 GiB.
    path = dk.unirl_dcp(tmp_path).path
    with (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    key = "model.head.proj.weight"
    item = metadata.state_dict_metadata[key]
    item.size = type(item.size)([1 << 31, *item.size[1:]])
    item.chunks[0].sizes = item.size
    with (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    result = subprocess.run([*installed_command(), "inspect", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr[-2000:]
    fixed = tmp_path / "out"
    message = refused("fix", path, "--out", fixed, "--fill", "fresh", codes=(3,))
    assert f"{key} is stored in fewer bytes than its elements take" in message
    assert not fixed.exists()


def test_a_dcp_tensor_larger_than_its_chunks_is_refused(tmp_path: Path) -> None:
    # A fresh fill is sized by the weight's declared size: 2**28 elements held in 8 stored ones.
    path = dk.unirl_dcp(tmp_path).path
    with (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    item = metadata.state_dict_metadata["model.head.proj.weight"]
    item.size = type(item.size)([1 << 28, *item.size[1:]])
    with (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    assert "the chunks of model.head.proj.weight hold 8 of its" in refused("inspect", path, codes=(4,))
    fixed = tmp_path / "out"
    assert "hold 8 of its" in refused("fix", path, "--out", fixed, "--fill", "fresh", codes=(4,))
    assert not fixed.exists()


def test_a_dcp_range_past_its_shard_is_refused_when_read_not_when_verified(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    path = dk.unirl_dcp(tmp_path).path
    with (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    key = next(index for index in metadata.storage_data if index.fqn.endswith(".exp_avg"))
    assert isinstance(key, MetadataIndex)
    metadata.storage_data[key].offset = 1 << 64
    with (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    assert "lies past its end" in refused("inspect", path, codes=(4,))
    assert "lies past its end" in refused("fix", path, "--out", tmp_path / "out", codes=(4,))


@pytest.mark.parametrize(
    ("info", "message"),
    [
        ("not json", "its DCP_SHARDING_INFO gives no offsets of each tensor"),
        (json.dumps({"w": {"saved_offsets": [0]}}), "its DCP_SHARDING_INFO misplaces 'w'"),
        (json.dumps({"w": {"saved_offsets": [0, -4]}}), "its DCP_SHARDING_INFO misplaces 'w'"),
        (json.dumps({"other": {"saved_offsets": [0, 0]}}), "its DCP_SHARDING_INFO gives no offsets of each tensor"),
    ],
    ids=["not-json", "too-few", "negative", "another-tensor"],
)
def test_a_sharding_info_that_does_not_place_each_tensor_is_refused(tmp_path: Path, info: str, message: str) -> None:
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "shard-00000-model-00001-of-00001.safetensors"
    save_file({"w": torch.zeros(2, 3)}, path, metadata={"DCP_SHARDING_INFO": info})
    with pytest.raises(InputError, match=f"not a safetensors file \\({message}\\)"):
        read_weights(path, path.name)


@pytest.mark.parametrize("name", sorted(hostile.OUTSIDE_WEIGHTS_ONLY))
def test_a_torch_file_of_an_opcode_torchs_weights_only_unpickler_lacks_is_refused_naming_it(
    tmp_path: Path, name: str
) -> None:
    """Each such file once was repairable, and fix wrote a copy of it; torch.load refuses it."""
    import torch

    path = hostile.with_opcode(trainers.unirl_torch(tmp_path / "in").path / "checkpoint.pt", name)
    with pytest.raises(pickle.UnpicklingError, match="Unsupported operand"):
        torch.load(path, weights_only=True)
    named = f"it holds the opcode {name} "
    assert named in refused("inspect", path, codes=(4,))
    assert named in refused("fix", path, "--out", tmp_path / "out", codes=(4,))
    assert not (tmp_path / "out").exists()


def test_objects_alive_at_once_are_bounded_by_the_pickles_size(tmp_path: Path) -> None:
    """MARK, 15 million empty lists, POP_MARK: past a GiB in both scans; refused once past its bound."""
    data = b"\x80\x02(" + b"]" * 15_000_000 + b"1N."
    path = _zip_with(tmp_path / "alive.pt", "data.pkl", data, zipfile.ZIP_STORED)
    bound = MAX_LIVE + len(data) // LIVE_BYTES
    line = refused("inspect", path, codes=(4,), memory=TIGHT_LIMIT_BYTES)
    assert f"it holds more than {bound} objects at once on its stack and in its memo" in line


def test_a_diff_of_a_huge_integer_is_refused(tmp_path: Path) -> None:
    """A LONG4 of 5,000 digits: diff was exit 70 (Python refuses to print an integer of more than 4,300)."""
    huge = 10**4999
    ops = b"\x8b" + struct.pack("<I", huge.bit_length() // 8 + 1) + huge.to_bytes(huge.bit_length() // 8 + 1, "little")
    path = trainers.unirl_torch(tmp_path / "in").path / "checkpoint.pt"
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    hostile.with_pickle(path, data[:-1] + hostile.text("extra") + ops + b"s.")
    assert "it holds the opcode LONG4 " in refused("diff", path, path, codes=(4,))


def test_reading_past_the_memory_left_is_exit_4_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a memory limit (``ulimit -v``, a container) a file too large for it was exit 70, "internal error
    (MemoryError)"; the scan's memory is what runs out here, as the limit would make it."""
    import optim_repair

    def exhausted(*args: object) -> tuple[int, bool]:
        raise MemoryError

    path = defects.healthy(tmp_path / "in").path
    monkeypatch.setattr(pickle_limits, "scan", exhausted)
    with pytest.raises(OutOfMemory, match=r"needs more memory than is left$") as caught:
        optim_repair.inspect(path)
    assert caught.value.exit_code == 4
    for args in (["inspect", path], ["fix", path, "--out", tmp_path / "out.pt"], ["diff", path, path]):
        result = run_cli(args, code=4)
        assert result.stderr.splitlines() == [f"optim-repair: error: {path}: needs more memory than is left"]
    assert not (tmp_path / "out.pt").exists()
