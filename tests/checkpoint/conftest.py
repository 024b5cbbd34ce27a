"""Fixtures of the ``s3://`` tests: a two-rank FSDP checkpoint uploaded to the real S3-compatible server
(``server`` and ``environment`` in ``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import dcp as dk
from tests.factories import s3server
from tests.factories.built import Built
from tests.factories.s3server import PREFIX


@pytest.fixture
def stored(server: s3server.Server, tmp_path: Path) -> tuple[str, Built]:
    """A two-rank FSDP checkpoint, as ``dcp.save`` wrote it, uploaded under ``PREFIX`` of a new bucket."""
    built = dk.sharded_dcp(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, PREFIX)
    return bucket, built
