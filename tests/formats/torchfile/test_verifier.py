"""Verification of torch files from disk (``formats.torchfile.verifier``): it must catch every kind of tampering."""

from __future__ import annotations

import collections
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from optim_repair.errors import VerificationError
from optim_repair.formats.pickle_writing import dump_graph
from optim_repair.formats.pickled import load_graph
from optim_repair.formats.torchfile import open_torch_file, write_torch_file
from optim_repair.formats.torchfile.verifier import verify_torch_file
from optim_repair.records.repair_plan import Addition
from tests.conftest import run_cli
from tests.factories import trainers
from tests.factories.built import Built
from tests.factories.support import (
    binfloat,
    empty_additions,
    flip_byte,
    load,
    next_float,
    rewrite_pickle,
    storage_ranges,
    tensor_storage_key,
)

OPT = trainers.OPT_SITE


def edit_graph(path: Path, edit: Callable[[Any], None]) -> None:
    def apply(data: bytes) -> bytes:
        graph = load_graph(data, path.name)
        edit(graph.root)
        return dump_graph(graph.root)

    rewrite_pickle(path, apply)


def test_a_faithful_copy_verifies_and_counts_what_it_compared(tricky_copy: tuple[Built, Path, list[Addition]]) -> None:
    built, out, planned = tricky_copy
    result = verify_torch_file(built.path, out, "tricky", planned)
    original = load(built.path)
    tensors = [v for e in original["optimizer_state_dict"]["state"].values() for v in e.values()]
    tensors += list(original["policy_state_dict"].values())
    assert result.tensors == len(tensors)
    assert result.bytes == sum(size for _, size in storage_ranges(built.path).values())


def test_a_flipped_storage_byte_is_caught(tricky_copy: tuple[Built, Path, list[Addition]]) -> None:
    built, out, planned = tricky_copy
    key = tensor_storage_key(out, (*OPT, "state", "trunk.weight", "exp_avg"))
    offset, length = storage_ranges(out)[key]
    flip_byte(out, offset + length - 1)
    with pytest.raises(VerificationError, match=rf"tricky: the bytes of storage {key} changed$"):
        verify_torch_file(built.path, out, "tricky", planned)


def test_a_changed_nan_payload_is_caught(tricky_copy: tuple[Built, Path, list[Addition]]) -> None:
    built, out, planned = tricky_copy
    key = tensor_storage_key(out, (*OPT, "state", "head_used.weight", "exp_avg"))
    offset, _ = storage_ranges(out)[key]
    flip_byte(out, offset)  # 0x7FC00001 -> 0x7FC00000: still a NaN, another payload
    value = load(out)["optimizer_state_dict"]["state"]["head_used.weight"]["exp_avg"].view(-1)[0]
    assert torch.isnan(value)
    with pytest.raises(VerificationError, match="bytes of storage"):
        verify_torch_file(built.path, out, "tricky", planned)


def test_a_changed_float_in_the_pickle_is_caught(tricky_copy: tuple[Built, Path, list[Addition]]) -> None:
    built, out, planned = tricky_copy
    lr = load(built.path)["optimizer_state_dict"]["param_groups"][0]["lr"]

    def nudge(data: bytes) -> bytes:
        assert data.count(binfloat(lr)) >= 1
        return data.replace(binfloat(lr), binfloat(next_float(lr)))

    rewrite_pickle(out, nudge)
    with pytest.raises(VerificationError, match=r"differs at optimizer_state_dict\.param_groups\[0\]\.lr"):
        verify_torch_file(built.path, out, "tricky", planned)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda root: root["optimizer_state_dict"]["param_groups"][0].__setitem__("weight_decay", -0.0),
            r"param_groups\[0\]\.weight_decay: 0\.01 became -0\.0",
        ),
        (
            lambda root: root["optimizer_state_dict"]["param_groups"][0].__setitem__(
                "betas", list(root["optimizer_state_dict"]["param_groups"][0]["betas"])
            ),
            "tuple became list",
        ),
        (lambda root: root.__setitem__("step", 3), "step: 2 became 3"),
        (lambda root: root.__setitem__("extra", 1), "keys"),
        (lambda root: root["optimizer_state_dict"]["state"].pop("trunk.bias"), "keys"),
        (
            lambda root: root["optimizer_state_dict"]["state"].__setitem__(
                "trunk.bias", root["optimizer_state_dict"]["state"].pop("trunk.bias")
            ),
            "keys",
        ),
    ],
    ids=["signed-zero", "tuple-to-list", "int", "added-key", "removed-entry", "key-order"],
)
def test_value_changes_in_the_pickle_are_caught(
    tricky_copy: tuple[Built, Path, list[Addition]], edit: Callable[[Any], None], message: str
) -> None:
    built, out, planned = tricky_copy
    edit_graph(out, edit)
    with pytest.raises(VerificationError, match=message):
        verify_torch_file(built.path, out, "tricky", planned)


def test_split_shared_storage_is_caught(tricky_copy: tuple[Built, Path, list[Addition]]) -> None:
    built, out, planned = tricky_copy
    payload = load(out)
    bias = payload["optimizer_state_dict"]["state"]["trunk.bias"]
    assert bias["exp_avg"].untyped_storage().data_ptr() == bias["exp_avg_sq"].untyped_storage().data_ptr()
    bias["exp_avg_sq"] = bias["exp_avg_sq"].clone()  # same values, its own storage now
    torch.save(payload, out)
    with pytest.raises(VerificationError):
        verify_torch_file(built.path, out, "tricky", planned)


def test_a_changed_byteorder_record_is_caught(tricky_copy: tuple[Built, Path, list[Addition]], tmp_path: Path) -> None:
    built, out, planned = tricky_copy
    edited = tmp_path / "edited.pt"
    with zipfile.ZipFile(out) as source, zipfile.ZipFile(edited, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            target.writestr(info, b"big" if info.filename.endswith("/byteorder") else data)
    with pytest.raises(VerificationError, match="record byteorder"):
        verify_torch_file(built.path, edited, "tricky", planned)


def test_unplanned_and_unmade_additions_are_caught(tricky_copy: tuple[Built, Path, list[Addition]]) -> None:
    built, out, planned = tricky_copy
    with pytest.raises(VerificationError, match="keys"):
        verify_torch_file(built.path, out, "tricky", planned[:-1])
    with pytest.raises(VerificationError, match="keys"):
        verify_torch_file(built.path, built.path, "tricky", planned)
    wrong = [*planned[:-1], Addition("", planned[-1].location, OPT, planned[-1].param, (("step", 0.0),))]
    with pytest.raises(VerificationError, match="is not what was planned"):
        verify_torch_file(built.path, out, "tricky", wrong)


def test_legacy_copies_are_verified_too(legacy_checkpoint: Built, tmp_path: Path) -> None:
    built = legacy_checkpoint
    out = tmp_path / "copy.pt"
    planned = empty_additions(built)
    write_torch_file(built.path, "legacy", planned, out)
    assert verify_torch_file(built.path, out, "legacy", planned).tensors > 0
    damaged = tmp_path / "damaged.pt"
    shutil.copyfile(out, damaged)
    key = tensor_storage_key(damaged, (*OPT, "state", "trunk.weight", "exp_avg_sq"))
    flip_byte(damaged, storage_ranges(damaged)[key][0])
    with pytest.raises(VerificationError, match="bytes of storage"):
        verify_torch_file(built.path, damaged, "legacy", planned)
    header = tmp_path / "header.pt"
    shutil.copyfile(out, header)
    start = open_torch_file(header, "h").main_start
    data = bytearray(header.read_bytes())
    sys_info = bytes(data[:start])
    flag = sys_info.index(b"\x88", sys_info.index(b"little_endian"))  # NEWTRUE after the key (and its BINPUT)
    assert flag - sys_info.index(b"little_endian") <= len("little_endian") + 2
    data[flag] = 0x89  # NEWTRUE -> NEWFALSE: torch would byte-swap every storage
    header.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="header"):
        verify_torch_file(built.path, header, "legacy", planned)


def test_an_unreadable_copy_fails_verification(tricky_copy: tuple[Built, Path, list[Addition]]) -> None:
    built, out, planned = tricky_copy
    out.write_bytes(out.read_bytes()[:100])
    with pytest.raises(VerificationError, match="cannot be read back"):
        verify_torch_file(built.path, out, "tricky", planned)


@pytest.mark.parametrize(
    "hooks", [b"ccollections\nOrderedDict\n", b"cbuiltins\nbytearray\n"], ids=["class", "function"]
)
def test_a_global_as_a_tensors_hooks_is_compared_by_its_name(tmp_path: Path, hooks: bytes) -> None:
    """torch's loader takes any global it allows as a tensor's ``backward_hooks``, called or not: the copy holds
    the same reference, pickled as the global it names (once "the copy differs: cannot compare a function")."""
    built = trainers.unirl_torch(tmp_path / "in")
    path = built.path / "checkpoint.pt"
    rewrite_pickle(path, lambda data: data.replace(b"\x89h\x02)R", b"\x89" + hooks, 1))  # not OrderedDict()
    original = torch.load(path, weights_only=True)["policy_state_dict"]["trunk.weight"]._backward_hooks
    assert original in (collections.OrderedDict, bytearray)
    out = tmp_path / "out"
    run_cli(["fix", built.path, "--out", out])
    fixed = torch.load(out / "checkpoint.pt", weights_only=True)
    assert fixed["policy_state_dict"]["trunk.weight"]._backward_hooks is original
