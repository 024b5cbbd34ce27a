"""``optim_repair.fix`` end to end through the library: plan, atomic write (``optim_repair.writer``), verify.

Every fix here goes through ``tests.support.fix``, which asserts the input is unchanged afterwards
(content, mtime and mode of every file), whatever happened.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.optim.lr_scheduler import LinearLR

import optim_repair
from optim_repair import writer
from optim_repair.errors import OutputError, RepairRefused, VerificationError
from optim_repair.verify import verify_torch_file
from tests import checkpoints as ck
from tests.checkpoints import Built
from tests.support import (
    assert_copy_faithful,
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
    untouched,
)

SAFE = sorted(set(ck.FACTORIES) - set(ck.MALFORMED))
OPT = ck.OPT_SITE


def with_scheduler(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """As the trainer resumes: the scheduler adds ``initial_lr``, which the saved param groups hold."""
    LinearLR(opt, start_factor=0.5, total_iters=4)
    return opt


def out_for(built: Built, tmp_path: Path) -> Path:
    return tmp_path / ("fixed" + built.path.suffix)


@pytest.mark.parametrize("factory", SAFE)
def test_fix_adds_exactly_the_missing_entries_and_changes_nothing_else(
    root: Path, tmp_path: Path, factory: str
) -> None:
    built = ck.FACTORIES[factory](root)
    out = out_for(built, tmp_path)
    result = fix(built.path, out)
    assert result.plan.fill == "empty"
    added = {(a.file, a.location, a.param) for a in result.plan.additions}
    assert added == {(s.file, s.location, p) for s, missing in built.missing.items() for p in missing}
    assert all(a.state == () for a in result.plan.additions)
    assert_fixed_copy(built, out)
    assert (result.verification.tensors > 0, result.verification.bytes > 0) == ((False, False) if factory == "cold"
                                                                             else (True, True))
    again = optim_repair.inspect(out)
    assert again.verdict == "healthy"
    assert [opt.missing for opt in again.optimizers] == [() for _ in again.optimizers]


def test_the_bug_report_is_repaired_and_resumes_through_the_stock_loader(
    bug_report_checkpoint: Built, tmp_path: Path
) -> None:
    built = bug_report_checkpoint
    out = tmp_path / "fixed"
    fix(built.path, out)
    model = ck.BugReportNet()
    opt = with_scheduler(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0))
    with pytest.raises(RuntimeError, match="Missing optimizer state for parameter"):
        set_optimizer_state_dict(model, opt, built.load())
    sd = load(out / "checkpoint.pt")["optimizer_state_dict"]
    assert [name for name in ck.BUG_REPORT_MISSING if sd["state"][name] == {}] == list(ck.BUG_REPORT_MISSING)
    set_optimizer_state_dict(model, opt, sd, options=StateDictOptions(full_state_dict=True))
    ck.train(model, opt, 1, use_all=True)


@pytest.mark.parametrize("full", [True, False], ids=["full_state_dict", "sharded_state_dict"])
def test_name_keyed_copies_load_through_set_optimizer_state_dict(root: Path, tmp_path: Path, full: bool) -> None:
    options = StateDictOptions(full_state_dict=full)
    built = ck.unirl_torch(root / "u")
    fix(built.path, tmp_path / "u")
    model = ck.TwoHeadNet()
    opt = with_scheduler(ck.make_optimizer(model))
    with pytest.raises(RuntimeError, match="Missing optimizer state"):
        set_optimizer_state_dict(model, opt, built.load(), options=options)
    set_optimizer_state_dict(model, opt, load(tmp_path / "u" / "checkpoint.pt")["optimizer_state_dict"],
                             options=options)
    ck.train(model, opt, 1, use_all=True)
    assert len(opt.state) == 6

    multi = ck.multi_optimizer(root / "m")
    fix(multi.path, tmp_path / "m.pt")
    payload = load(tmp_path / "m.pt")
    actor, critic = ck.TwoHeadNet(seed=3), ck.TwoHeadNet(hidden=5, seed=4)
    set_optimizer_state_dict(actor, with_scheduler(ck.make_optimizer(actor)), payload["optimizers"]["actor"],
                             options=options)
    set_optimizer_state_dict(critic, with_scheduler(ck.make_optimizer(critic, "adam", groups=2)),
                             payload["optimizers"]["critic"], options=options)


def test_index_keyed_copies_load_through_optimizer_load_state_dict(root: Path, tmp_path: Path) -> None:
    hf = ck.hf_trainer(root / "hf")
    fix(hf.path, tmp_path / "hf")
    model = ck.TwoHeadNet()
    opt = ck.make_optimizer(model)
    opt.load_state_dict(load(tmp_path / "hf" / "optimizer.pt"))
    assert [opt.state.get(p, None) for p in (model.head_unused.weight, model.head_unused.bias)] == [{}, {}]
    ck.train(model, opt, 1, use_all=True)
    assert set(opt.state[model.head_unused.weight]) == {"step", "exp_avg", "exp_avg_sq"}

    lightning = ck.lightning(root / "l")
    fix(lightning.path, tmp_path / "l.ckpt")
    module = ck.LitWrapper(ck.TwoHeadNet())
    opt = ck.make_optimizer(module)
    opt.load_state_dict(load(tmp_path / "l.ckpt")["optimizer_states"][0])
    ck.train(module, opt, 1, use_all=True)

    acc = ck.accelerate(root / "a")
    fix(acc.path, tmp_path / "a")
    model = ck.TwoHeadNet()
    first = torch.optim.AdamW([model.trunk.weight, model.trunk.bias, model.head_unused.weight, model.head_unused.bias])
    second = torch.optim.Adam([model.head_used.weight, model.head_unused.bias, model.head_used.bias])
    first.load_state_dict(load(tmp_path / "a" / "optimizer.bin"))
    second.load_state_dict(load(tmp_path / "a" / "optimizer_1.bin"))


def test_tricky_tensors_are_bit_identical(tricky_checkpoint: Built, tmp_path: Path) -> None:
    built = tricky_checkpoint
    out = tmp_path / "fixed.pt"
    fix(built.path, out)
    original, copy = load(built.path), load(out)
    comparison = assert_copy_faithful(original, copy, {(*OPT, "state"): set(built.all_missing)})
    assert comparison.tensors == len(original["policy_state_dict"]) + sum(
        len(e) for e in original["optimizer_state_dict"]["state"].values())
    before, after = original["optimizer_state_dict"]["state"], copy["optimizer_state_dict"]["state"]
    # the documented hard cases, spelled out
    bits = after["head_used.weight"]["exp_avg"].view(torch.int32).view(-1)[:3].tolist()
    assert [b & 0xFFFFFFFF for b in bits] == [*ck.NAN_BITS_F32, ck.NEG_ZERO_F32]
    assert after["gain_bf16"]["exp_avg"].dtype == torch.bfloat16
    assert after["gain_bf16"]["exp_avg"].view(torch.int16).view(-1)[0].item() & 0xFFFF == ck.NAN_BITS_BF16
    assert after["gain_fp16"]["exp_avg"].view(torch.int16).view(-1)[0].item() & 0xFFFF == ck.NAN_BITS_F16
    assert after["spectral"]["exp_avg"].dtype == torch.complex64
    assert after["void"]["exp_avg"].shape == (0, 4)
    tw = after["trunk.weight"]["exp_avg"]
    assert not tw.is_contiguous() and tw.stride() == before["trunk.weight"]["exp_avg"].stride()
    tb = after["trunk.bias"]
    assert tb["exp_avg"].untyped_storage().data_ptr() == tb["exp_avg_sq"].untyped_storage().data_ptr()
    assert tb["exp_avg_sq"].storage_offset() == before["trunk.bias"]["exp_avg_sq"].storage_offset() > 0
    for name in ("head_unused.weight", "head_unused.bias", "spectral_unused", "void_unused", "gain_bf16_unused"):
        assert after[name] == {}


def test_cold_optimizer_stays_cold(cold_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "cold.pt"
    fix(cold_checkpoint.path, out)
    sd = load(out)
    assert sd["state"] == {i: {} for i in range(6)}
    assert sd["param_groups"] == load(cold_checkpoint.path)["param_groups"]


def test_healthy_checkpoint_still_gets_a_verified_copy(healthy_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "h.pt"
    result = fix(healthy_checkpoint.path, out)
    assert result.plan.additions == ()
    payload = load(healthy_checkpoint.path)
    assert result.verification.tensors == len(payload["policy_state_dict"]) + sum(
        len(entry) for entry in payload["optimizer_state_dict"]["state"].values())
    assert_copy_faithful(load(healthy_checkpoint.path), load(out))


def test_fix_is_idempotent(root: Path, tmp_path: Path) -> None:
    for built in (ck.tricky_tensors(root / "t"), ck.legacy_format(root / "l"), ck.petrainer(root / "p")):
        once, twice = tmp_path / f"once-{built.path.name}", tmp_path / f"twice-{built.path.name}"
        fix(built.path, once)
        result = fix(once, twice)
        assert result.plan.additions == ()
        assert optim_repair.inspect(twice).verdict == "healthy"
        for site in built.sites:
            a, b = (once / site.file, twice / site.file) if site.file else (once, twice)
            verify_torch_file(a, b, site.file or "f", [])  # graph-equal, every storage byte-equal
            assert_copy_faithful(load(a), load(b))


# ---------------------------------------------------------------- what is refused


def test_malformed_input_writes_nothing(malformed_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    with pytest.raises(RepairRefused) as info:
        fix(malformed_checkpoint.path, out)
    assert info.value.exit_code == 3
    assert "refusing to write a copy of a malformed checkpoint" in str(info.value)
    assert_nothing_written(out)


def test_existing_out_is_refused_unless_forced(root: Path, tmp_path: Path) -> None:
    built = ck.unirl_torch(root)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with untouched(out), pytest.raises(OutputError, match="already exists; pass --force") as info:
        fix(built.path, out)
    assert info.value.exit_code == 5
    fix(built.path, out, force=True)
    assert not (out / "old.txt").exists()
    assert_fixed_copy(built, out)
    assert leftovers(out) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]


def test_existing_file_out_is_replaced_with_force(root: Path, tmp_path: Path) -> None:
    built = ck.lightning(root)
    out = tmp_path / "out.ckpt"
    out.write_text("old")
    with pytest.raises(OutputError, match="already exists"):
        fix(built.path, out)
    assert out.read_text() == "old"
    fix(built.path, out, force=True)
    assert_fixed_copy(built, out)
    with pytest.raises(OutputError, match="exists and is not a directory"):
        fix(ck.unirl_torch(root / "d").path, out, force=True)


def test_out_inside_or_equal_to_or_containing_the_input_is_refused(root: Path) -> None:
    built = ck.unirl_torch(root)
    for out, force in ((built.path / "fixed", False), (built.path / "sub" / "fixed", False), (built.path, True),
                       (built.path / "checkpoint.pt", True), (root, True), (root.parent, True)):
        with untouched(root), pytest.raises(OutputError, match="--out must not") as info:
            fix(built.path, out, force=force)
        assert info.value.exit_code == 5
    single = ck.lightning(root / "single")
    with pytest.raises(OutputError, match="--out must not be the input"):
        fix(single.path, single.path, force=True)


def test_out_in_a_missing_directory_is_refused(root: Path, tmp_path: Path) -> None:
    built = ck.healthy(root)
    with pytest.raises(OutputError, match="no such directory"):
        fix(built.path, tmp_path / "absent" / "out.pt")
    assert not (tmp_path / "absent").exists()


# ---------------------------------------------------------------- failures leave nothing behind


def test_a_verification_mismatch_removes_the_copy(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection in our own writer (never in torch): corrupt the written bytes before verification."""
    built = ck.unirl_torch(root)
    real = writer.write_torch_file

    def corrupting(src: Path, source: str, additions: Any, dest: Path) -> None:
        real(src, source, additions, dest)
        flip_byte(dest, max(offset for offset, _ in storage_ranges(dest).values()))

    monkeypatch.setattr(writer, "write_torch_file", corrupting)
    out = tmp_path / "out"
    message = r"checkpoint\.pt: the bytes of storage .* changed; the copy was removed"
    with pytest.raises(VerificationError, match=message):
        fix(built.path, out)
    assert_nothing_written(out)


def test_an_interrupt_leaves_nothing_behind(root: Path, tmp_path: Path) -> None:
    built = ck.petrainer(root)
    calls: list[str] = []

    def interrupt(message: str) -> None:
        calls.append(message)
        if len(calls) == 2:  # after the first file was written
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        fix(built.path, out, progress=interrupt)
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
        result = subprocess.run(["bash", "-c", f"ulimit -f {limit_kib}; exec {command}"], capture_output=True,
                                text=True, timeout=120)
    assert result.returncode == 5, result.stderr
    assert "the disk is full" in result.stderr and str(out) in result.stderr
    assert "optim-repair-" not in result.stderr, "the message names --out, not a temporary file"
    assert "Traceback" not in result.stderr
    assert_nothing_written(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


# ---------------------------------------------------------------- read-only input


@pytest.fixture
def read_only_tree(root: Path) -> Iterator[Built]:
    built = ck.hf_trainer(root)
    make_read_only(root)
    yield built
    make_writable(root)


def test_read_only_input_in_process(read_only_tree: Built, tmp_path: Path) -> None:
    built = read_only_tree
    out = tmp_path / "out"
    fix(built.path, out)
    assert_fixed_copy(built, out)


def unprivileged(probe: Path) -> list[str]:
    """A command prefix under which file modes bind (as root: drop the capabilities that bypass them)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv is not None, "as root, setpriv (util-linux) is needed to make file modes bind"
    prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
    check = subprocess.run([*prefix, sys.executable, "-c", f"open({str(probe)!r}, 'ab')"], capture_output=True,
                           text=True)
    assert check.returncode != 0 and "PermissionError" in check.stderr, f"{probe} is still writable"
    return prefix


def test_read_only_input_really_unwritable(read_only_tree: Built, tmp_path: Path) -> None:
    built = read_only_tree
    prefix = unprivileged(built.path / "optimizer.pt")
    out = tmp_path / "out"
    before = snapshot(built.path)
    result = subprocess.run([*prefix, *installed_command(), "fix", str(built.path), "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert snapshot(built.path) == before
    assert_fixed_copy(built, out)


def test_an_unwritable_out_directory_exits_5_and_writes_nothing(root: Path, tmp_path: Path) -> None:
    built = ck.unirl_torch(root)
    parent = tmp_path / "locked"
    parent.mkdir()
    (parent / "probe").write_text("")
    make_read_only(parent)
    try:
        prefix = unprivileged(parent / "probe")
        with untouched(built.path):
            result = subprocess.run([*prefix, *installed_command(), "fix", str(built.path), "--out",
                                     str(parent / "out")], capture_output=True, text=True, timeout=120)
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
        "nested/blob.bin": "not", "rng_state.pth": "refuses", "scheduler.pt": "holds",
        "training_args.bin": "refuses"}
    assert result.diagnosis.verdict == "repairable"
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
    fix(built.path, out)
    for name in ("linked-dir", "linked-file.txt", "dangling"):
        assert (out / name).is_symlink() and os.readlink(out / name) == os.readlink(built.path / name), name
    assert (out / "linked-dir" / "data.txt").read_text() == "data\n"
    assert load(out / "checkpoint.pt")["optimizer_state_dict"]["state"]["head_unused.weight"] == {}


def test_fresh_fill_takes_each_optimizers_shapes_from_its_own_model(
    multi_optimizer_checkpoint: Built, tmp_path: Path
) -> None:
    """``models.actor`` and ``models.critic`` both name ``head_unused.weight``: (2, 8) and (2, 5).

    The critic's fresh moments must have the critic's shape (or the fill must be refused as ambiguous);
    moments shaped like the actor's parameter cannot be loaded into the critic.
    """
    out = tmp_path / "fresh.pt"
    try:
        fix(multi_optimizer_checkpoint.path, out, fill="fresh")
    except RepairRefused:
        assert_nothing_written(out)
        return
    payload = load(out)
    for side in ("actor", "critic"):
        weight = payload["models"][side]["head_unused.weight"]
        added = payload["optimizers"][side]["state"]["head_unused.weight"]
        assert added["exp_avg"].shape == weight.shape, side
