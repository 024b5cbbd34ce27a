"""Verification of DCP copies (``optim_repair.formats.dcp.verifier``): it must catch every kind of tampering."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from optim_repair.errors import VerificationError
from optim_repair.formats.dcp import read_metadata
from optim_repair.records.repair_plan import Addition, FreshTensor
from tests.factories import dcp as dk
from tests.factories.dcp import repaired, verify_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_verify_detects_a_changed_original_entry(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    additions = repaired(built, {"optim": "adamw"}, dest)
    info = read_metadata(dest).storage[("optim.state.blocks.1.attn.to_out.weight.exp_avg", (0, 0))]
    with (dest / info.relative_path).open("r+b") as stream:
        stream.seek(info.offset + info.length - 20)
        byte = stream.read(1)
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte[0] ^ 1]))
    with pytest.raises(VerificationError, match=r"optim\.state\.blocks\.1\.attn\.to_out\.weight\.exp_avg"):
        verify_dcp(built.path, dest, additions)


def test_verify_detects_a_wrong_addition(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    additions = repaired(built, {"optim": "adamw"}, dest)
    ones = tuple(
        (key, FreshTensor(value.dtype, value.shape, 1.0) if isinstance(value, FreshTensor) else value)
        for key, value in additions[0].state
    )
    wrong = (Addition("", "optim", ("optim",), additions[0].param, ones), *additions[1:])
    with pytest.raises(VerificationError, match=r"does not hold 1\.0"):
        verify_dcp(built.path, dest, wrong)
    with pytest.raises(VerificationError, match="keys differ"):
        verify_dcp(built.path, dest, additions[1:])


def test_verify_detects_a_changed_neighbour(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    dest = tmp_path / "out"
    additions = repaired(built, {"optim": "adamw"}, dest)
    (dest / "metadata.pt").write_bytes(b"changed")
    with pytest.raises(VerificationError, match=r"metadata\.pt"):
        verify_dcp(built.path, dest, additions)
