"""Checkpoints made of symbolic links: the Hugging Face cache, DVC, a ``latest`` link.

A link to a regular file is read through; the repaired file is a regular file in the copy; every other
link stays a link, and those pointing outside the checkpoint are named; ``--dereference`` (``cp -L``)
copies what every link reaches, up to a bound in paths and in bytes: links that lead to the same directory
again multiply what is reached without any loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import optim_repair
from optim_repair.checkpoint.discovery import MAX_REACHED_BYTES, MAX_REACHED_PATHS, discover
from optim_repair.errors import InputError, UsageError
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import trainers
from tests.factories.support import assert_nothing_written, load


def hub_cache(checkpoint: Path, cache: Path, revision: str = "0123abcd") -> Path:
    """``checkpoint`` as the Hugging Face hub caches it: every file moved to ``blobs/<sha256>`` and linked from
    ``snapshots/<revision>/`` by a relative link, as ``huggingface_hub`` creates them."""
    blobs, snapshot = cache / "blobs", cache / "snapshots" / revision
    blobs.mkdir(parents=True)
    for path in sorted(checkpoint.rglob("*")):
        rel = path.relative_to(checkpoint)
        if path.is_dir():
            (snapshot / rel).mkdir(parents=True, exist_ok=True)
            continue
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_hub_cache_snapshot_is_inspected_as_its_files(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "run")
    snapshot = hub_cache(built.path, tmp_path / "cache")
    original = optim_repair.inspect(built.path)
    linked = optim_repair.inspect(snapshot)
    assert linked.verdict == original.verdict and linked.optimizers == original.optimizers
    assert [(d.file, d.missing) for d in linked.optimizers] == [("optimizer.pt", (4, 5))]
    notice = next(n for n in linked.notices if n.code == "links-outside")
    assert "6 symbolic link(s) point outside the checkpoint" in notice.detail
    assert "optimizer.pt" in notice.detail and "--dereference" in notice.detail
    assert not any(n.code == "links-outside" for n in original.notices)


def test_the_repaired_file_is_a_regular_file_and_other_links_stay_links(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "run")
    snapshot = hub_cache(built.path, tmp_path / "cache")
    plain, beside = tmp_path / "plain", snapshot.parent / "0123abcd-fixed"
    optim_repair.fix(built.path, plain)
    result = optim_repair.fix(snapshot, beside)
    assert result.plan.additions
    repaired = beside / "optimizer.pt"
    assert repaired.is_file() and not repaired.is_symlink()
    assert repaired.read_bytes() == (plain / "optimizer.pt").read_bytes(), "the same repair as of the files"
    for name in ("model.safetensors", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json"):
        link = beside / name
        assert link.is_symlink() and os.readlink(link) == os.readlink(snapshot / name), name
        assert link.read_bytes() == (built.path / name).read_bytes(), "beside the snapshot, the links still reach"
    assert files(beside) == files(plain)
    assert optim_repair.inspect(beside, strict=True).verdict == "healthy"


def test_dereference_copies_what_every_link_reaches(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "run")
    snapshot = hub_cache(built.path, tmp_path / "cache")
    out = tmp_path / "out"
    result = run_cli(["fix", snapshot, "--out", out, "--dereference", "--json"])
    assert json.loads(result.stdout)["verification"]["tensors"] > 0
    assert not [p for p in out.rglob("*") if p.is_symlink()], "cp -L: no link left"
    optim_repair.fix(built.path, tmp_path / "plain")
    assert files(out) == files(tmp_path / "plain")
    diagnosis = optim_repair.inspect(snapshot, dereference=True)
    assert not any(n.code == "links-outside" for n in diagnosis.notices)


def test_a_link_inside_the_checkpoint_is_one_file_and_stays_a_link(tmp_path: Path) -> None:
    """``latest.pt -> optimizer.pt``: read once, and in the copy it reaches the repaired file."""
    built = trainers.hf_trainer(tmp_path / "run")
    (built.path / "latest.pt").symlink_to("optimizer.pt")
    diagnosis = optim_repair.inspect(built.path)
    assert [d.file for d in diagnosis.optimizers] == ["optimizer.pt"]
    skipped = {skip.file: skip.reason for skip in diagnosis.skipped}
    assert skipped["latest.pt"] == "is a link to optimizer.pt, read there"
    assert not any(n.code == "links-outside" for n in diagnosis.notices)
    out = tmp_path / "out"
    optim_repair.fix(built.path, out)
    assert (out / "latest.pt").is_symlink() and os.readlink(out / "latest.pt") == "optimizer.pt"
    assert (out / "latest.pt").read_bytes() == (out / "optimizer.pt").read_bytes()


def test_an_unchanged_linked_optimizer_file_stays_a_link(tmp_path: Path) -> None:
    """Two optimizer files, one healthy and linked from outside: only the repaired one becomes a file."""
    built = trainers.unirl_torch(tmp_path / "u")
    outside = tmp_path / "store"
    outside.mkdir()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), outside / "healthy.pt")
    (built.path / "other_optimizer.pt").symlink_to(outside / "healthy.pt")
    out = tmp_path / "out"
    result = optim_repair.fix(built.path, out)
    assert {addition.file for addition in result.plan.additions} == {"checkpoint.pt"}
    assert (out / "other_optimizer.pt").is_symlink()
    assert os.readlink(out / "other_optimizer.pt") == str(outside / "healthy.pt")
    assert not (out / "checkpoint.pt").is_symlink()


def test_a_dvc_linked_dcp_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    """DVC's symlink cache: every file of a DCP checkpoint a link into the cache. The shards stay links (or are
    copied with --dereference), the new ``.metadata`` is a file, and stock DCP resumes both exactly."""
    built = dk.unirl_dcp(tmp_path / "in")
    cache = tmp_path / "dvc-cache"
    cache.mkdir()
    for path in sorted(built.path.iterdir()):
        blob = cache / hashlib.md5(path.read_bytes()).hexdigest()
        path.rename(blob)
        path.symlink_to(blob)
    assert optim_repair.inspect(built.path).verdict == "repairable"
    expected = dk.uninterrupted()
    for options in ({}, {"dereference": True}):
        out = tmp_path / f"out{len(options)}"
        optim_repair.fix(built.path, out, **options)
        assert (out / ".metadata").is_file() and not (out / ".metadata").is_symlink()
        shards = sorted(out.glob("*.distcp"))
        assert shards and all(shard.is_symlink() != bool(options) for shard in shards if shard.name.startswith("__0"))
        resumed = dk.resume(out, "adamw", "optim", flatten=False)
        assert all(torch.equal(resumed[name], expected[name]) for name in expected), options


def test_a_linked_directory_is_not_walked_unless_dereferenced(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainers.hf_trainer(run)
    (run / "latest").symlink_to("checkpoint-3")
    assert [d.file for d in optim_repair.inspect(run).optimizers] == ["checkpoint-3/optimizer.pt"]
    dereferenced = optim_repair.inspect(run, dereference=True)
    assert [d.file for d in dereferenced.optimizers] == ["checkpoint-3/optimizer.pt", "latest/optimizer.pt"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "linked").symlink_to(run / "checkpoint-3")
    with pytest.raises(InputError, match=r"1 linked director\(ies\) not followed: dereference follows them\)$"):
        optim_repair.inspect(elsewhere)
    refused = run_cli(["inspect", elsewhere], code=4)
    assert "1 linked director(ies) not followed: --dereference follows them)" in refused.stderr
    assert optim_repair.inspect(elsewhere, dereference=True).verdict == "healthy"


def test_dereference_refuses_a_loop_in_one_line(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "run")
    (built.path / "nested").mkdir()
    (built.path / "nested" / "up").symlink_to("..")
    out = tmp_path / "out"
    result = run_cli(["fix", built.path, "--out", out, "--dereference"], code=4)
    assert "up: is a link to a directory that holds it; --dereference cannot copy a loop" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert_nothing_written(out)
    with pytest.raises(InputError, match="up: is a link to a directory that holds it; dereference cannot copy a loop"):
        optim_repair.inspect(built.path, dereference=True)  # the library names no flag
    optim_repair.fix(built.path, out)
    assert os.readlink(out / "nested" / "up") == ".."


def test_a_diagnosis_keeps_how_it_was_read(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "run")
    snapshot = hub_cache(built.path, tmp_path / "cache")
    diagnosis = optim_repair.inspect(snapshot)
    with pytest.raises(UsageError, match="dereference is decided when the checkpoint is read"):
        optim_repair.fix(diagnosis, tmp_path / "out", dereference=True)
    followed = optim_repair.inspect(snapshot, dereference=True)
    optim_repair.fix(followed, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").is_symlink()
    assert load(tmp_path / "out" / "optimizer.pt")["state"]


def link_bomb(base: Path, levels: int) -> Path:
    """``levels`` directories, each holding two links (``a``, ``b``) to the next, and a checkpoint in the last:
    no loop, yet following the links reaches 2**levels copies of it (2**(levels + 1) paths before them)."""
    built = trainers.unirl_torch(base / "build")
    built.path.rename(base / str(levels))
    for level in range(levels):
        (base / str(level)).mkdir()
        for name in ("a", "b"):
            (base / str(level) / name).symlink_to(f"../{level + 1}")
    return base / "0"


PATH_BOUND = (
    f"following links reaches more than {MAX_REACHED_PATHS:,} paths (links that lead to the same directories "
    "multiply what is walked); pass it without"
)


@pytest.fixture(scope="module")
def bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 levels: 2**25 paths, with no loop."""
    return link_bomb(tmp_path_factory.mktemp("bomb"), 24)


def test_links_that_multiply_a_directory_are_refused_past_the_path_bound(bomb: Path) -> None:
    with pytest.raises(InputError) as refused:
        optim_repair.inspect(bomb, dereference=True)
    assert str(refused.value) == f"{bomb}: {PATH_BOUND} dereference"
    assert refused.value.exit_code == 4


def test_the_command_refuses_a_link_bomb_in_one_line_and_writes_nothing(bomb: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    commands: list[list[str | Path]] = [["inspect", bomb, "-L"], ["fix", bomb, "--out", out, "-L"]]
    for command in commands:
        result = run_cli(command, code=4)
        assert result.stderr == f"optim-repair: error: {bomb}: {PATH_BOUND} --dereference\n", result.stderr
        assert "Traceback" not in result.stdout
    assert_nothing_written(out)


def test_without_dereference_a_link_bomb_is_two_links(bomb: Path) -> None:
    found = discover(bomb)
    assert [(entry.rel, entry.role, entry.link) for entry in found.entries] == [
        ("a", "directory", True),
        ("b", "directory", True),
    ]
    with pytest.raises(InputError, match=r"no optimizer state found .* 2 linked director\(ies\) not followed"):
        optim_repair.inspect(bomb)


def test_links_that_multiply_a_directory_are_followed_below_the_bound(tmp_path: Path) -> None:
    few = link_bomb(tmp_path / "few", 3)
    diagnosis = optim_repair.inspect(few, dereference=True)
    assert len(diagnosis.optimizers) == 8 and diagnosis.verdict == "repairable"
    out = tmp_path / "out"
    optim_repair.fix(few, out, dereference=True)
    assert len(list(out.glob("*/*/*/checkpoint.pt"))) == 8
    assert not [path for path in out.rglob("*") if path.is_symlink()]
    assert optim_repair.inspect(out, strict=True).verdict == "healthy"


TIB = 2**40


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that holds no block on the disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    try:
        os.truncate(path, size)
    except OSError as exc:
        pytest.skip(f"this file system refuses a sparse file of {size} bytes ({exc})")
    return path


def test_links_that_multiply_a_large_file_are_refused_past_the_byte_bound(tmp_path: Path) -> None:
    """Each path that reaches a file counts its size, as a copy would hold it again; the bound is inclusive."""
    huge = sparse(tmp_path / "store" / "huge.blob", TIB)
    checkpoint = tmp_path / "blobs"
    checkpoint.mkdir()
    for number in range(MAX_REACHED_BYTES // TIB):
        (checkpoint / f"{number:03}.blob").symlink_to(huge)
    assert len(discover(checkpoint, dereference=True).entries) == MAX_REACHED_BYTES // TIB, "exactly the bound"
    (checkpoint / "one-more-byte").write_bytes(b"x")
    bound = (
        "following links reaches more than 256 TiB of files (links that lead to the same files or directories "
        "multiply what is copied); pass it without"
    )
    with pytest.raises(InputError) as refused:
        discover(checkpoint, dereference=True)
    assert str(refused.value) == f"{checkpoint}: {bound} dereference"
    assert len(discover(checkpoint).entries) == MAX_REACHED_BYTES // TIB + 1, "kept as links, nothing is counted"


def test_fix_refuses_to_copy_a_large_file_through_many_links(tmp_path: Path) -> None:
    built = trainers.unirl_torch(tmp_path / "run")
    huge = sparse(tmp_path / "store" / "huge.blob", 16 * TIB - 2**20)  # near the most ext4 allows
    links = [built.path / f"{number:02}.blob" for number in range(MAX_REACHED_BYTES // (16 * TIB) + 1)]
    for link in links:
        link.symlink_to(huge)
    out = tmp_path / "out"
    result = run_cli(["fix", built.path, "--out", out, "-L"], code=4)
    assert result.stderr.startswith(f"optim-repair: error: {built.path}: following links reaches more than 256 TiB")
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stdout
    assert_nothing_written(out)
    assert os.stat(huge).st_blocks == 0, "never read, never written"
    optim_repair.fix(built.path, out)  # without dereference, the links stay links
    assert all((out / link.name).is_symlink() for link in links)
