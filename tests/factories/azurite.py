"""A real Azure Blob Storage emulator on 127.0.0.1 (Azurite's ``azurite-blob``) in its own process, and checkpoints
uploaded to it.

The suite starts and stops it itself, in memory, on a free port. optim-repair reaches it as users reach an
emulator, through ``AZURE_STORAGE_CONNECTION_STRING`` naming the emulator's well-known account
(``devstoreaccount1``) and its key; the tests put and read blobs with the same azure-storage-blob SDK users upload
with. Azurite is a Node package, not a wheel: the README's test command installs it under ``.azurite/``
(``npm install --prefix .azurite azurite@3``); one on ``PATH`` is used otherwise.

The emulator differs from the service in ways no test here depends on: it completes an asynchronous Copy Blob at
once (``x-ms-copy-status: success`` in the answer, never ``pending``), puts no size limit on a synchronous copy
(the service's Copy Blob From URL stops at 256 MiB), and does not implement Put Block From URL nor Put Blob From
URL: both answer 501 ``APINotImplemented`` (``BlockBlobHandler.stageBlockFromURL`` and ``putBlobFromUrl`` throw
``NotImplementedError``), or 500 with an empty body when an account SAS authorizes them (its SAS permission table
has no entry for either).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests
from azure.storage.blob import BlobServiceClient

PREFIX = "run/step-2/"
"""Where the tests' checkpoints are uploaded."""
ACCOUNT = "devstoreaccount1"
"""The emulator's one account."""
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Its well-known key (published in Azurite's and Azure's documentation)."""
INSTALL = "npm install --prefix .azurite azurite@3"
"""How the README installs the emulator, from the repository's root."""


@dataclass(frozen=True)
class Server:
    endpoint: str
    """The account's blob endpoint, ``http://127.0.0.1:PORT/devstoreaccount1``."""
    process: subprocess.Popen[bytes]


def _binary() -> Path:
    local = Path(__file__).resolve().parents[2] / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return local
    found = shutil.which("azurite-blob")
    if found is None:
        raise RuntimeError(f"Azurite is not installed: run `{INSTALL}` in the repository's root (needs Node.js)")
    return Path(found)


def start() -> Server:
    """Start an emulator that keeps its blobs in memory, accepting every API version the SDK may send."""
    binary = _binary()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
    process = subprocess.Popen(
        [str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
         "--disableTelemetry", "--skipApiVersionCheck", "--loose", "--silent"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            # Any answer will do: an unsigned request is refused (403) once the emulator listens.
            requests.get(endpoint, params={"comp": "list"}, timeout=1)
            break
        except requests.RequestException:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError("Azurite did not start")
        time.sleep(0.05)
    return Server(endpoint, process)


def stop(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def connection_string(server: Server) -> str:
    """The connection string a user copies for the emulator."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};BlobEndpoint={server.endpoint};"
    )


def client(server: Server) -> BlobServiceClient:
    return BlobServiceClient.from_connection_string(connection_string(server))


def new_container(server: Server) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    client(server).create_container(name)
    return name


def put(server: Server, container: str, key: str, data: bytes) -> None:
    """``data`` as the blob ``key``, as ``az storage blob upload`` puts one."""
    client(server).get_container_client(container).upload_blob(key, data, overwrite=True)


def upload(server: Server, local_path: Path, container: str, prefix: str) -> None:
    """The file ``local_path``, or every file under the directory ``local_path``, as a blob under ``prefix`` (named
    by its path relative to the directory), as a user's ``ContainerClient.upload_blob`` puts them."""
    blobs = client(server).get_container_client(container)
    if local_path.is_file():
        files = [(local_path.name, local_path)]
    else:
        files = [(path.relative_to(local_path).as_posix(), path) for path in sorted(local_path.rglob("*"))]
    for name, path in files:
        if path.is_file():
            with path.open("rb") as data:
                blobs.upload_blob(f"{prefix}{name}", data, overwrite=True)


def get(server: Server, container: str, key: str) -> bytes:
    data: bytes = client(server).get_blob_client(container, key).download_blob().readall()
    return data


def names(server: Server, container: str, prefix: str = "") -> list[str]:
    """The names of the blobs under ``prefix``, in the service's order."""
    listed = client(server).get_container_client(container).list_blob_names(name_starts_with=prefix)
    return [str(name) for name in listed]


def environment(server: Server) -> Iterator[None]:
    """What a user sets for the emulator: ``AZURE_STORAGE_CONNECTION_STRING`` (and no other account)."""
    variables = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT")
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.pop("AZURE_STORAGE_ACCOUNT", None)
    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(server)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def keys(server: Server, container: str, prefix: str = "") -> set[str]:
    """The names of the blobs under ``prefix``, relative to it."""
    return {name[len(prefix) :] for name in names(server, container, prefix)}


def download(server: Server, container: str, prefix: str, directory: Path) -> Path:
    """Every blob under ``prefix`` into ``directory``, to load with torch's own readers."""
    for name in names(server, container, prefix):
        target = directory / name[len(prefix) :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(get(server, container, name))
    return directory
