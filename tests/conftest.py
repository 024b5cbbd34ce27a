"""Shared fixtures: real checkpoints from ``tests.factories`` and a CLI runner."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tests import factories
from tests.factories import defects, hostile, models, s3server, trainers
from tests.factories.built import Built

CLI_ENV: Mapping[str, str] = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
"""Environment for ``run_cli``: wide, uncoloured output so messages are not wrapped."""


def describe(result: Result) -> str:
    """A CLI result for a failure message: exit code, stdout, stderr, traceback."""
    parts = [
        f"exit code {result.exit_code}",
        f"--- stdout ---\n{result.stdout}",
        f"--- stderr ---\n{result.stderr}",
    ]
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        parts.append("--- exception ---\n" + "".join(traceback.format_exception(*result.exc_info)))
    return "\n".join(parts)


def run_cli(
    args: Sequence[str | os.PathLike[str]],
    *,
    code: int | None = 0,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Result:
    """Invoke ``optim_repair.cli.app`` in-process; assert the exit code unless ``code`` is None.

    stdout and stderr stay separate (``result.stdout`` / ``result.stderr``).
    """
    from optim_repair.cli import app

    result = CliRunner().invoke(app, [os.fspath(arg) for arg in args], input=input, env={**CLI_ENV, **(env or {})})
    if code is not None and result.exit_code != code:
        report = describe(result)
        print(report)
        raise AssertionError(f"expected exit code {code}\n{report}")
    return result


@pytest.fixture
def cli() -> Callable[..., Result]:
    """``run_cli`` as a fixture."""
    return run_cli


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Where factories write: a fresh directory under ``tmp_path``."""
    path = tmp_path / "ckpt"
    path.mkdir()
    return path


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """A file the unsafe pickles would create if they were ever unpickled."""
    return tmp_path / "marker-pwned"


@pytest.fixture(params=sorted(factories.FACTORIES))
def any_checkpoint(request: pytest.FixtureRequest, root: Path) -> Built:
    """Every safe factory in turn."""
    name: str = request.param
    return factories.FACTORIES[name](root)


@pytest.fixture(params=sorted(defects.MALFORMED))
def malformed_checkpoint(request: pytest.FixtureRequest, root: Path) -> Built:
    """Every malformed variant in turn."""
    name: str = request.param
    return defects.MALFORMED[name](root)


@pytest.fixture(params=models.OPTIMIZER_NAMES)
def optimizer_name(request: pytest.FixtureRequest) -> str:
    """Every optimizer name ``make_optimizer`` accepts."""
    name: str = request.param
    return name


@pytest.fixture
def unirl_checkpoint(root: Path) -> Built:
    return trainers.unirl_torch(root)


@pytest.fixture
def petrainer_checkpoint(root: Path) -> Built:
    return trainers.petrainer(root)


@pytest.fixture
def hf_checkpoint(root: Path) -> Built:
    return trainers.hf_trainer(root)


@pytest.fixture
def accelerate_checkpoint(root: Path) -> Built:
    return trainers.accelerate(root)


@pytest.fixture
def lightning_checkpoint(root: Path) -> Built:
    return trainers.lightning(root)


@pytest.fixture
def multi_optimizer_checkpoint(root: Path) -> Built:
    return trainers.multi_optimizer(root)


@pytest.fixture
def legacy_checkpoint(root: Path) -> Built:
    return trainers.legacy_format(root)


@pytest.fixture
def bug_report_checkpoint(root: Path) -> Built:
    return trainers.bug_report(root)


@pytest.fixture
def healthy_checkpoint(root: Path) -> Built:
    return defects.healthy(root)


@pytest.fixture
def cold_checkpoint(root: Path) -> Built:
    return defects.cold(root)


@pytest.fixture
def phantom_checkpoint(root: Path) -> Built:
    return defects.phantom_step(root)


@pytest.fixture
def empty_entries_checkpoint(root: Path) -> Built:
    return defects.empty_entries(root)


@pytest.fixture
def tricky_checkpoint(root: Path) -> Built:
    return defects.tricky_tensors(root)


@pytest.fixture
def unsafe_checkpoint(root: Path, marker: Path) -> Built:
    return hostile.unsafe_pickle(root, marker)


@pytest.fixture
def unsafe_legacy_checkpoint(root: Path, marker: Path) -> Built:
    return hostile.unsafe_legacy_pickle(root, marker)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3server.Server]:
    """A real S3-compatible server (moto's server mode) on 127.0.0.1 for each module that asks for one."""
    started = s3server.start(tmp_path_factory.mktemp("s3") / "requests.log")
    yield started
    s3server.stop(started)


@pytest.fixture
def environment(server: s3server.Server) -> Iterator[None]:
    """The variables a user sets for that server: its endpoint and the credentials."""
    yield from s3server.environment(server)
