"""One walk of the argument gives every file and directory its role (``optim_repair.checkpoint.discovery``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from optim_repair.checkpoint.discovery import Entry, discover
from optim_repair.errors import InputError
from tests.factories import dcp as dk
from tests.factories import trainers


def test_a_run_directory_gets_every_role(tmp_path: Path) -> None:
    run = tmp_path / "run"
    hf = trainers.hf_trainer(run / "hf").path.relative_to(run).as_posix()
    dcp = dk.unirl_dcp(run / "dcp").path.relative_to(run).as_posix()
    (run / "notes.txt").write_text("")
    (run / "latest").symlink_to(hf)
    (run / dcp / "extra").mkdir()
    (run / dcp / "extra" / "optimizer.pt").write_bytes(b"a member, not a torch file to read")
    found = discover(run)
    roles = {entry.rel: (entry.role, entry.link, entry.dcp) for entry in found.entries}
    assert roles["notes.txt"] == ("file", False, None)
    assert roles["latest"] == ("directory", True, None)
    assert roles[hf] == ("directory", False, None)
    assert roles[f"{hf}/optimizer.pt"] == ("torch", False, None)
    assert roles[f"{hf}/model.safetensors"] == ("safetensors", False, None)
    assert roles[dcp] == ("dcp", False, None)
    assert roles[f"{dcp}/.metadata"] == ("file", False, dcp)
    assert roles[f"{dcp}/extra"] == ("directory", False, dcp)
    assert roles[f"{dcp}/extra/optimizer.pt"] == ("file", False, dcp)
    assert not any(rel.startswith("latest/") for rel in roles), "a linked directory is not walked"
    assert {e.member_name() for e in found.members(dcp)} >= {".metadata", "extra", "extra/optimizer.pt"}
    on_disk = {path.relative_to(run).as_posix() for path in run.rglob("*")}
    assert set(roles) == {rel for rel in on_disk if not rel.startswith("latest/")} - {""}


def test_a_directory_is_listed_before_what_it_holds(tmp_path: Path) -> None:
    trainers.petrainer(tmp_path / "p")
    seen: set[str] = set()
    for entry in discover(tmp_path / "p").entries:
        parent = entry.rel.rpartition("/")[0]
        assert not parent or parent in seen, entry.rel
        seen.add(entry.rel)


def test_a_file_argument_is_one_torch_file_with_its_neighbours(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "hf")
    found = discover(built.path / "optimizer.pt")
    assert not found.is_directory and found.entries == (Entry("", "torch"),)
    assert [path.name for path in found.neighbours] == ["model.safetensors"]


def test_a_dcp_argument_is_one_checkpoint(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "d")
    found = discover(built.path)
    assert found.entries[0] == Entry("", "dcp")
    assert all(entry.dcp == "" and entry.role in ("file", "directory") for entry in found.entries[1:])


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_part_of_a_dcp_checkpoint_is_refused_naming_its_directory(tmp_path: Path, name: str) -> None:
    built = dk.unirl_dcp(tmp_path / "d")
    with pytest.raises(InputError, match=rf"part of a DCP checkpoint; pass its directory, {built.path}"):
        discover(built.path / name)


def test_nothing_there_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or directory"):
        discover(tmp_path / "absent")
