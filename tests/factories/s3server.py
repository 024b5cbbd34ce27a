"""A real S3-compatible server on 127.0.0.1 (moto's server mode) in its own process, and checkpoints uploaded to it.

The suite starts and stops it itself; optim-repair reaches it through the unmodified boto3 client over HTTP,
with the endpoint given as users give theirs (``AWS_ENDPOINT_URL``). Requests are counted at the client, by its
own event hooks (optim-repair's report), and independently at the server, by the lines of its request log.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|PUT|POST|DELETE|HEAD) (\S+) HTTP/')
"""A request line of the server's log (a partial answer's is coloured)."""
PREFIX = "run/step-2/"
"""Where the tests' checkpoints are uploaded."""
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class Server:
    endpoint: str
    process: subprocess.Popen[bytes]
    log: Path
    """The server's request log: one line a request it answered."""

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint, **_keys())

    def requests(self, bucket: str) -> list[str]:
        """The requests the server has answered about ``bucket``, as ``METHOD /path`` (oldest first), once its log
        has stopped growing (it writes each line as the answer leaves)."""
        text = ""
        while text != (text := self.log.read_text(errors="replace")):
            time.sleep(0.3)
        lines = _REQUEST.finditer(text)
        return [f"{line[1]} {line[2]}" for line in lines if line[2].startswith(f"/{bucket}")]


def _keys() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def start(log: Path, *, checked_after: int | None = None) -> Server:
    """Start a server; with ``checked_after``, every request past that many is checked against IAM (moto's
    ``INITIAL_NO_AUTH_ACTION_COUNT``), so that the keys of a user without a policy are denied."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with log.open("wb") as written:
        checked = {} if checked_after is None else {"INITIAL_NO_AUTH_ACTION_COUNT": str(checked_after)}
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=written, stderr=written, env={**os.environ, **checked},
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("moto's server did not start") from None
            time.sleep(0.05)
    return Server(f"http://127.0.0.1:{port}", process, log)


def stop(server: Server) -> None:
    server.process.terminate()
    server.process.wait(timeout=10)


def iam_user_keys(server: Server) -> dict[str, str]:
    """The access keys of a new IAM user with no policy: every request made with them is denied."""
    iam = boto3.client("iam", endpoint_url=server.endpoint, **_keys())
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


def new_bucket(server: Server) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=name)
    return name


def upload(server: Server, directory: Path, bucket: str, prefix: str) -> None:
    """Every file under ``directory`` as an object under ``prefix``, as ``aws s3 cp --recursive`` puts them (with
    a CRC32, as current clients compute by default)."""
    client = server.client()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            key = f"{prefix}{path.relative_to(directory).as_posix()}"
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes(), ChecksumAlgorithm="CRC32")


def download(server: Server, bucket: str, prefix: str, directory: Path) -> Path:
    """Every object under ``prefix`` into ``directory``, to load with torch's own readers."""
    client = server.client()
    for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", ()):
        target = directory / item["Key"][len(prefix) :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read())
    return directory


def keys(server: Server, bucket: str, prefix: str = "") -> set[str]:
    listed = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", ())
    return {item["Key"][len(prefix) :] for item in listed}


def environment(server: Server) -> Iterator[None]:
    """The variables a user sets for an S3-compatible store: its endpoint and the credentials."""
    saved = {name: os.environ.get(name) for name in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=server.endpoint)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
