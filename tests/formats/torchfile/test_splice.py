"""Splicing a torch file: a new pickle record, the original's other records byte for byte, the new records and a
new central directory; what torch loads, with every storage still aligned, proven by the verifier."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from optim_repair import api
from optim_repair.errors import RepairRefused
from optim_repair.formats.pickle_writing import dump_graph
from optim_repair.formats.torchfile import open_torch_file
from optim_repair.formats.torchfile.splice import append, splice
from optim_repair.formats.torchfile.verifier import verify_torch_file
from optim_repair.formats.torchfile.writer import edited_root
from optim_repair.formats.torchfile.zipformat import ZipTorchFile
from optim_repair.records.verification import HolderProof
from tests.factories import trainers


def _spliced(path: Path, out: Path, fill: str) -> tuple[int, tuple[object, ...]]:
    """``path`` repaired as a store composes it: head, kept bytes, tail, written to ``out``; its shift, additions."""
    torch_file = open_torch_file(path, "optimizer.pt")
    assert isinstance(torch_file, ZipTorchFile)
    additions = api.plan(path, fill=fill).additions  # type: ignore[arg-type]
    root, created = edited_root(torch_file, additions, ())
    scratch = out.with_suffix(".scratch")
    with scratch.open("w+b") as written:
        made = splice(torch_file, dump_graph(root), created, written.fileno(), "optimizer.pt")
        written.seek(0)
        head = written.read(made.head)
        written.seek(made.tail_at)
        tail = written.read(made.tail)
    out.write_bytes(head + path.read_bytes()[made.start : made.end] + tail)
    return made.moved, additions


def _trained(path: Path) -> Path:
    """The model and its AdamW state by name (as torch's full-state getter writes it), one layer never used."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(40, 30), "unused": torch.nn.Linear(30, 20)})
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model["used"](torch.randn(2, 40)).sum().backward()
        optimizer.step()
    path.parent.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}, path)
    return path


@pytest.mark.parametrize("fill", ["empty", "fresh"])
def test_a_spliced_file_loads_as_the_rewritten_one_does(tmp_path: Path, fill: str) -> None:
    path = _trained(tmp_path / "in" / "optimizer.pt")
    moved, additions = _spliced(path, tmp_path / "spliced.pt", fill)
    assert moved % 64 == 0
    verify_torch_file(path, tmp_path / "spliced.pt", "optimizer.pt", additions)  # type: ignore[arg-type]
    rewritten = api.fix(path, tmp_path / "rewritten.pt", fill=fill).out
    spliced = torch.load(tmp_path / "spliced.pt", weights_only=True)["optimizer"]
    expected = torch.load(rewritten, weights_only=True)["optimizer"]
    assert spliced["param_groups"] == expected["param_groups"] and spliced["state"].keys() == expected["state"].keys()
    for param, state in expected["state"].items():
        assert state.keys() == spliced["state"][param].keys()
        assert all(torch.equal(state[key], spliced["state"][param][key]) for key in state)
    with zipfile.ZipFile(tmp_path / "spliced.pt") as archive:
        kept = [info for info in archive.infolist() if "/data/" in info.filename]
    copy = open_torch_file(tmp_path / "spliced.pt", "spliced.pt")
    assert all(copy.storage_range(key)[0] % 64 == 0 for key in copy.graph.storages)  # mmap-aligned, as torch writes
    assert len(kept) == len(copy.graph.storages)


def test_an_archive_not_laid_out_as_torch_lays_it_out_is_refused(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in")
    path = built.path / "optimizer.pt"
    reordered = tmp_path / "reordered.pt"
    with zipfile.ZipFile(path) as archive, zipfile.ZipFile(reordered, "w") as out:
        for info in reversed(archive.infolist()):  # the pickle last
            out.writestr(info, archive.read(info))
    torch_file = open_torch_file(reordered, "reordered.pt")
    assert isinstance(torch_file, ZipTorchFile)
    with (tmp_path / "scratch").open("w+b") as written, pytest.raises(RepairRefused, match="the pickle first"):
        splice(torch_file, b"", [], written.fileno(), "reordered.pt")


def test_a_fix_on_disk_keeps_the_original_records_as_one_range_moved_by_a_multiple_of_64(tmp_path: Path) -> None:
    path = _trained(tmp_path / "in" / "optimizer.pt")
    out = api.fix(path, tmp_path / "fixed.pt").out
    with zipfile.ZipFile(path) as before, zipfile.ZipFile(out) as after:
        kept = sorted(before.infolist(), key=lambda info: info.header_offset)[1:]
        twins = {info.filename: info for info in after.infolist()}
        start, end = kept[0].header_offset, before.start_dir
    moved = twins[kept[0].filename].header_offset - start
    assert moved % 64 == 0 and all(twins[info.filename].header_offset == info.header_offset + moved for info in kept)
    assert path.read_bytes()[start:end] == out.read_bytes()[start + moved : end + moved]


@pytest.mark.parametrize("fill", ["empty", "fresh"])
def test_an_appended_file_holds_the_whole_original_and_loads_as_the_rewritten_one_does(
    tmp_path: Path, fill: str
) -> None:
    """GCS composes whole objects only: the copy is the original byte for byte, then a new pickle, the new storages
    and a new directory; the original's own pickle and directory are dead space no reader reaches."""
    path = _trained(tmp_path / "in" / "optimizer.pt")
    planned = api.plan(path, fill=fill)
    torch_file = open_torch_file(path, "optimizer.pt")
    assert isinstance(torch_file, ZipTorchFile)
    root, created = edited_root(torch_file, planned.additions, ())
    original = path.read_bytes()
    with (tmp_path / "scratch").open("w+b") as written:
        made = append(torch_file, len(original), dump_graph(root), created, written.fileno(), "optimizer.pt")
        written.seek(made.tail_at)
        tail = written.read(made.tail)
    assert (made.head, made.start, made.end, made.moved) == (0, 0, len(original), 0)
    appended = tmp_path / "appended.pt"
    appended.write_bytes(original + tail)
    verify_torch_file(path, appended, "optimizer.pt", planned.additions, holder=HolderProof(kept=(0, len(original), 0)))  # type: ignore[arg-type]
    verify_torch_file(path, appended, "optimizer.pt", planned.additions)  # type: ignore[arg-type]
    expected = torch.load(api.fix(path, tmp_path / "rewritten.pt", fill=fill).out, weights_only=True)["optimizer"]
    for mmap in (False, True):
        loaded = torch.load(appended, weights_only=True, mmap=mmap)["optimizer"]
        assert loaded["param_groups"] == expected["param_groups"]
        assert loaded["state"].keys() == expected["state"].keys()
        for param, state in expected["state"].items():
            assert all(torch.equal(state[key], loaded["state"][param][key]) for key in state)
    with zipfile.ZipFile(appended) as archive:
        assert archive.testzip() is None
        pickle = archive.getinfo("optimizer/data.pkl")
        assert pickle.header_offset >= len(original)  # the new pickle, after the whole original
    copy = open_torch_file(appended, "appended.pt")
    assert all(copy.storage_range(key)[0] % 64 == 0 for key in copy.graph.storages)
    assert api.inspect(appended).verdict == "healthy"
