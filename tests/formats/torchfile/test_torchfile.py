"""Reading and writing torch files (zip and legacy) without torch: ``optim_repair.formats.torchfile``."""

from __future__ import annotations

import os
import pickletools
import random
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

import optim_repair
from optim_repair.errors import InputError, OptimRepairError, UnsafeInputError
from optim_repair.formats.pickle_reading import read_pickle
from optim_repair.formats.torchfile import open_torch_file, read_inventory, write_torch_file
from optim_repair.formats.torchfile.legacy import open_legacy
from optim_repair.formats.torchfile.reader import PHANTOM_PROBE_BYTES, find_optimizers
from optim_repair.formats.torchfile.zipwriter import ALIGNMENT
from optim_repair.records.inventory import OtherValue, TensorMeta
from optim_repair.records.repair_plan import Addition
from optim_repair.storage.answers import CHANGED
from optim_repair.storage.disk import open_regular, size_of
from tests import factories
from tests.factories import defects, hostile, models, trainers
from tests.factories.built import Built
from tests.factories.support import (
    assert_copy_faithful,
    assert_nothing_written,
    load,
    overwrite,
    rewrite_pickle,
    storage_ranges,
    tensor_storage_key,
)

OPT = trainers.OPT_SITE


def moment_storages(path: Path, address: tuple[object, ...]) -> list[str]:
    """Storage keys of every non-``step`` tensor in the optimizer state at ``address``."""
    sd = load(path)
    for part in address:
        sd = sd[part]
    keys = []
    for param, entry in sd["state"].items():
        for key, value in entry.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.numel():
                keys.append(tensor_storage_key(path, (*address, "state", param, key)))
    return keys


def garble(path: Path, keys: list[str]) -> int:
    """Overwrite the bytes of storages ``keys`` with random non-zero bytes; return how many."""
    rng = random.Random(0)
    ranges = storage_ranges(path)
    total = 0
    for key in set(keys):
        offset, length = ranges[key]
        overwrite(path, offset, bytes(rng.randrange(1, 256) for _ in range(length)))
        total += length
    return total


# ---------------------------------------------------------------- reading


def test_a_legacy_file_is_read_through_to_each_pickle_s_stop_and_a_cut_is_changed_while_read(root: Path) -> None:
    """Each pickle of a legacy file is read up to its STOP (its storages are never read), then checked and
    unpickled from those bytes; a file cut short by another process after its size was taken is exit 4."""
    path = trainers.legacy_format(root).path
    whole = path.read_bytes()
    with open_regular(path, "legacy.pt") as stream:
        size = size_of(stream)
        parsed = open_legacy(stream, path, "legacy.pt")
        stream.seek(parsed.main_start)
        main = read_pickle(stream, "legacy.pt", size)
        assert stream.tell() == parsed.main_start, "left where it was"
        stop = max(pos for op, _, pos in pickletools.genops(whole[parsed.main_start :]) if op.name == "STOP")
        assert main == whole[parsed.main_start : parsed.main_start + stop + 1]
        assert read_pickle(stream, "legacy.pt", parsed.main_start + 100) == main[:100]  # past its size: not read
    with open_regular(path, "legacy.pt") as stream:
        size = size_of(stream)
        subprocess.run(["truncate", "-s", str(parsed.main_start + len(main) // 2), str(path)], check=True)
        stream.seek(parsed.main_start)
        with pytest.raises(InputError) as refused:
            read_pickle(stream, "legacy.pt", size)
    assert (refused.value.reason, refused.value.path) == (CHANGED, "legacy.pt")


def test_zip_and_legacy_are_both_read(root: Path) -> None:
    zip_built, legacy_built = trainers.unirl_torch(root / "z"), trainers.legacy_format(root / "l")
    zipped = read_inventory(zip_built.path / "checkpoint.pt", "checkpoint.pt", "checkpoint.pt")
    legacy = read_inventory(legacy_built.path, "", "legacy.pt")
    assert (zipped.format, legacy.format) == ("torch-zip", "torch-legacy")
    for inventory in (zipped, legacy):
        (opt,) = inventory.optimizers
        assert opt.location == "optimizer_state_dict" and opt.address == OPT and opt.key_style == "name"
        assert [e.param for e in opt.entries] == ["trunk.weight", "trunk.bias", "head_used.weight", "head_used.bias"]
        assert len(opt.params) == 6
        meta = opt.entries[0].get("exp_avg")
        assert isinstance(meta, TensorMeta) and (meta.dtype, meta.shape, meta.stride) == ("float32", (8, 4), (4, 1))
        step = opt.entries[0].get("step")
        assert isinstance(step, TensorMeta) and step.value == 2.0, "inspect reads step values"
        assert [w.source.split(":")[-1] for w in inventory.weights][:1] == ["policy_state_dict"]


def test_every_storage_is_located_exactly(root: Path) -> None:
    for built in (defects.tricky_tensors(root / "z"), trainers.legacy_format(root / "l")):
        path = built.path
        payload = load(path)
        state = payload["optimizer_state_dict"]["state"]
        ranges = storage_ranges(path)
        raw = path.read_bytes()
        for param, entry in state.items():
            for key, tensor in entry.items():
                storage_key = tensor_storage_key(path, (*OPT, "state", param, key))
                offset, length = ranges[storage_key]
                assert raw[offset : offset + length] == bytes(tensor.untyped_storage()), (param, key)


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        ("lightning", [("optimizer_states[0]", ("optimizer_states", 0), "index")]),
        (
            "multi_optimizer",
            [
                ("optimizers.actor", ("optimizers", "actor"), "name"),
                ("optimizers.critic", ("optimizers", "critic"), "name"),
            ],
        ),
        ("cold", [("", (), "index")]),
        ("healthy", [("optimizer_state_dict", OPT, "name")]),
    ],
)
def test_optimizers_are_found_by_structure_anywhere(
    root: Path, factory: str, expected: list[tuple[str, tuple[object, ...], str]]
) -> None:
    built = factories.FACTORIES[factory](root)
    inventory = read_inventory(built.path, "", built.path.name)
    assert [(o.location, o.address, o.key_style) for o in inventory.optimizers] == expected


def test_structure_not_names_decides(tmp_path: Path) -> None:
    model = models.TwoHeadNet()
    opt = models.make_optimizer(model)
    models.train(model, opt, 1)
    sd = opt.state_dict()
    payload = {
        "whatever": {"deep": [None, {"x": sd}]},
        "not_an_optimizer": {"state": {}, "param_groups": [{"lr": 1.0}]},  # no params: not one
        "also_not": {"state": [], "param_groups": []},
    }
    path = tmp_path / "odd.pt"
    torch.save(payload, path)
    inventory = read_inventory(path, "", "odd.pt")
    assert [o.location for o in inventory.optimizers] == ["whatever.deep[1].x"]
    assert find_optimizers({"a": sd, "b": [sd]}) == [(("a",), sd)], "one object reachable twice counts once"


def test_non_mapping_and_odd_values_are_described(root: Path) -> None:
    built = defects.bad_entry_not_mapping(root, "list")
    (opt,) = read_inventory(built.path, "", "f").optimizers
    entry = opt.entry("trunk.bias")
    assert entry is not None and not entry.is_mapping and entry.type_name == "list"
    built = defects.bad_entry_moment_not_tensor(root / "m")
    (opt,) = read_inventory(built.path, "", "f").optimizers
    entry = opt.entry("trunk.weight")
    assert entry is not None and entry.get("exp_avg") == 0.25
    assert isinstance(opt.groups[0].option("betas"), tuple)
    assert not isinstance(opt.groups[0].option("params"), OtherValue)


def test_inventory_reads_no_moment_bytes(root: Path) -> None:
    """Garbage in every moment storage (not ``step``) changes nothing inspect reports."""
    for built, address in (
        (trainers.bug_report(root / "b"), OPT),
        (trainers.lightning(root / "l"), ("optimizer_states", 0)),
        (trainers.legacy_format(root / "g"), OPT),
    ):
        path = built.file()
        before = read_inventory(path, "", "f")
        original_bytes = path.read_bytes()
        assert garble(path, moment_storages(path, address)) > 0
        assert path.read_bytes() != original_bytes
        assert read_inventory(path, "", "f") == before


def test_phantom_probe_reads_only_the_head_of_moments(tmp_path: Path) -> None:
    """Only when every step is 1 does inspect read moments, and then only their first 4 KiB."""
    model = torch.nn.Linear(1024, 8)  # weight moments: 32 KiB each
    opt = torch.optim.AdamW(model.parameters())
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    path = tmp_path / "phantom.pt"
    torch.save({"optimizer": get_optimizer_state_dict(model, opt)}, path)
    before = read_inventory(path, "", "f")
    (opt_inv,) = before.optimizers
    assert all(isinstance(e.get("exp_avg"), TensorMeta) and e.get("exp_avg").zero_head for e in opt_inv.entries)
    ranges = storage_ranges(path)
    tail = 0
    for key in moment_storages(path, ("optimizer",)):
        offset, length = ranges[key]
        if length > PHANTOM_PROBE_BYTES:
            overwrite(path, offset + PHANTOM_PROBE_BYTES, b"\xff" * (length - PHANTOM_PROBE_BYTES))
            tail += length - PHANTOM_PROBE_BYTES
    assert tail > 0
    assert read_inventory(path, "", "f") == before
    # the head is read: garbage there makes the moments non-zero
    offset, _ = ranges[moment_storages(path, ("optimizer",))[0]]
    overwrite(path, offset, b"\x01")
    assert read_inventory(path, "", "f") != before


def test_weight_maps_are_found_beside_optimizers(root: Path) -> None:
    built = trainers.multi_optimizer(root)
    inventory = read_inventory(built.path, "", "m.pt")
    sources = [w.source for w in inventory.weights]
    assert sources == ["m.pt:models.actor", "m.pt:models.critic"]
    assert inventory.weights[1].lookup()["trunk.weight"].shape == (5, 4)


# ---------------------------------------------------------------- refusing


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_unsafe_file_is_refused_and_never_run(root: Path, marker: Path, legacy: bool) -> None:
    built = hostile.unsafe_legacy_pickle(root, marker) if legacy else hostile.unsafe_pickle(root, marker)
    with pytest.raises(UnsafeInputError, match=rf"refuses to load global {os.name}\.system"):
        read_inventory(built.path, "", built.path.name)
    with pytest.raises(UnsafeInputError):
        write_torch_file(built.path, built.path.name, [], root / "out.pt")
    assert not marker.exists()
    assert not (root / "out.pt").exists()


def _truncated(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("keep", [0, 1, 10, 100, 500, -200, -1])
def test_truncated_files_are_input_errors(root: Path, legacy: bool, keep: int) -> None:
    built = trainers.legacy_format(root) if legacy else defects.healthy(root)
    size = built.path.stat().st_size
    _truncated(built.path, keep if keep >= 0 else size + keep)
    with pytest.raises(InputError, match=rf"^{built.path.name}: "):
        read_inventory(built.path, "", built.path.name)


def test_random_bytes_and_empty_files_are_input_errors(tmp_path: Path) -> None:
    for name, data in (
        ("random.pt", random.Random(1).randbytes(4096)),
        ("empty.pt", b""),
        ("text.pt", b"hello\n"),
        ("zip.pt", b"PK\x03\x04" + bytes(100)),
    ):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(InputError, match=rf"^{name}: "):
            read_inventory(path, "", name)


def test_zip_without_data_pkl_is_not_a_torch_file(tmp_path: Path) -> None:
    path = tmp_path / "a.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("a/other.txt", "x")
    with pytest.raises(InputError, match=r"without data\.pkl"):
        read_inventory(path, "", "a.pt")


def test_compressed_storage_record_is_refused(root: Path, tmp_path: Path) -> None:
    built = defects.healthy(root)
    path = tmp_path / "deflated.pt"
    with zipfile.ZipFile(built.path) as source, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    with pytest.raises(InputError, match="storage record"):
        read_inventory(path, "", "deflated.pt")


@pytest.mark.parametrize("factory", ["tricky_tensors", "legacy_format"])
def test_fuzzed_files_raise_only_the_tools_own_errors(root: Path, tmp_path: Path, factory: str) -> None:
    """Byte flips and truncations anywhere: inspect and fix fail with an OptimRepairError, or succeed."""
    built = factories.FACTORIES[factory](root)
    original = built.path.read_bytes()
    rng = random.Random(7)
    path, out = tmp_path / "fuzz.pt", tmp_path / "out.pt"
    outcomes: set[str] = set()
    for _ in range(150):
        data = bytearray(original)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        path.write_bytes(bytes(data))
        out.unlink(missing_ok=True)
        try:
            optim_repair.fix(path, out)
            outcomes.add("fixed")
        except OptimRepairError as exc:
            outcomes.add(type(exc).__name__)
            assert_nothing_written(out)
    assert {"fixed", "InputError"} <= outcomes


def test_a_bad_crc_in_a_record_is_copied_as_it_is(root: Path, tmp_path: Path) -> None:
    """Storage records are moved by the kernel with the CRC-32 their header gives (computing it again is the
    dearest step of a copy): a record whose bytes no longer match its CRC stays exactly as damaged."""
    built = defects.healthy(root)
    path = tmp_path / "crc.pt"
    path.write_bytes(built.path.read_bytes())
    offset, _ = next(iter(storage_ranges(path).values()))
    overwrite(path, offset, b"\x13\x37")  # the record's CRC no longer matches
    read_inventory(path, "", "crc.pt")  # inspect does not read the bytes
    write_torch_file(path, "crc.pt", [], tmp_path / "out.pt")
    with zipfile.ZipFile(path) as original, zipfile.ZipFile(tmp_path / "out.pt") as copy:
        assert [(i.filename, i.CRC) for i in original.infolist() if "/data/" in i.filename] == [
            (i.filename, i.CRC) for i in copy.infolist() if "/data/" in i.filename
        ]
    with zipfile.ZipFile(tmp_path / "out.pt") as copy:
        assert copy.testzip() is not None  # as damaged as the original, no more


# ---------------------------------------------------------------- writing


def _additions(built: Built) -> list[Addition]:
    return [
        Addition(site.file, site.location, site.address, param, ())
        for site, missing in built.missing.items()
        for param in missing
    ]


@pytest.mark.parametrize("factory", ["tricky_tensors", "legacy_format", "lightning", "multi_optimizer", "cold"])
def test_write_adds_empty_entries_and_keeps_everything_else(root: Path, tmp_path: Path, factory: str) -> None:
    built = factories.FACTORIES[factory](root)
    out = tmp_path / "out.pt"
    write_torch_file(built.path, "in", _additions(built), out)
    original, copy = load(built.path), load(out)
    assert_copy_faithful(original, copy, {(*site.address, "state"): set(m) for site, m in built.missing.items()})
    assert read_inventory(out, "", "out").format == read_inventory(built.path, "", "in").format


def test_zip_copy_keeps_records_and_alignment(root: Path, tmp_path: Path) -> None:
    built = defects.tricky_tensors(root)
    out = tmp_path / "out.pt"
    write_torch_file(built.path, "in", _additions(built), out)
    with zipfile.ZipFile(built.path) as a, zipfile.ZipFile(out) as b:
        assert a.namelist() == b.namelist()
        for info in a.infolist():
            if not info.filename.endswith("data.pkl"):
                assert a.read(info) == b.read(info.filename), info.filename
    for offset, _ in storage_ranges(out).values():
        assert offset % ALIGNMENT == 0
    mapped = torch.load(out, mmap=True, weights_only=True)  # torch's mmap loader wants aligned storages
    assert mapped["optimizer_state_dict"]["state"]["head_unused.weight"] == {}


def test_write_with_fresh_tensors_creates_new_storages(root: Path, tmp_path: Path) -> None:
    from optim_repair.records.repair_plan import FreshTensor

    for built in (trainers.unirl_torch(root / "z"), trainers.legacy_format(root / "l")):
        src = built.file()
        out = tmp_path / f"{src.stem}-fresh.pt"
        state = (
            ("step", FreshTensor("float32", (), 0.0)),
            ("exp_avg", FreshTensor("float32", (2, 8), 0.0)),
            ("exp_avg_sq", FreshTensor("bfloat16", (2,), 1.5)),
        )
        site = built.site
        write_torch_file(src, "in", [Addition(site.file, site.location, OPT, "head_unused.weight", state)], out)
        added = load(out)["optimizer_state_dict"]["state"]["head_unused.weight"]
        assert list(added) == ["step", "exp_avg", "exp_avg_sq"]
        assert added["step"].shape == () and added["step"].item() == 0.0
        assert added["exp_avg"].shape == (2, 8) and not added["exp_avg"].any()
        assert added["exp_avg_sq"].dtype == torch.bfloat16 and added["exp_avg_sq"].tolist() == [1.5, 1.5]
        assert_copy_faithful(load(src), load(out), {(*OPT, "state"): {"head_unused.weight"}})


def test_legacy_copy_keeps_the_header(root: Path, tmp_path: Path) -> None:
    built = trainers.legacy_format(root)
    out = tmp_path / "out.pt"
    write_torch_file(built.path, "in", _additions(built), out)
    before, after = open_torch_file(built.path, "in"), open_torch_file(out, "out")
    assert after.kind == "torch-legacy"
    assert built.path.read_bytes()[: before.main_start] == out.read_bytes()[: after.main_start]
    assert struct.unpack("<q", out.read_bytes()[after.storage_start : after.storage_start + 8])[0] > 0


def _plain_payload() -> dict[str, object]:
    import collections

    model, unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW([*model.parameters(), *unused.parameters()])
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "opt": opt.state_dict(),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "set": {"a", "b"},
        "od": collections.OrderedDict(a=torch.ones(2)),
        "param": torch.nn.Parameter(torch.ones(2)),
        "nested": ((1, 2), [3.5, float("nan")]),
        "big": 2**70,
        "bytes": b"\x00" * 300,
        "none": None,
    }


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_every_plain_value_survives_a_write(tmp_path: Path, legacy: bool) -> None:
    import collections

    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(_plain_payload(), src, _use_new_zipfile_serialization=not legacy)
    write_torch_file(src, "in", [Addition("", "opt", ("opt",), 2, ()), Addition("", "opt", ("opt",), 3, ())], out)
    original, copy = torch.load(src, weights_only=True), torch.load(out, weights_only=True)
    assert_copy_faithful(original, copy, {("opt", "state"): {2, 3}})
    assert type(copy["param"]) is torch.nn.Parameter and type(copy["od"]) is collections.OrderedDict


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's own, as it refuses the file
@pytest.mark.parametrize("protocol", [3, 4, 5])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_pickle_protocol_torchs_weights_only_loader_refuses_is_refused(
    tmp_path: Path, protocol: int, legacy: bool
) -> None:
    # torch.save(pickle_protocol=3+) writes opcodes (BINBYTES, FRAME, SHORT_BINUNICODE, MEMOIZE...) that only
    # weights_only=False reads: torch.load refuses the file, and so does reading it, naming the first.
    src = tmp_path / "in.pt"
    torch.save(_plain_payload(), src, pickle_protocol=protocol, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(Exception, match="Unsupported operand"):
        torch.load(src, weights_only=True)
    with pytest.raises(InputError, match="which torch's weights-only unpickler does not implement"):
        open_torch_file(src, "in")


def test_the_copy_is_pickled_with_the_protocol_torch_reads(tmp_path: Path) -> None:
    """An original whose data.pkl declares protocol 5 (but holds protocol-2 opcodes) loads with weights_only; the
    copy once was pickled with protocol 5, whose FRAME torch's weights-only loader refuses (found by the fuzzer)."""
    built = trainers.unirl_torch(tmp_path / "in")
    path = built.path / "checkpoint.pt"
    rewrite_pickle(path, lambda data: b"\x80\x05" + data[2:] if data.startswith(b"\x80\x02") else data)
    torch.load(path, weights_only=True)
    out = tmp_path / "out.pt"
    optim_repair.fix(path, out, fill="empty")
    copy = torch.load(out, weights_only=True)
    assert copy["optimizer_state_dict"]["state"]["head_unused.weight"] == {}
