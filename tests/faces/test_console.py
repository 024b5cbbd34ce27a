"""The installed command's end of a run: the signals that end it and the streams it writes to.

Each case runs the real ``optim-repair`` in a subprocess on a real checkpoint, as users met the failures:
a signal at any moment from the entry point's first line to the process's exit, stdout or stderr closed
or full, a pipe its reader closes early. Whatever happens, the exit code is the documented one, stderr has
at most one line and no traceback, and a run that does not exit 0 leaves nothing behind.
"""

from __future__ import annotations

import fcntl
import filecmp
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import optim_repair
from optim_repair.signals import ENDING
from tests.factories import trainers
from tests.factories.support import installed_command, leftovers

F_SETPIPE_SZ = 1031
SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
MOMENTS = [index / 12 for index in range(16)]
"""When each signal is sent, as a fraction of an uninterrupted run: start-up, reading, copying, verifying,
the rename, the summary, and after the end."""


class Checkpoint:
    def __init__(self, path: Path, seconds: float) -> None:
        self.path, self.seconds = path, seconds


def _handles_signals(pid: int) -> bool:
    """Whether the process has installed its handlers: optim-repair's entry point has begun."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def _started(args: list[str], **streams: object) -> subprocess.Popen[str]:
    process = subprocess.Popen([*installed_command(), *args], text=True, **streams)  # type: ignore[call-overload]
    deadline = time.monotonic() + 30
    while not _handles_signals(process.pid) and time.monotonic() < deadline:
        time.sleep(0.0005)
    return process


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkpoint]:
    """A UniRL checkpoint with 64 MiB beside its optimizer, and how long an uninterrupted fix of it takes."""
    root = tmp_path_factory.mktemp("large")
    built = trainers.unirl_torch(root / "u", steps=2)
    (built.path / "big.bin").write_bytes(os.urandom(64 << 20))
    out = root / "timed"
    process = _started(["fix", str(built.path), "--out", str(out), "-q", "--no-sync"], stdout=subprocess.DEVNULL)
    began = time.monotonic()
    assert process.wait(timeout=60) == 0
    yield Checkpoint(built.path, time.monotonic() - began)


def _assert_one_line_or_none(stderr: str) -> None:
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert len(stderr.splitlines()) <= 1, stderr


@pytest.mark.parametrize(
    ("signum", "moment"),
    [(SIGNALS[index % len(SIGNALS)], moment) for index, moment in enumerate(MOMENTS)],
    ids=lambda value: value.name if isinstance(value, signal.Signals) else f"{value:.2f}",
)
def test_a_signal_at_any_moment_is_its_exit_code_and_leaves_nothing_behind(
    large: Checkpoint, tmp_path: Path, signum: signal.Signals, moment: float
) -> None:
    out = tmp_path / "out"
    process = _started(
        ["fix", str(large.path), "--out", str(out), "-q", "--no-sync"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    time.sleep(moment * large.seconds)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    _assert_one_line_or_none(stderr)
    assert leftovers(out) == []
    if process.returncode == 0:  # done before the signal: the copy is complete and verified, its summary out
        assert stderr == "" and "verified" in stdout
        assert filecmp.cmp(large.path / "big.bin", out / "big.bin", shallow=False)
        assert optim_repair.inspect(out).verdict == "healthy"
        return
    assert process.returncode == 128 + signum, stderr
    words = ENDING[signum][1]
    kept = f"optim-repair: error: {words}; {out} was already written and verified, and is kept\n"
    assert stderr in (f"optim-repair: error: {words}; nothing was written\n", kept)
    if stderr == kept:  # a finished copy is never undone
        assert filecmp.cmp(large.path / "big.bin", out / "big.bin", shallow=False)
        assert optim_repair.inspect(out).verdict == "healthy"
    else:
        assert not out.exists()


def _full_pipe() -> tuple[int, int]:
    """A pipe of one page that is already full: a write to it blocks until its reader reads."""
    reader, writer = os.pipe()
    fcntl.fcntl(writer, F_SETPIPE_SZ, 4096)
    os.set_blocking(writer, False)
    try:
        while True:
            os.write(writer, bytes(4096))
    except BlockingIOError:
        os.set_blocking(writer, True)
    return reader, writer


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda value: value.name)
def test_a_signal_after_the_rename_keeps_the_copy(large: Checkpoint, tmp_path: Path, signum: int) -> None:
    """The copy is in place but its summary is not out (stdout is a pipe nobody reads): the signal ends the run,
    and the finished copy stays, verified, where it was put."""
    out = tmp_path / "out"
    reader, writer = _full_pipe()
    process = _started(
        ["fix", str(large.path), "--out", str(out), "-q", "--no-sync"], stdout=writer, stderr=subprocess.PIPE
    )
    os.close(writer)
    deadline = time.monotonic() + 60
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.1)  # blocked on the summary's write
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    os.close(reader)
    assert process.returncode == 128 + signum
    words = ENDING[signum][1]
    assert stderr == f"optim-repair: error: {words}; {out} was already written and verified, and is kept\n"
    assert filecmp.cmp(large.path / "big.bin", out / "big.bin", shallow=False) and leftovers(out) == []
    assert optim_repair.inspect(out).verdict == "healthy"


def _run(args: list[str], **streams: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*installed_command(), *args], text=True, timeout=60, **streams)  # type: ignore[call-overload]


def _fix(built: Path, out: Path, *extra: str) -> list[str]:
    return ["fix", str(built), "--out", str(out), "--no-sync", *extra]


@pytest.fixture()
def small(tmp_path: Path) -> Path:
    return trainers.unirl_torch(tmp_path / "u").path


@pytest.mark.parametrize("command", ["inspect", "fix"])
def test_a_closed_stdout_is_an_output_error(small: Path, tmp_path: Path, command: str) -> None:
    out = tmp_path / "out"
    args = ["inspect", str(small)] if command == "inspect" else _fix(small, out)
    result = _run(args, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
    assert (result.returncode, result.stderr) == (5, "optim-repair: error: cannot write to stdout (it is closed)\n")
    assert not out.exists() and leftovers(out) == []


def test_a_full_stdout_is_an_output_error_and_keeps_the_finished_copy(small: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        inspected = _run(["inspect", str(small)], stdout=full, stderr=subprocess.PIPE)
        fixed = _run(_fix(small, out, "-q"), stdout=full, stderr=subprocess.PIPE)
    assert (inspected.returncode, inspected.stderr) == (
        5,
        "optim-repair: error: cannot write to stdout (the disk is full)\n",
    )
    assert fixed.returncode == 5
    assert fixed.stderr == (
        f"optim-repair: error: cannot write to stdout (the disk is full); {out} was already written and verified, "
        "and is kept\n"
    )
    assert optim_repair.inspect(out).verdict == "healthy" and leftovers(out) == []
    assert _run(_fix(small, out, "--force"), capture_output=True).returncode == 0  # a retry replaces it


@pytest.mark.parametrize("stderr", ["closed", "full"])
def test_a_closed_or_full_stderr_is_an_output_error_told_on_stdout_with_json(
    small: Path, tmp_path: Path, stderr: str
) -> None:
    out = tmp_path / "out"
    args = _fix(small, out, "--json")  # "writing checkpoint.pt" goes to stderr
    if stderr == "closed":
        result = _run(args, stdout=subprocess.PIPE, preexec_fn=lambda: os.close(2))
    else:
        with open("/dev/full", "w") as full:
            result = _run(args, stdout=subprocess.PIPE, stderr=full)
    reason = "it is closed" if stderr == "closed" else "the disk is full"
    assert result.returncode == 5
    assert json.loads(result.stdout)["error"] == {
        "code": "stream", "exit_code": 5, "message": f"cannot write to stderr ({reason})", "path": None,
    }  # fmt: skip
    assert not out.exists() and leftovers(out) == []
    with open("/dev/full", "w") as full:  # inspect --latest names the step it takes on stderr
        assert _run(["inspect", str(small.parent), "--latest"], stdout=subprocess.PIPE, stderr=full).returncode == 5


@pytest.mark.parametrize("command", ["inspect", "fix"])
def test_a_pipe_closed_early_is_exit_141_silent_and_keeps_the_copy(small: Path, tmp_path: Path, command: str) -> None:
    """``optim-repair inspect ckpt | head -c 10``: the reader takes ten bytes and goes; as in cat and git, the
    run ends with 141 and says nothing; a copy it had written and verified stays in place, never undone."""
    out = tmp_path / "out"
    args = ["inspect", str(small)] if command == "inspect" else _fix(small, out, "-q")
    reader, writer = os.pipe()
    fcntl.fcntl(writer, F_SETPIPE_SZ, 4096)  # smaller than the report, so that it is still writing
    process = subprocess.Popen([*installed_command(), *args], stdout=writer, stderr=subprocess.PIPE, text=True)
    os.close(writer)
    assert len(os.read(reader, 10)) == 10
    os.close(reader)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 141, stderr
    assert stderr == ""
    assert leftovers(out) == []
    if command == "fix":
        assert optim_repair.inspect(out).verdict == "healthy"


def test_a_closed_pipe_while_the_help_is_printed_is_exit_141() -> None:
    reader, writer = os.pipe()
    os.close(reader)
    result = _run(["fix", "--help"], stdout=writer, stderr=subprocess.PIPE)
    os.close(writer)
    # click's answer to EPIPE is exit 1, as rich's is for a report: "repairable", which would be a lie
    assert (result.returncode, result.stderr) == (141, "")


def test_a_signal_while_the_command_line_is_parsed_still_gives_the_json_document(small: Path) -> None:
    """SIGTERM before typer has parsed ``--json``: the error is a document on stdout all the same. The signal is
    raised as the console's handler raises it, from the first thing the command's parsing calls."""
    script = (
        "import signal, sys\n"
        "from optim_repair.errors import Stopped\n"
        "from optim_repair.cli import commands\n"
        "def stopped(*args, **kwargs):\n"
        "    raise Stopped(signal.SIGTERM)\n"
        "commands.app = stopped\n"
        f"sys.argv = ['optim-repair', 'inspect', {str(small)!r}, '--json']\n"
        "commands.run()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert json.loads(result.stdout)["error"]["exit_code"] == 128 + signal.SIGTERM
    assert result.stderr.startswith("optim-repair: error: ") and len(result.stderr.splitlines()) == 1
