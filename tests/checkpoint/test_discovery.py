"""One walk of the argument gives every file and directory its role (``optim_repair.checkpoint.discovery``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from optim_repair.checkpoint import discovery
from optim_repair.checkpoint.discovery import MAX_REACHED_PATHS, Entry, discover
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


def doubling_links(base: Path, levels: int) -> Path:
    """``levels`` directories, each holding two links to the next: following them reaches 2**(levels + 1) - 2
    paths, with no loop."""
    for level in range(levels + 1):
        (base / str(level)).mkdir(parents=True)
    for level in range(levels):
        for name in ("a", "b"):
            (base / str(level) / name).symlink_to(f"../{level + 1}")
    return base / "0"


def test_a_dereferencing_walk_stops_at_the_path_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It refuses as soon as it passes the bound: the 2**25 paths of 24 levels are never listed."""
    root = doubling_links(tmp_path / "bomb", 24)
    listed: list[str] = []
    listing = discovery._listing

    def counted(directory: str, *rest: object) -> tuple[list[str], list[str]]:
        listed.append(directory)
        return listing(directory, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(discovery, "_listing", counted)
    with pytest.raises(InputError, match=rf"following links reaches more than {MAX_REACHED_PATHS:,} paths"):
        discover(root, dereference=True)
    assert MAX_REACHED_PATHS // 2 < len(listed) <= MAX_REACHED_PATHS
    assert all(not Path(directory).is_symlink() for directory in listed), "read at their real paths"
    assert len(set(listed)) == 25


def test_the_path_bound_counts_every_path_the_walk_reaches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = doubling_links(tmp_path / "bomb", 3)  # 2 + 4 + 8 directories
    (tmp_path / "bomb" / "3" / "file").write_bytes(b"")  # reached 8 times
    monkeypatch.setattr(discovery, "MAX_REACHED_PATHS", 22)
    found = discover(root, dereference=True)
    assert len(found.entries) == 22 and not any(entry.link for entry in found.entries)
    assert sum(entry.rel.endswith("/file") for entry in found.entries) == 8
    monkeypatch.setattr(discovery, "MAX_REACHED_PATHS", 21)
    with pytest.raises(InputError, match=r"bomb/0: following links reaches more than 21 paths"):
        discover(root, dereference=True)
    assert len(discover(root).entries) == 2, "not followed, not counted"
