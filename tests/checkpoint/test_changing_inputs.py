"""A checkpoint that changes under the tool: re-saved while it is copied, unreadable in part, moving.

Every input must be proven to be the one that was read (``Discovery.check_unchanged``): a change is exit 4
and nothing is written; an entry that cannot be read is exit 4, never skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import optim_repair
from optim_repair.checkpoint.discovery import discover
from optim_repair.errors import InputError
from optim_repair.progress import Step
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import trainers
from tests.factories.chunked import build_chunked
from tests.factories.support import assert_nothing_written, installed_command, leftovers, unprivileged


def _resave_on_first_write(action: object) -> object:
    """A progress callback that runs ``action`` (a second save of the checkpoint) once, as the copy starts."""
    done: list[bool] = []

    def progress(step: Step) -> None:
        if step.stage == "write" and not done:
            done.append(True)
            action()  # type: ignore[operator]

    return progress


def test_a_dcp_checkpoint_resaved_during_fix_is_refused(tmp_path: Path) -> None:
    """A run still saving (shard first, then .metadata): the copy would pair the old metadata with the new shard."""
    built = dk.unirl_dcp(tmp_path / "in")
    later = dk.trained(seed=3)
    state = {
        "model": get_model_state_dict(later.model),
        "optim": get_optimizer_state_dict(later.model, later.optimizer),
    }
    out = tmp_path / "out"
    progress = _resave_on_first_write(lambda: save(state, checkpoint_id=built.path))
    with pytest.raises(InputError, match=r"changed while being read \(is a run still saving it\?\); nothing was"):
        optim_repair.fix(built.path, out, progress=progress)  # type: ignore[arg-type]
    assert_nothing_written(out)
    assert optim_repair.inspect(built.path).verdict == "repairable", "the new save itself is whole"


def test_a_torch_file_resaved_during_fix_is_refused(tmp_path: Path) -> None:
    built = trainers.unirl_torch(tmp_path / "in")
    path = built.path / "checkpoint.pt"
    later = torch.load(path, weights_only=True)
    out = tmp_path / "out"
    progress = _resave_on_first_write(lambda: torch.save(later, path))
    with pytest.raises(InputError, match=r"checkpoint\.pt: changed while being read"):
        optim_repair.fix(built.path, out, progress=progress)  # type: ignore[arg-type]
    assert_nothing_written(out)


def test_a_second_process_saving_meanwhile_never_gets_a_mixed_copy(tmp_path: Path) -> None:
    """The way it was found: another process re-saves the DCP checkpoint in a loop while ``fix`` runs. Every
    run either refuses (exit 4) or writes a copy that stock DCP loads."""
    built = dk.unirl_dcp(tmp_path / "in")
    script = (
        "import sys, warnings; warnings.simplefilter('ignore')\n"
        "from pathlib import Path\n"
        "from torch.distributed.checkpoint import save\n"
        "from tests.factories import dcp as dk\n"
        "state = dk._unirl_state('adamw', False)\n"
        "for _ in range(40): save(state, checkpoint_id=Path(sys.argv[1]))\n"
    )
    saver = subprocess.Popen([sys.executable, "-c", script, str(built.path)], cwd=Path(__file__).parents[2])
    outcomes = set()
    try:
        for attempt in range(6):
            out = tmp_path / f"out{attempt}"
            result = subprocess.run(
                [*installed_command(), "fix", str(built.path), "--out", str(out)], capture_output=True, text=True
            )
            outcomes.add(result.returncode)
            assert result.returncode in (0, 4), result.stderr
            if result.returncode == 4:  # changed while read, or caught mid-save and damaged as it stood
                *before, error = result.stderr.strip().splitlines()
                assert error.startswith("optim-repair: error: "), result.stderr
                assert all(line.startswith("writing ") for line in before), result.stderr  # progress, if it began
                assert not out.exists() and not leftovers(out)
            else:
                dk.resume(out, "adamw", "optim", flatten=False)
    finally:
        saver.kill()
        saver.wait()
    assert outcomes


def _cut_once_read(path: Path, command: list[str], scanner: str) -> tuple[int, str]:
    """Run the installed command and, as soon as it has ``path`` open, cut the file to about half its size from
    this process, as ``torch.save`` rewriting it in place or ``cp`` over it would; return its exit code and stderr.
    Mapped, the file's pages past its new end (cut at a page's start: a partial page reads as zeros) killed the
    reader with SIGBUS (exit 135, no message)."""
    env = {**os.environ, "OPTIM_REPAIR_PURE_PYTHON": "1" if scanner == "pure-python" else "0"}
    reader = subprocess.Popen([*installed_command(), *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    opened, cut = Path(f"/proc/{reader.pid}/fd"), False
    target = str(path.resolve())
    while not cut and reader.poll() is None:
        try:
            cut = any(os.readlink(descriptor) == target for descriptor in opened.iterdir())
        except OSError:  # a descriptor closed while it was looked at
            continue
        if cut:
            os.truncate(path, path.stat().st_size // 2 & ~0xFFFF)
        else:
            time.sleep(0.0005)
    _, stderr = reader.communicate(timeout=300)
    assert cut, "the reader never had the file open"
    return reader.returncode, stderr.decode()


def _changed_while_read(code: int, stderr: str, name: str) -> None:
    assert code == 4, (code, stderr[-2000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("optim-repair: error: "), stderr[-2000:]
    assert f"{name}: changed while being read (is a run still saving it?)" in lines[0], lines[0]


SCANNERS = ["compiled", "pure-python"]


@pytest.mark.parametrize("scanner", SCANNERS)
def test_a_legacy_torch_file_cut_short_while_it_is_read_is_changed_while_read(tmp_path: Path, scanner: str) -> None:
    """A legacy torch file's pickles were scanned over a mapping of the whole file: cut meanwhile, SIGBUS."""
    path = tmp_path / "legacy.pt"
    state = {index: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2)} for index in range(20_000)}
    payload = {"state": state, "param_groups": [{"params": list(state), "lr": 0.1}]}
    torch.save(payload, path, _use_new_zipfile_serialization=False)  # a pickle of 3.4 MB
    whole = path.read_bytes()
    for _ in range(3):
        path.write_bytes(whole)
        _changed_while_read(*_cut_once_read(path, ["inspect", str(path)], scanner), "legacy.pt")


@pytest.mark.parametrize("scanner", SCANNERS)
def test_a_dcp_metadata_cut_short_while_it_is_walked_is_changed_while_read(tmp_path: Path, scanner: str) -> None:
    """The summary walk of ``inspect`` mapped ``.metadata`` (letting its pages go behind it): cut meanwhile, SIGBUS."""
    path = tmp_path / "ckpt"
    build_chunked(path, 64, 160)  # 30,235 chunks: a .metadata of 5 MB
    metadata = path / ".metadata"
    whole = metadata.read_bytes()
    for _ in range(3):
        metadata.write_bytes(whole)
        _changed_while_read(*_cut_once_read(metadata, ["inspect", str(path)], scanner), ".metadata")


def test_an_unreadable_subdirectory_is_an_input_error(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in")
    hidden = built.path / "global_step3"
    hidden.mkdir()
    torch.save({"x": torch.zeros(2)}, hidden / "extra.pt")
    hidden.chmod(0)
    prefix = unprivileged(hidden / "extra.pt")
    out = tmp_path / "out"
    try:
        for command in (["inspect", str(built.path)], ["fix", str(built.path), "--out", str(out)]):
            result = subprocess.run([*prefix, *installed_command(), *command], capture_output=True, text=True)
            assert result.returncode == 4, result.stderr
            assert result.stderr.strip().endswith("global_step3: cannot read (Permission denied)"), result.stderr
            assert len(result.stderr.strip().splitlines()) == 1
        assert not out.exists() and not leftovers(out)
    finally:
        hidden.chmod(0o755)


def test_force_replaces_only_a_file_a_directory_or_a_link(tmp_path: Path) -> None:
    built = trainers.unirl_torch(tmp_path / "in")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = run_cli(["fix", built.path / "checkpoint.pt", "--out", fifo, "--force"], code=5)
    assert "fifo: is a FIFO; --force replaces only a regular file, a directory or a link" in result.stderr
    assert fifo.is_fifo()
    result = run_cli(["fix", built.path / "checkpoint.pt", "--out", "/dev/null", "--force"], code=5)
    assert "/dev/null: is a character device; --force replaces only" in result.stderr
    assert Path("/dev/null").is_char_device()
    run_cli(["fix", built.path / "checkpoint.pt", "--out", tmp_path / "file.pt"])
    run_cli(["fix", built.path / "checkpoint.pt", "--out", tmp_path / "file.pt", "--force"])


def test_a_fifo_planted_with_a_stale_temporary_name_is_passed_over(tmp_path: Path) -> None:
    """Anyone can plant it in a shared directory: the stale-temporary cleanup must never open it."""
    built = trainers.unirl_torch(tmp_path / "in")
    out = tmp_path / "out"
    planted = tmp_path / ".out.optim-repair-tmp-deadbeef"
    os.mkfifo(planted)
    old = os.stat(planted).st_mtime - 3600
    os.utime(planted, (old, old))
    result = subprocess.run(
        [*installed_command(), "fix", str(built.path), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert planted.is_fifo(), "not ours: left alone"


def _nest(directory: Path, name: str, levels: int) -> Path:
    """``levels`` directories, each inside the one before, made through descriptors (past PATH_MAX too)."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=descriptor)
            inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=descriptor)
            os.close(descriptor)
            descriptor = inner
    finally:
        os.close(descriptor)
    return directory / name


def test_deep_directories_are_one_line(tmp_path: Path) -> None:
    """5,000 nested directories once gave a RecursionError (exit 70)."""
    built = trainers.hf_trainer(tmp_path / "in")
    top = _nest(built.path, "d", 5000)
    try:
        for command in (["inspect", str(built.path)], ["fix", str(built.path), "--out", str(tmp_path / "out")]):
            result = run_cli(command, code=4)
            line = result.stderr.strip()
            assert "nests directories more than 64 deep" in line and len(line) < 400 and "\n" not in line
        assert_nothing_written(tmp_path / "out")
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=True)


def test_a_name_beyond_path_max_is_a_short_line(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in")
    top = _nest(built.path, "n" * 250, 20)  # 20 x 251 characters: past PATH_MAX (4096), within 64 levels
    try:
        result = run_cli(["inspect", built.path], code=4)
        line = result.stderr.strip()
        assert "name too long" in line.lower(), line
        assert len(line) < 400 and "\n" not in line
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=True)


def test_a_file_removed_after_listing_is_exit_4(tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in")
    listed = discover(built.path)
    (built.path / "scheduler.pt").unlink()
    with pytest.raises(InputError, match=r"scheduler\.pt: changed while being read"):
        listed.check_unchanged()
