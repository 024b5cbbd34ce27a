"""The installed command run in a pseudo-terminal of a given width, as a user's shell runs it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
from pathlib import Path

from tests.factories.support import installed_command


def run_in_terminal(
    args: list[str], columns: int = 80, rows: int = 24, cwd: Path | None = None
) -> tuple[int, list[str]]:
    """Run ``optim-repair ARGS`` (in ``cwd``) on a terminal ``columns`` wide; its exit code, and the lines it showed
    (stdout and stderr together, styles removed: they take no width)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    process = subprocess.Popen(
        [*installed_command(), *args],
        stdin=follower, stdout=follower, stderr=follower, env={**env, "TERM": "xterm"}, cwd=cwd,
    )  # fmt: skip
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower closed: EIO
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    code = process.wait(timeout=60)
    return code, re.sub(r"\x1b\[[0-9;]*m", "", output.decode()).replace("\r\n", "\n").splitlines()
