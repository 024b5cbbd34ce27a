"""The pre-scan of a pickle: its opcodes read as ``pickletools`` reads them, and every bound it keeps.

The scan decodes opcodes itself; ``pickletools`` is the reference for what each opcode is (its
argument's encoding, what it takes from the stack and leaves there) and where each one starts.
Every test runs on both scans: the Python one, and the compiled one, shown to do as the Python one
on every input it is given (``tests/formats/conftest.py``).
"""

from __future__ import annotations

import inspect
import io
import pickle
import pickletools
import re
import struct
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch

from optim_repair.errors import InputError
from optim_repair.formats import pickle_limits
from optim_repair.formats.pickle_arguments import MAX_INT_BYTES, MAX_INT_DIGITS
from optim_repair.formats.pickle_limits import (
    MAX_DEPTH,
    MAX_WEIGHT,
    check_pickle,
    scan,
    scan_python,
)
from optim_repair.formats.pickle_opcodes import WEIGHTS_ONLY, WEIGHTS_ONLY_NAMES, OpcodeSet
from tests.factories import dcp as dk
from tests.factories import hostile
from tests.factories.models import TwoHeadNet, make_optimizer, train
from tests.formats.conftest import compiled_scan

pytestmark = pytest.mark.usefixtures("both_scans")
OPCODES = {ord(op.code): op for op in pickletools.opcodes}
PUSH = {pickletools.pydict: b"}", pickletools.pylist: b"]", pickletools.pyset: b"\x8f", pickletools.pytuple: b")"}
"""How to push an object of a given type; ``None`` (``N``) for every other."""
LENGTH_WIDTHS = {
    pickletools.TAKEN_FROM_ARGUMENT1: 1,
    pickletools.TAKEN_FROM_ARGUMENT4: 4,
    pickletools.TAKEN_FROM_ARGUMENT4U: 4,
    pickletools.TAKEN_FROM_ARGUMENT8U: 8,
}
BASE = b"N\x94"
"""Every pickle made here starts with ``None``, stored as memo entry 0, at the bottom of its stack."""


def refusal(data: bytes, allowed: OpcodeSet = pickle_limits.opcodes.PICKLE) -> str:
    """Why ``check_pickle`` refuses ``data`` (of the opcodes ``allowed``)."""
    with pytest.raises(InputError) as caught:
        check_pickle(io.BytesIO(data), "test.pkl", allowed=allowed)
    return str(caught.value)


def sample_argument(arg: pickletools.ArgumentDescriptor | None) -> bytes:
    """A valid argument for an opcode, encoded as its descriptor says: zeros, or one byte of data."""
    if arg is None:
        return b""
    if arg is pickletools.stringnl_noescape_pair:
        return b"0\n0\n"
    if arg is pickletools.stringnl:
        return b"'0'\n"
    if arg.n == pickletools.UP_TO_NEWLINE:
        return b"0\n"
    if arg.n in LENGTH_WIDTHS:
        return (1).to_bytes(LENGTH_WIDTHS[arg.n], "little") + b"x"
    return bytes(arg.n)


def pushes(stack: list[pickletools.StackObject]) -> bytes:
    """Opcodes that push what ``stack`` (an opcode's ``stack_before``) describes."""
    ops = b""
    for item in stack:
        if item is pickletools.markobject:
            ops += b"("
        elif item is pickletools.stackslice:
            ops += b"NN"
        else:
            ops += PUSH.get(item, b"N")
    return ops


def exercising(op: pickletools.OpcodeInfo, before: bytes | None = None) -> bytes:
    """A pickle that runs ``op`` once, on what its ``stack_before`` describes (or on ``before``), then pops
    what its ``stack_after`` describes and stops with the base alone on the stack."""
    before = pushes(op.stack_before) if before is None else before
    return BASE + before + op.code.encode("latin-1") + sample_argument(op.arg) + b"0" * len(op.stack_after) + b"."


def genops_end(data: bytes) -> int:
    """Where ``pickletools`` says the pickle ends: past its STOP."""
    *_, (op, _, position) = pickletools.genops(data)
    assert op.name == "STOP"
    assert position is not None
    return position + 1


@pytest.mark.parametrize("code", range(256), ids=lambda code: f"{code:#04x}")
def test_every_byte_is_read_as_pickletools_reads_it(code: int) -> None:
    op = OPCODES.get(code)
    if op is None:
        assert f"the unknown opcode {bytes([code])!r}" in refusal(BASE + bytes([code]) + b".")
        return
    data = BASE + b"." if op.name == "STOP" else exercising(op)
    # Its argument is read to its end, and its stack effect is the one pickletools documents: the
    # scan ends where pickletools does, with exactly the base left on its stack.
    assert scan(data) == (genops_end(data), False)
    assert scan(data + data, len(data)) == (2 * len(data), False)


@pytest.mark.parametrize("op", [op for op in pickletools.opcodes if op.stack_before], ids=lambda op: op.name)
def test_every_opcode_takes_what_pickletools_says_it_takes(op: pickletools.OpcodeInfo) -> None:
    if op.name == "STOP":
        assert "it stops with other than one object on its stack" in refusal(BASE + b"N.")
        return
    short = exercising(op, pushes(op.stack_before[1:]))  # without the first thing it takes
    if op.stack_before[0] is pickletools.markobject:
        assert "it pops a mark it never set" in refusal(short)
    else:  # one object short: the stack underflows, or is empty at STOP
        assert "its stack underflows" in refusal(short) or "other than one object on its stack" in refusal(short)


def optimizer_pickle() -> bytes:
    """``data.pkl`` of a real ``torch.save`` of a trained model's optimizer state dict."""
    model = TwoHeadNet()
    optimizer = make_optimizer(model, "adamw", groups=2)
    train(model, optimizer, 2)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    with zipfile.ZipFile(buffer) as archive:
        (name,) = (name for name in archive.namelist() if name.endswith("/data.pkl"))
        return archive.read(name)


def dcp_metadata(root: Path) -> bytes:
    """The ``.metadata`` pickle of a real ``torch.distributed.checkpoint.save`` of a model and its optimizer."""
    return (dk.unirl_dcp(root).path / ".metadata").read_bytes()


@pytest.fixture(params=["torch.save", "dcp.save"])
def torch_pickle(request: pytest.FixtureRequest, tmp_path: Path) -> bytes:
    return optimizer_pickle() if request.param == "torch.save" else dcp_metadata(tmp_path)


def test_torchs_own_pickles_end_where_pickletools_says(torch_pickle: bytes) -> None:
    assert scan(torch_pickle) == (genops_end(torch_pickle), False)
    assert check_pickle(io.BytesIO(torch_pickle), "data.pkl") is False


def test_a_torch_save_pickle_holds_only_opcodes_torchs_weights_only_unpickler_implements() -> None:
    data = optimizer_pickle()
    assert scan(data, 0, WEIGHTS_ONLY) == (genops_end(data), False)


def test_the_weights_only_opcodes_are_those_torchs_own_unpickler_implements() -> None:
    import torch._weights_only_unpickler as weights_only

    source = inspect.getsource(weights_only.Unpickler.load)
    assert set(re.findall(r"\b([A-Z][A-Z0-9_]*)\[0\]", source)) == WEIGHTS_ONLY_NAMES


@pytest.mark.parametrize(
    "op", [op for op in pickletools.opcodes if op.name not in WEIGHTS_ONLY_NAMES], ids=lambda op: op.name
)
def test_an_opcode_torchs_weights_only_unpickler_lacks_is_refused_naming_it(op: pickletools.OpcodeInfo) -> None:
    data = b"N" + op.code.encode("latin-1") + sample_argument(op.arg) + b"."
    named = f"it holds the opcode {op.name} ({op.code.encode('latin-1')!r}), which torch's weights-only unpickler"
    assert named in refusal(data, WEIGHTS_ONLY)
    assert "weights-only" not in outcome_of(data)  # every opcode of pickle: read as it is
    assert named in refusal(BASE.replace(b"\x94", b"q\x00") + b"N" + op.code.encode("latin-1") + b".", WEIGHTS_ONLY)


def outcome_of(data: bytes) -> str:
    """What ``check_pickle`` makes of ``data`` of every opcode: its refusal, or ``scanned``."""
    try:
        check_pickle(io.BytesIO(data), "test.pkl")
    except InputError as exc:
        return str(exc)
    return "scanned"


def test_the_scan_reads_an_opcode_wherever_pickletools_does(torch_pickle: bytes) -> None:
    # An unknown opcode put where pickletools reads one is met: the scan starts an opcode there too.
    positions = [position for _, _, position in pickletools.genops(torch_pickle)]
    assert len(positions) > 100
    for position in positions:
        assert position is not None
        data = bytearray(torch_pickle)
        data[position] = 0
        assert "the unknown opcode b'\\x00'" in refusal(bytes(data)), position


def test_a_torch_pickle_cut_anywhere_is_refused(tmp_path: Path) -> None:
    data = optimizer_pickle()  # protocol 2: no frames, so each cut is met where it is
    starts = {position for _, _, position in pickletools.genops(data)}
    for end in range(1, len(data)):
        reason = refusal(data[:end])
        if end in starts:
            assert "it ends without a STOP opcode" in reason, end
        else:
            assert "it ends inside an opcode" in reason or "it declares more bytes than it holds" in reason, end


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_in_every_protocol_is_accepted(protocol: int) -> None:
    key = ("nested", (1, 2.5, None, True), frozenset({b"x", -(1 << 70)}))
    shared = ["shared", {"depth": [[[[]]]]}]
    value = {
        key: [shared, shared, bytearray(b"\x00" * 300), "é" * 300, 1 << 40, -1.5e300],
        "set": {1, 2, 3},
        "big": list(range(2000)),
        "empty": ((), [], {}, set(), frozenset(), b"", ""),
    }
    data = pickle.dumps(value, protocol=protocol)
    assert scan(data) == (len(data), False)
    assert scan(b"junk" + data, 4) == (4 + len(data), False)
    assert check_pickle(io.BytesIO(data), "plain.pkl") is False


def test_making_a_container_taken_from_the_memo_deeper_says_its_depths_may_be_stale() -> None:
    # [inner] with inner memoized; then inner, fetched from the memo, gets an item: a list makes it deeper, so the
    # depth recorded for [inner] is stale; None does not (an appendix adding entries like its others: still exact).
    deeper = hostile.PROTO2 + b"]\x94]\x94a" + b"h\x01]a0."
    assert scan(deeper) == (len(deeper), True)
    level = hostile.PROTO2 + b"]\x94]\x94a" + b"h\x01Na0."
    assert scan(level) == (len(level), False)


def test_nesting_up_to_max_depth_is_accepted_and_deeper_refused() -> None:
    for deep in (hostile.deep_tuple, hostile.deep_list):
        assert scan(deep(MAX_DEPTH) + b".")[1] is False
        assert f"it nests containers more than {MAX_DEPTH} deep" in refusal(deep(MAX_DEPTH + 1) + b".")
    assert scan(b"}" + b"N" + b"\x85" * (MAX_DEPTH - 1) + b"b.")[1] is False  # BUILD: a state one level less deep
    assert f"more than {MAX_DEPTH} deep" in refusal(b"}" + b"N" + b"\x85" * MAX_DEPTH + b"b.")
    assert f"more than {MAX_DEPTH} deep" in refusal(b"N" + b"N" + b"\x85" * MAX_DEPTH + b"R.")


def test_a_tuple_heavier_than_max_weight_is_refused() -> None:
    levels = MAX_WEIGHT.bit_length()  # a tuple of 2**levels leaves
    assert f"a tuple expands to more than {MAX_WEIGHT} items" in refusal(hostile.billion_laughs(levels) + b".")


def laughs(levels: int) -> bytes:
    """Opcodes that push one tuple of ``2**levels`` leaves, each level the pair of the one below (from the memo)."""
    ops = b"K\x01" + hostile.binput(0) + b"0"
    for level in range(levels):
        ops += hostile.binget(level) * 2 + b"\x86" + hostile.binput(level + 1) + b"0"
    return ops + hostile.binget(levels)


def test_hashing_beyond_the_budget_is_refused() -> None:
    key = laughs(20)  # two million leaves: light enough to build, too heavy to hash
    over = "it asks for more hashing than its size justifies"
    assert over in refusal(hostile.optimizer_with_key(key))
    assert over in refusal(b"}" + key + b"Ns.")  # SETITEM
    assert over in refusal(b"(" + key + b"Nd.")  # DICT
    assert over in refusal(b"\x8f(" + key + b"\x90.")  # ADDITEMS
    assert over in refusal(b"(" + key + b"\x91.")  # FROZENSET
    assert over in refusal(b"N" + key + b"\x85R.")  # the arguments of a call
    assert over in refusal(b"N" + key + b"b.")  # BUILD's state
    light = b"}" + laughs(10) + b"Ns."
    assert scan(light) == (len(light), False)


def test_memo_entries_stored_out_of_order_or_never_stored_are_refused() -> None:
    assert f"it stores memo entry {1 << 28} when it holds 0" in refusal(hostile.memo_bomb())
    assert "it stores memo entry 2 when it holds 1" in refusal(b"N\x94q\x02.")
    assert "it refers to memo entry 1, which it never stored" in refusal(b"N\x94h\x01.")
    assert "it refers to memo entry 0, which it never stored" in refusal(b"g0\n.")
    assert scan(b"Nq\x00Nq\x00\x86h\x00\x86.")[1] is False  # a memo entry stored again


def test_a_truncated_stream_is_refused() -> None:
    assert "it ends without a STOP opcode" in refusal(b"\x80\x02N")
    assert "it ends without a STOP opcode" in refusal(b"")
    assert "it ends inside an opcode" in refusal(b"cbuiltins\nlist")
    assert "it ends inside an opcode" in refusal(b"I12")
    assert "it ends inside an opcode" in refusal(b"\x8e\x01\x00")


def test_a_stack_underflow_is_refused() -> None:
    underflows = "its stack underflows"
    for ops in (b"0", b"2", b"\x94", b"a", b"Na", b"NNs", b"\x85", b"N\x86", b"NR", b"N\x81", b"NN\x92", b"Nb"):
        assert underflows in refusal(ops + b"."), ops
    for ops in (b"N(\x85", b"N(NR", b"N(Q", b"]N(a", b"]((e"):  # an item below a mark is out of reach
        assert underflows in refusal(ops + b"."), ops
    assert "it pops a mark it never set" in refusal(b"Nt.")
    assert "it pops a mark it never set" in refusal(b"1.")
    assert "it stops with other than one object on its stack" in refusal(b".")
    assert "it stops with other than one object on its stack" in refusal(b"(N.")


def test_a_length_beyond_the_data_is_refused() -> None:
    beyond = "it declares more bytes than it holds"
    assert beyond in refusal(b"\x8c\x05abc.")
    assert beyond in refusal(b"X" + struct.pack("<I", 1 << 31) + b"abc.")
    assert beyond in refusal(b"\x8e" + struct.pack("<Q", 1 << 40) + b"abc.")
    assert beyond in refusal(b"T" + struct.pack("<i", -1) + b"abc.")  # a signed length, negative
    assert beyond in refusal(b"K")
    assert f"it declares a frame of {8 << 30} bytes, more than it holds" in refusal(
        b"\x80\x04\x95" + struct.pack("<Q", 8 << 30) + b"N."
    )


def frame(body: bytes) -> bytes:
    return b"\x95" + struct.pack("<Q", len(body)) + body


def test_frames_are_read_as_the_unpickler_reads_them() -> None:
    data = b"\x80\x04" + frame(b"N\x94") + frame(b"h\x00\x86.")
    assert scan(data) == (len(data), False)
    index = struct.pack("<I", 1 << 30)
    # LONG_BINPUT's index crosses the end of its frame: the C unpickler would read the rest afresh.
    assert "an opcode crosses the end of its frame" in refusal(
        b"\x80\x04" + frame(b"Nr" + index[:2]) + index[2:] + b"."
    )
    assert "an opcode crosses the end of its frame" in refusal(b"\x80\x04" + frame(b"N\x8c\x03a") + b"bc.")
    assert "it begins a frame inside another" in refusal(b"\x80\x04" + frame(frame(b"N")) + b".")
    assert "an opcode crosses the end of its frame" in refusal(b"\x80\x04" + frame(b"N\x95\x01") + bytes(7) + b".")
    # Past a frame's end, unframed opcodes and then a new frame are read as they come.
    assert scan(b"\x80\x04" + frame(b"N") + b"\x85" + frame(b".")) == (len(frame(b"N")) + len(frame(b".")) + 3, False)


def test_integers_are_bounded_before_they_are_converted() -> None:
    longest = (1 << (8 * MAX_INT_BYTES - 1)) - 1
    data = b"\x8b" + struct.pack("<I", MAX_INT_BYTES) + longest.to_bytes(MAX_INT_BYTES, "little") + b"."
    assert scan(data) == (len(data), False) and pickle.loads(data) == longest
    five_thousand_digits = 10**4999
    huge = five_thousand_digits.to_bytes((five_thousand_digits.bit_length() + 8) // 8, "little")
    long4 = b"\x8b" + struct.pack("<I", len(huge)) + huge + b"."
    assert f"it holds an integer of {len(huge)} bytes, more than {MAX_INT_BYTES}" in refusal(long4)
    assert f"an integer of {1 << 32 - 1} bytes" in refusal(b"\x8b" + struct.pack("<I", 1 << 32 - 1) + b".")
    assert "it ends inside an opcode" in refusal(b"\x8b\x01\x00")
    for code, suffix in ((b"I", b""), (b"L", b"L")):
        digits = b"9" * (MAX_INT_DIGITS - len(suffix))
        assert scan(code + digits + suffix + b"\n.")[1] is False
        over = b"9" + digits + suffix
        assert f"it holds an integer of {len(over)} characters, more than {MAX_INT_DIGITS}" in refusal(
            code + over + b"\n."
        )
        assert f"more than {MAX_INT_DIGITS}" in refusal(code + b"0" * 5000 + b"\n.")


def test_objects_alive_at_once_are_bounded_by_the_pickles_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pickle_limits, "MAX_LIVE", 1000)
    monkeypatch.setattr(pickle_limits, "LIVE_CHECK_OPS", 16)
    over = "objects at once on its stack and in its memo (at most 1000 and one per 4 bytes of it)"
    many = b"(" + b"]" * 4000 + b"1N."  # MARK, lists, POP_MARK: 4000 alive at once in 4003 bytes
    assert f"it holds more than {1000 + len(many) // 4} {over}" in refusal(many)
    assert f"more than {1000 + 4 * len(many) // 4}" in refusal(b"N" * (3 * len(many)) + many)
    memoized = b"N" + b"\x94" * 4000 + b"."  # the memo's entries count too
    assert f"it holds more than {1000 + len(memoized) // 4} {over}" in refusal(memoized)
    marks = b"(" * 4000 + b"1" * 4000 + b"N."
    assert f"it holds more than {1000 + len(marks) // 4} {over}" in refusal(marks)
    padded = b"(" + b"]" * 1000 + b"X" + struct.pack("<I", 12000) + bytes(12000) + b"1N."  # paid for by its size
    assert scan(padded) == (len(padded), False)
    dropped = b"]0" * 10_000 + b"N."  # many made, few alive at once
    assert scan(dropped) == (len(dropped), False)


MADE_AND_DROPPED = {
    "popped": b"]0" * 200_000 + b"N.",
    "replaced under one key": b"}X\x01\x00\x00\x00kq\x000" + b"h\x00]s" * 200_000 + b".",
    "tuples popped": b"NN\x86\x85" + b"]\x85\x850" * 100_000 + b".",
    "memo entry stored again": b"]q\x00" + b"0]q\x00" * 200_000 + b".",
}
"""Pickles that make many containers, each dead by the next: their records must die with them."""


@pytest.mark.parametrize("name", sorted(MADE_AND_DROPPED))
def test_the_records_of_dead_objects_die_with_them(both_scans: str, name: str) -> None:
    data = MADE_AND_DROPPED[name]
    run = compiled_scan if both_scans == "compiled" else scan_python
    tracemalloc.start()
    try:
        assert run(data, 0, pickle_limits.opcodes.PICKLE)[0] == len(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, peak  # 200,000 records kept would take 8 MB
