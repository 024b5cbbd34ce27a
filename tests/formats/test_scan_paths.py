"""The compiled pickle scan does exactly as the Python one: the same ends, the same refusals, word for word.

``tests/formats/test_pickle_limits.py`` runs every test of the scan on both (``both_scans``); here they are
compared on every pickle in real checkpoints, on hostile pickles the other tests do not make (text memo
indices, other buffers), and on thousands of pickles mutated at random and opcode streams drawn by hypothesis.
"""

from __future__ import annotations

import io
import mmap
import pickle
import random
import struct
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optim_repair.errors import InputError
from optim_repair.formats import pickle_limits
from optim_repair.formats.pickle_limits import MAX_DEPTH, check_pickle, scan_python
from tests.factories import dcp as dk
from tests.factories import defects, hostile, trainers
from tests.factories.built import Built
from tests.formats.conftest import BUILT, NOT_BUILT, compiled_scan, outcome
from tests.formats.test_pickle_limits import frame, laughs, optimizer_pickle

pytestmark = pytest.mark.skipif(not BUILT, reason=NOT_BUILT)


def agree(data: bytes, pos: int = 0) -> tuple[object, object]:
    """What both scans make of ``data``, shown to be the same."""
    expected = outcome(scan_python, data, pos)
    assert outcome(compiled_scan, data, pos) == expected, data[:200]
    return expected


def pickles_in(path: Path) -> Iterator[tuple[bytes, int]]:
    """Every pickle in a checkpoint's files: a zip's ``.pkl`` members, and those one after another in any other
    file (a legacy torch file's five, a DCP ``.metadata``), up to the first that the Python scan refuses."""
    for file in sorted(path.rglob("*") if path.is_dir() else [path]):
        if not file.is_file() or file.suffix in (".json", ".safetensors", ".distcp"):
            continue
        if zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as archive:
                yield from ((archive.read(name), 0) for name in archive.namelist() if name.endswith(".pkl"))
            continue
        data, pos = file.read_bytes(), 0
        while pos < len(data):
            try:
                end = scan_python(data, pos)[0]
            except Exception:  # past the last pickle: a legacy file's storages
                break
            yield data, pos
            pos = end


BUILDERS: dict[str, Callable[[Path], Built]] = {
    "unirl_torch": trainers.unirl_torch,
    "legacy_format": trainers.legacy_format,
    "multi_optimizer": trainers.multi_optimizer,
    "petrainer": trainers.petrainer,
    "tricky_tensors": defects.tricky_tensors,
    "unirl_dcp": dk.unirl_dcp,
    "sharded_dcp": dk.sharded_dcp,
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_pickle_in_real_checkpoints_is_scanned_alike(name: str, tmp_path: Path) -> None:
    found = list(pickles_in(BUILDERS[name](tmp_path).path))
    assert found
    for data, pos in found:
        assert agree(data, pos)[0] == "scanned"
        with io.BytesIO(data) as stream:
            stream.seek(pos)
            assert check_pickle(stream, "data.pkl") is False


def text_memo(index: bytes) -> list[bytes]:
    """Protocol 0 pickles whose memo index is ``index`` as text: stored (PUT), fetched (GET), both."""
    return [b"N" + b"p" + index + b"\n.", b"Np0\nNp1\n" + b"g" + index + b"\n" + b"\x87.", b"g" + index + b"\n."]


TEXT_INDICES = [
    b"0", b"1", b"2", b"-1", b"-2", b"-3", b" 1 ", b"+1", b"1_0", b"01", b"", b"x", b"1.5", b"\xff",
    b"9" * 18, b"9" * 19, b"9" * 30, b"-" + b"9" * 30, b"1" * 5000, b"0" * 40 + b"1",
]  # fmt: skip
"""Memo indices as text that the unpickler's ``int()`` reads, or refuses: signs, spaces, underscores, no digits,
past 64 bits, past ``int``'s digit limit."""
HOSTILE = [
    *(case for index in TEXT_INDICES for case in text_memo(index)),
    b"", b".", b"N", b"NN.", b"(.", b"N(.", b"0.", b"1.", b"(t.", b"(l.", b"\xff.", b"'.", b"\\.", b"\n.",
    b"N\x94b.", b"N(b.", b"]N(b0.", b"](Nb.", b"](Nbe.", b"]\x94(h\x00e.", b"]\x94(h\x00h\x00e.", b"]2a.",
    b"}\x94h\x00h\x00s.", b"]\x94h\x00a.", b"N\x85\x94h\x00\x85R.", b"N(\x85\x94)R.", b"NN)}\x92.",
    hostile.PROTO2 + b"]\x94]\x94a" + b"h\x01Na0.", hostile.billion_laughs(30) + b".", hostile.memo_bomb(),
    b"}" + laughs(20) + b"Ns.", b"(" + laughs(20) + b"\x91.", b"N" + laughs(19) + b"\x85R.",
    b"N" + laughs(18) + laughs(18)[2:] + b"}\x92.", b"N" + laughs(20) + b"b.", b"]" + laughs(20) + b"\x94a.",
    hostile.deep_tuple(MAX_DEPTH) + b".", hostile.deep_tuple(MAX_DEPTH + 1) + b".",
    hostile.deep_list(MAX_DEPTH) + b".", hostile.deep_list(MAX_DEPTH + 1) + b".",
    b"]" * MAX_DEPTH + b"\x94a" * (MAX_DEPTH - 1) + b"h\x00a.", b"]\x94" + b"h\x00" * 200 + b"e" + b".",
    b"\x80\x04" + frame(b"N\x94") + frame(b"h\x00\x86."), b"\x80\x04" + frame(frame(b"N")) + b".",
    b"\x80\x04\x95" + struct.pack("<Q", 1 << 63) + b"N.", b"\x8e" + struct.pack("<Q", (1 << 64) - 1) + b".",
    b"X" + struct.pack("<I", (1 << 32) - 1) + b".", b"\x8c\xff.", b"cbuiltins\n", b"cbuiltins\nlist", b"c\n\n.",
    b"\x95" + bytes(8) + b"N.", b"\x95" + bytes(7), b"N\x95" + struct.pack("<Q", 1) + b".",
]  # fmt: skip
"""Hostile pickles beyond ``test_pickle_limits``' (which both scans run too): each refusal, and its neighbours."""


@pytest.mark.parametrize("data", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_pickles_are_refused_alike(data: bytes) -> None:
    agree(data)
    agree(b"junk" + data, 4)
    agree(data, len(data) + 1)


def test_hostile_pickles_refused_through_check_pickle_read_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    def message(data: bytes) -> str:
        try:
            check_pickle(io.BytesIO(data), "x.pkl")
        except InputError as exc:
            return str(exc)
        return "accepted"

    for data in HOSTILE:
        monkeypatch.setattr(pickle_limits, "SCANNER", "pure-python")
        expected = message(data)
        monkeypatch.setattr(pickle_limits, "SCANNER", "compiled")
        assert message(data) == expected, data[:100]


def test_any_buffer_is_scanned_as_its_bytes(tmp_path: Path) -> None:
    data = optimizer_pickle()
    path = tmp_path / "data.pkl"
    path.write_bytes(data)
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert compiled_scan(mapped, 0) == scan_python(mapped, 0) == (len(data), False)
    assert compiled_scan(bytearray(data), 0) == compiled_scan(memoryview(data), 0) == (len(data), False)
    with pytest.raises(TypeError):
        compiled_scan("not a buffer", 0)


def mutations(data: bytes, count: int, seed: int) -> Iterator[bytes]:
    """``count`` copies of ``data``, each with a few bytes flipped, set to opcodes, inserted, dropped or cut."""
    rng = random.Random(seed)
    opcodes = bytes(code for code in range(256) if pickle_limits.opcodes.PICKLE.table[code] is not None)
    for _ in range(count):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(mutated) + 1)
            how = rng.randrange(6)
            if how == 0 and at < len(mutated):
                mutated[at] ^= 1 << rng.randrange(8)
            elif how == 1 and at < len(mutated):
                mutated[at] = rng.choice(opcodes)
            elif how == 2:
                mutated[at:at] = bytes([rng.choice(opcodes)]) * rng.randint(1, 3)
            elif how == 3:
                del mutated[at : at + rng.randint(1, 8)]
            elif how == 4:
                mutated[at:at] = mutated[rng.randrange(len(mutated) + 1) :][: rng.randint(1, 40)]  # a piece repeated
            else:
                mutated = mutated[: max(at, 1)]
        yield bytes(mutated)


PLAIN = {"state": {0: {"step": 3.0, "exp_avg": [1.5, -2], "key": (1, "a", None)}}, "groups": [{"params": [0, 1]}]}


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_mutated_pickles_are_scanned_alike(protocol: int) -> None:
    data = optimizer_pickle() if protocol == 2 else pickle.dumps([PLAIN, PLAIN, (PLAIN,)], protocol=protocol)
    outcomes = {str(agree(mutated)[0]) for mutated in mutations(data, 1500, seed=protocol)}
    assert "scanned" in outcomes and len(outcomes) > 1, "some mutations are read, some refused"


OPS = b"N(t)l]d}s\x8f\x90\x91ae\x85\x86\x87\x94h\x00h\x01q\x01g0\np2\nRb\x81\x922012Q\x93\x8e\x85\x95"
"""Opcodes of every kind (with arguments where short), drawn one after another by hypothesis."""


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from([OPS[i : i + 1] for i in range(len(OPS))] + [b"h\x00", b"q\x00"]), max_size=60))
def test_drawn_opcode_streams_are_scanned_alike(ops: list[bytes]) -> None:
    data = b"N\x94" + b"".join(ops)
    agree(data + b".")
    agree(data)
