"""The atomic copy (``optim_repair.checkpoint.writing``), through ``optim_repair.fix``: refusals, failures, links.

Whatever happens, the input is unchanged and nothing is left at ``--out`` or beside it but a verified copy.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import optim_repair
from optim_repair.errors import InputError, OutputError, RepairRefused, VerificationError
from optim_repair.formats.dcp import REPAIR_SHARD_PREFIX
from optim_repair.formats.torchfile import adapter as torch_adapter
from tests.factories import dcp as dk
from tests.factories import defects, trainers
from tests.factories.built import Built
from tests.factories.dcp import verify_dcp
from tests.factories.support import (
    assert_fixed_copy,
    assert_nothing_written,
    fix,
    flip_byte,
    installed_command,
    leftovers,
    load,
    make_read_only,
    make_writable,
    snapshot,
    storage_ranges,
    unprivileged,
    untouched,
)

# ---------------------------------------------------------------- what is refused


def test_malformed_input_writes_nothing(malformed_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    with pytest.raises(RepairRefused) as info:
        fix(malformed_checkpoint.path, out)
    assert info.value.exit_code == 3
    assert "refusing to write a copy of a malformed checkpoint" in str(info.value)
    assert_nothing_written(out)


def test_existing_out_is_refused_unless_forced(root: Path, tmp_path: Path) -> None:
    built = trainers.unirl_torch(root)
    out = tmp_path / "out"
    fix(built.path, out)
    (out / "checkpoint.pt").write_bytes(b"an earlier copy, damaged since")
    with untouched(out), pytest.raises(OutputError, match="already exists; pass force=True to replace it") as info:
        fix(built.path, out)
    assert info.value.exit_code == 5
    fix(built.path, out, force=True)
    assert_fixed_copy(built, out, fill="fresh")
    assert leftovers(out) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]


def test_force_replaces_only_what_looks_like_an_earlier_copy(root: Path, tmp_path: Path) -> None:
    """``--force --out ~``: a directory holding names the checkpoint has none of is no earlier copy of it."""
    built = trainers.unirl_torch(root)
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with untouched(home), pytest.raises(OutputError, match=r"holds 1 entries the checkpoint has none of \(notes.txt\)"):
        fix(built.path, home, force=True)
    repaired = tmp_path / "repaired"  # an earlier repair of a DCP checkpoint: its own shard beside the original's
    dcp_built = dk.unirl_dcp(root / "dcp")
    fix(dcp_built.path, repaired)
    assert any(path.name.startswith(REPAIR_SHARD_PREFIX) for path in repaired.iterdir())
    fix(dcp_built.path, repaired, force=True)  # the README's resume script runs fix --force again on a new step
    single = trainers.lightning(root / "single")
    with (
        untouched(home),
        pytest.raises(OutputError, match=f"is a directory; to write the copy into it, pass out {home}/"),
    ):
        fix(single.path, home, force=True)


def test_existing_file_out_is_replaced_with_force(root: Path, tmp_path: Path) -> None:
    built = trainers.lightning(root)
    out = tmp_path / "out.ckpt"
    out.write_text("old")
    with pytest.raises(OutputError, match="already exists"):
        fix(built.path, out)
    assert out.read_text() == "old"
    fix(built.path, out, force=True)
    assert_fixed_copy(built, out)  # index keys: {}, which their loader resumes exactly
    with pytest.raises(OutputError, match="is a file, and the copy of a directory is a directory"):
        fix(trainers.unirl_torch(root / "d").path, out, force=True)


def test_out_inside_or_equal_to_or_containing_the_input_is_refused(root: Path) -> None:
    built = trainers.unirl_torch(root)
    for out, force in (
        (built.path / "fixed", False),
        (built.path / "sub" / "fixed", False),
        (built.path, True),
        (built.path / "checkpoint.pt", True),
        (root, True),
        (root.parent, True),
    ):
        with untouched(root), pytest.raises(OutputError, match="out must not") as info:
            fix(built.path, out, force=force)
        assert info.value.exit_code == 5
    single = trainers.lightning(root / "single")
    with pytest.raises(OutputError, match="out must not be the input"):
        fix(single.path, single.path, force=True)


def test_out_in_a_missing_directory_is_refused(root: Path, tmp_path: Path) -> None:
    built = defects.healthy(root)
    with pytest.raises(OutputError, match="no such directory"):
        fix(built.path, tmp_path / "absent" / "out.pt")
    assert not (tmp_path / "absent").exists()


# ---------------------------------------------------------------- failures leave nothing behind


def test_a_verification_mismatch_removes_the_copy(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection in our own writer (never in torch): corrupt the written bytes before verification."""
    built = trainers.unirl_torch(root)
    real = torch_adapter.write_torch_file

    def corrupting(src: Path, source: str, additions: Any, dest: Path, **options: Any) -> Any:
        original = real(src, source, additions, dest, **options)
        flip_byte(dest, max(offset for offset, _ in storage_ranges(dest).values()))
        return original

    monkeypatch.setattr(torch_adapter, "write_torch_file", corrupting)
    out = tmp_path / "out"
    message = r"checkpoint\.pt: the bytes of storage .* changed; the copy was removed"
    with pytest.raises(VerificationError, match=message):
        fix(built.path, out, fill="empty")  # the last storage is then an existing one, the one corrupted
    assert_nothing_written(out)


def test_an_interrupt_leaves_nothing_behind(root: Path, tmp_path: Path) -> None:
    built = trainers.petrainer(root)
    calls: list[str] = []

    def interrupt(message: str) -> None:
        calls.append(message)
        if len(calls) == 2:  # after the first file was written
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        fix(built.path, out, notice=interrupt)
    assert_nothing_written(out)


def _big_checkpoint(directory: Path) -> Path:
    """About 3 MiB of AdamW state; ``head`` never got a gradient."""
    directory.mkdir(parents=True, exist_ok=True)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters())
    model[0](torch.ones(1, 512)).sum().backward()
    opt.step()
    path = directory / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    (directory / "notes.json").write_text("{}\n")
    return path


@pytest.mark.parametrize("directory", [False, True], ids=["file", "directory"])
def test_a_full_disk_leaves_no_out_and_no_temporary_files(tmp_path: Path, directory: bool) -> None:
    path = _big_checkpoint(tmp_path / "in")
    source = path.parent if directory else path
    out = tmp_path / ("out" if directory else "out.pt")
    limit_kib = 512  # RLIMIT_FSIZE: any write past 512 KiB fails with EFBIG, as on a full disk
    command = shlex.join([*installed_command(), "fix", str(source), "--out", str(out)])
    with untouched(source):
        result = subprocess.run(
            ["bash", "-c", f"ulimit -f {limit_kib}; exec {command}"], capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 5, result.stderr
    assert "the disk is full" in result.stderr and str(out) in result.stderr
    assert "optim-repair-" not in result.stderr, "the message names --out, not a temporary file"
    assert "Traceback" not in result.stderr
    assert_nothing_written(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


# ---------------------------------------------------------------- read-only input


@pytest.fixture
def read_only_tree(root: Path) -> Iterator[Built]:
    built = trainers.hf_trainer(root)
    make_read_only(root)
    yield built
    make_writable(root)


def test_read_only_input_in_process(read_only_tree: Built, tmp_path: Path) -> None:
    built = read_only_tree
    out = tmp_path / "out"
    fix(built.path, out)
    assert_fixed_copy(built, out)


def test_read_only_input_really_unwritable(read_only_tree: Built, tmp_path: Path) -> None:
    built = read_only_tree
    prefix = unprivileged(built.path / "optimizer.pt")
    out = tmp_path / "out"
    before = snapshot(built.path)
    result = subprocess.run(
        [*prefix, *installed_command(), "fix", str(built.path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert snapshot(built.path) == before
    assert_fixed_copy(built, out)


def test_an_unwritable_out_directory_exits_5_and_writes_nothing(root: Path, tmp_path: Path) -> None:
    built = trainers.unirl_torch(root)
    parent = tmp_path / "locked"
    parent.mkdir()
    (parent / "probe").write_text("")
    make_read_only(parent)
    try:
        prefix = unprivileged(parent / "probe")
        with untouched(built.path):
            result = subprocess.run(
                [*prefix, *installed_command(), "fix", str(built.path), "--out", str(parent / "out")],
                capture_output=True,
                text=True,
                timeout=120,
            )
    finally:
        make_writable(parent)
    assert result.returncode == 5, result.stderr
    assert "cannot write" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in parent.iterdir()) == ["probe"]


def test_directory_mode_copies_every_other_file_byte_identical(hf_checkpoint: Built, tmp_path: Path) -> None:
    built = hf_checkpoint
    (built.path / "empty-dir").mkdir()
    (built.path / "nested").mkdir()
    (built.path / "nested" / "blob.bin").write_bytes(os.urandom(100))  # not a torch file: skipped, copied
    out = tmp_path / "out"
    result = fix(built.path, out)
    assert {s.file: s.reason.split(" ")[0] for s in result.diagnosis.inventory.skipped} == {
        "nested/blob.bin": "not",
        "rng_state.pth": "holds",
        "scheduler.pt": "holds",
        "training_args.bin": "refuses",
    }
    assert result.diagnosis.verdict == "healthy", "optimizer.load_state_dict resumes HF's absent entries"
    assert (out / "empty-dir").is_dir()
    assert_fixed_copy(built, out)
    for name in ("rng_state.pth", "training_args.bin", "model.safetensors", "scheduler.pt", "nested/blob.bin"):
        assert (out / name).read_bytes() == (built.path / name).read_bytes()


def test_directory_mode_keeps_symlinks_as_links(unirl_checkpoint: Built, tmp_path: Path) -> None:
    """Links stay links (as ``cp -R`` keeps them): a linked directory is not emptied, a dangling link is no error."""
    built = unirl_checkpoint
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("data\n")
    (built.path / "linked-dir").symlink_to(shared)
    (built.path / "linked-file.txt").symlink_to(shared / "data.txt")
    (built.path / "dangling").symlink_to(tmp_path / "absent")
    out = tmp_path / "out"
    fix(built.path, out, fill="empty")
    for name in ("linked-dir", "linked-file.txt", "dangling"):
        assert (out / name).is_symlink() and os.readlink(out / name) == os.readlink(built.path / name), name
    assert (out / "linked-dir" / "data.txt").read_text() == "data\n"
    assert load(out / "checkpoint.pt")["optimizer_state_dict"]["state"]["head_unused.weight"] == {}


def test_dcp_checkpoints_keep_symlinks_as_links_too(tmp_path: Path) -> None:
    """One link policy for every format: inside a DCP checkpoint a link is copied as a link, never followed."""
    built = dk.unirl_dcp(tmp_path / "in")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not part of the checkpoint\n")
    (built.path / "notes.txt").symlink_to(outside / "secret.txt")
    (built.path / "zeros").symlink_to("/dev/zero")  # followed, it would fill the disk
    (built.path / "shared").symlink_to(outside)
    (built.path / "dangling").symlink_to(tmp_path / "absent")
    out = tmp_path / "out"
    result = fix(built.path, out)
    assert result.plan.additions
    for name in ("notes.txt", "zeros", "shared", "dangling"):
        assert (out / name).is_symlink() and os.readlink(out / name) == os.readlink(built.path / name), name
    assert optim_repair.inspect(out).verdict == "healthy"


def test_dcp_verification_catches_a_link_that_became_a_file(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    (built.path / "notes.txt").symlink_to(tmp_path / "absent")
    dest = tmp_path / "out"
    additions = dk.repaired(built, {"optim": "adamw"}, dest)
    (dest / "notes.txt").unlink()
    (dest / "notes.txt").write_text("")
    with pytest.raises(VerificationError, match=r"notes\.txt: is not the link"):
        verify_dcp(built.path, dest, additions)


def test_progress_reports_bytes_written_and_verified(tmp_path: Path) -> None:
    """The library reports progress in bytes (for a bar), never text; every byte written is verified."""
    from optim_repair.progress import Step

    built = trainers.hf_trainer(tmp_path / "in")
    steps: list[Step] = []
    notices: list[str] = []
    optim_repair.fix(built.path, tmp_path / "out", progress=steps.append, notice=notices.append)
    total = sum(path.stat().st_size for path in built.path.rglob("*") if path.is_file() and not path.is_symlink())
    for stage in ("write", "verify"):
        done = [step.done for step in steps if step.stage == stage]
        assert done == sorted(done) and done[-1] == total, stage
    assert all(step.total == total for step in steps)
    assert notices == ["writing optimizer.pt"]
    linked: list[Step] = []
    optim_repair.fix(built.path, tmp_path / "linked", link=True, progress=linked.append)
    assert {step.total for step in linked} == {(built.path / "optimizer.pt").stat().st_size}


def test_a_link_that_became_a_file_while_being_copied_is_named(unirl_checkpoint: Built, tmp_path: Path) -> None:
    """The checkpoint's file is written first; meanwhile the link beside it becomes a regular file."""
    link = unirl_checkpoint.path / "z-notes.txt"
    link.symlink_to(tmp_path / "absent")  # kept as a link in the copy
    out = tmp_path / "out"

    def replace_the_link(message: str) -> None:
        if message.startswith("writing") and link.is_symlink():
            link.unlink()
            link.write_text("a regular file now\n")

    with pytest.raises(InputError) as refused:
        optim_repair.fix(unirl_checkpoint.path, out, notice=replace_the_link)
    assert str(refused.value).startswith(f"{link}: changed while being copied: it was a symbolic link and is no")
    assert_nothing_written(out)


def test_a_hard_link_across_file_systems_names_the_original(tmp_path: Path) -> None:
    """``--link`` with ``--out`` on another file system (tmpfs in /dev/shm): the message names the original."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no tmpfs on a file system other than tmp_path's")
    root = Path(tempfile.mkdtemp(dir=shm))
    try:
        built = trainers.unirl_torch(root)
        out = tmp_path / "out"
        with pytest.raises(OutputError) as refused:
            optim_repair.fix(built.path, out, link=True)
        original = Path(str(refused.value.path))
        assert original.parent == built.path and original.is_file()
        assert str(refused.value).startswith(f"{original}: cannot hard-link it into the copy (")
        assert "write out on the file system of the original, or copy instead of linking" in str(refused.value)
        assert ".optim-repair-" not in str(refused.value)
        assert_nothing_written(out)
    finally:
        shutil.rmtree(root)
