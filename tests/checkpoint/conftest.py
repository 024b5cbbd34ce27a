"""Fixtures of the ``s3://`` tests: a real S3-compatible server on 127.0.0.1 for each module that asks for one, the
variables a user sets for it, and a two-rank FSDP checkpoint uploaded to it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import dcp as dk
from tests.factories import s3server
from tests.factories.built import Built
from tests.factories.s3server import PREFIX


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3server.Server]:
    started = s3server.start(tmp_path_factory.mktemp("s3") / "requests.log")
    yield started
    s3server.stop(started)


@pytest.fixture
def environment(server: s3server.Server) -> Iterator[None]:
    yield from s3server.environment(server)


@pytest.fixture
def stored(server: s3server.Server, tmp_path: Path) -> tuple[str, Built]:
    """A two-rank FSDP checkpoint, as ``dcp.save`` wrote it, uploaded under ``PREFIX`` of a new bucket."""
    built = dk.sharded_dcp(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, PREFIX)
    return bucket, built
