"""Fixtures of the store tests: a two-rank FSDP checkpoint uploaded to the real S3-compatible server (``server``
and ``environment`` in ``tests/conftest.py``), and the GCS emulator and the Azure Blob emulator (Azurite) with one
uploaded to each; another origin, where a faulty store's redirect points."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.factories import azurite, faulty_store, gcsserver, s3server
from tests.factories import dcp as dk
from tests.factories.built import Built
from tests.factories.s3server import PREFIX


@pytest.fixture
def stored(server: s3server.Server, tmp_path: Path) -> tuple[str, Built]:
    """A two-rank FSDP checkpoint, as ``dcp.save`` wrote it, uploaded under ``PREFIX`` of a new bucket."""
    built = dk.sharded_dcp(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, PREFIX)
    return bucket, built


@pytest.fixture(scope="module")
def gcs() -> Iterator[gcsserver.Server]:
    """A real GCS emulator (fake-gcs-server) on 127.0.0.1 for each module that asks for one."""
    started = gcsserver.start()
    yield started
    gcsserver.stop(started)


@pytest.fixture
def gcs_environment(gcs: gcsserver.Server) -> Iterator[None]:
    """What a user sets for that emulator (``STORAGE_EMULATOR_HOST``)."""
    yield from gcsserver.environment(gcs)


@pytest.fixture
def gcs_stored(gcs: gcsserver.Server, tmp_path: Path) -> tuple[str, Built]:
    """A two-rank FSDP checkpoint, as ``dcp.save`` wrote it, uploaded under ``PREFIX`` of a new bucket."""
    built = dk.sharded_dcp(tmp_path / "in")
    bucket = gcsserver.new_bucket(gcs)
    gcsserver.upload(gcs, built.path, bucket, PREFIX)
    return bucket, built


@pytest.fixture(scope="module")
def azure() -> Iterator[azurite.Server]:
    """A real Azure Blob emulator (Azurite) on 127.0.0.1 for each module that asks for one."""
    started = azurite.start()
    yield started
    azurite.stop(started)


@pytest.fixture
def azure_environment(azure: azurite.Server) -> Iterator[None]:
    """What a user sets for that emulator (``AZURE_STORAGE_CONNECTION_STRING``)."""
    yield from azurite.environment(azure)


@pytest.fixture
def azure_stored(azure: azurite.Server, tmp_path: Path) -> tuple[str, Built]:
    """A two-rank FSDP checkpoint, as ``dcp.save`` wrote it, uploaded under ``PREFIX`` of a new container."""
    built = dk.sharded_dcp(tmp_path / "in")
    container = azurite.new_container(azure)
    azurite.upload(azure, built.path, container, PREFIX)
    return container, built


@pytest.fixture(scope="module")
def elsewhere() -> Iterator[faulty_store.Elsewhere]:
    """Another origin on 127.0.0.1 (``faulty_store.Elsewhere``), recording every request that reaches it."""
    started = faulty_store.elsewhere()
    yield started
    faulty_store.stop(started)
