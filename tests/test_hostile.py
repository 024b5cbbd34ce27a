"""Hostile and damaged input: a one-line error and exit 3 or 4, never a crash, a hang or a memory blowup.

Each case is the smallest input that showed a class of failure. They run in a child process with a
time limit and an address-space limit, so that a regression fails the test instead of the test run.
"""

from __future__ import annotations

import resource
import subprocess
from pathlib import Path

import pytest

from tests import hostile
from tests.support import installed_command

LIMIT_BYTES = 3 << 30


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, LIMIT_BYTES))


def refused(*args: str | Path, codes: tuple[int, ...] = (3, 4), timeout: float = 60) -> str:
    """Run the installed command under limits; assert a documented exit code and one error line; return it."""
    result = subprocess.run(
        [*installed_command(), *map(str, args)], capture_output=True, text=True, timeout=timeout, preexec_fn=_limits
    )
    assert result.returncode in codes, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("optim-repair: error: "), result.stderr[-2000:]
    assert result.stdout == ""
    return lines[0]


CRAFTED = {
    "deep-tuple-key": hostile.optimizer_with_key(hostile.deep_tuple(500_000)),
    "billion-laughs-key": hostile.optimizer_with_key(hostile.billion_laughs()),
    "memo-index-2**28": hostile.memo_bomb(),
    "bytearray-2**32": hostile.bytearray_bomb(),
    "billion-laughs-persistent-id": hostile.billion_laughs_persistent_id(),
    "deep-list": hostile.PROTO2 + hostile.deep_list(100_000) + b".",
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_pickles_are_refused_in_bounded_time_and_memory(tmp_path: Path, name: str) -> None:
    path = hostile.torch_zip(tmp_path / "crafted.pt", CRAFTED[name])
    line = refused("inspect", path, codes=(4,))
    assert "crafted.pt: " in line
