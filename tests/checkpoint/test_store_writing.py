"""Repairing ``s3://`` checkpoints on a real S3-compatible server on 127.0.0.1 by server-side copies: each result
loaded by torch's own ``dcp.load`` and resumed bit-identically, interruptions never left loadable."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from optim_repair import api
from optim_repair.errors import ObjectExists, OutputError, UsageError
from optim_repair.formats.dcp import METADATA_FILE
from optim_repair.render import fix_document, inspect_document
from optim_repair.storage import claim
from optim_repair.storage.s3 import S3Store, store
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import s3server, trainers
from tests.factories.built import Built
from tests.factories.s3server import PREFIX

pytestmark = pytest.mark.usefixtures("environment")


def _shards(built: Built) -> list[Path]:
    return sorted(built.path.glob("*.distcp"))


def test_fix_copies_inside_the_store_and_the_copy_resumes_bit_identically(
    server: s3server.Server, stored: tuple[str, Built], tmp_path: Path
) -> None:
    bucket, built = stored
    before = {path.name: path.read_bytes() for path in built.path.iterdir()}
    result = api.fix(f"s3://{bucket}/{PREFIX}", f"s3://{bucket}/fixed/")
    traffic = result.traffic
    assert traffic is not None
    shards = _shards(built)
    assert traffic.copied == sum(path.stat().st_size for path in built.path.iterdir() if path.name != METADATA_FILE)
    metadata = (built.path / METADATA_FILE).stat().st_size
    assert traffic.read <= metadata + 64 * 1024  # no shard's bytes pass through the client
    assert traffic.read < metadata + min(path.stat().st_size for path in shards)
    assert result.verification.proof == "S3 CRC32" and result.verification.tensors > 0
    assert fix_document(result)["verification"]["proof"] == "verified by S3 CRC32, not read back"

    copied = s3server.keys(server, bucket, "fixed/")
    assert copied == set(before) | {"__optim_repair_0.distcp"}  # no marker left
    assert s3server.keys(server, bucket, PREFIX) == set(before)
    local = s3server.download(server, bucket, "fixed/", tmp_path / "fixed")
    assert all(local.joinpath(name).read_bytes() == data for name, data in before.items() if name != METADATA_FILE)
    resumed = dk.resume(local, "adamw", "optim", False)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    assert api.inspect(f"s3://{bucket}/fixed/").verdict == "healthy"


def test_read_back_compares_every_copied_byte(stored: tuple[str, Built]) -> None:
    bucket, built = stored
    result = api.fix(f"s3://{bucket}/{PREFIX}", f"s3://{bucket}/fixed/", verify="download")
    assert result.verification.proof == "read back"
    assert result.traffic is not None
    assert result.traffic.read >= 2 * sum(path.stat().st_size for path in _shards(built))


def test_reading_back_is_for_copies_made_inside_a_store(stored: tuple[str, Built], tmp_path: Path) -> None:
    bucket, built = stored
    with pytest.raises(UsageError, match=r"^verify is for copies made inside a store"):
        api.fix(f"s3://{bucket}/{PREFIX}", tmp_path / "local", verify="download")
    result = run_cli(["fix", built.path, "--out", tmp_path / "copy", "--verify", "download"], code=2)
    assert "--verify is for copies made inside a store" in result.stderr
    assert not (tmp_path / "local").exists() and not (tmp_path / "copy").exists()


def test_the_cli_reports_requests_and_bytes(stored: tuple[str, Built]) -> None:
    bucket, _ = stored
    inspected = json.loads(run_cli(["inspect", f"s3://{bucket}/{PREFIX}", "--json"], code=1).stdout)
    assert inspected["remote"]["requests"] == 3 and inspected["remote"]["bytes_copied"] == 0
    text = run_cli(["fix", f"s3://{bucket}/{PREFIX}", "--out", f"s3://{bucket}/fixed/"]).stdout
    assert "verified by S3 CRC32, not read back" in text and "copied inside the store" in text


def test_a_prefix_that_holds_objects_is_refused_unless_forced(
    server: s3server.Server, stored: tuple[str, Built]
) -> None:
    bucket, built = stored
    server.client().put_object(Bucket=bucket, Key="fixed/notes.txt", Body=b"keep me")
    with pytest.raises(OutputError, match="already holds objects; pass force=True to replace them"):
        api.fix(f"s3://{bucket}/{PREFIX}", f"s3://{bucket}/fixed/")
    assert s3server.keys(server, bucket, "fixed/") == {"notes.txt"}
    with pytest.raises(OutputError, match=r"holds 1 object the copy would not write \(notes.txt\): it is no earlier"):
        api.fix(f"s3://{bucket}/{PREFIX}", f"s3://{bucket}/fixed/", force=True)  # as on a disk: not a copy's
    assert s3server.keys(server, bucket, "fixed/") == {"notes.txt"}
    api.fix(f"s3://{bucket}/{PREFIX}", f"s3://{bucket}/earlier/")
    api.fix(f"s3://{bucket}/{PREFIX}", f"s3://{bucket}/earlier/", force=True)  # an earlier copy is replaced
    assert s3server.keys(server, bucket, "earlier/") == {path.name for path in built.path.iterdir()} | {
        "__optim_repair_0.distcp"
    }


def test_the_copy_is_refused_over_or_inside_the_checkpoint(server: s3server.Server, stored: tuple[str, Built]) -> None:
    bucket, built = stored
    for out in ("run/", PREFIX, f"{PREFIX}fixed/", ""):
        with pytest.raises(UsageError, match="holds the checkpoint or lies inside it"):
            api.fix(f"s3://{bucket}/{PREFIX}", f"s3://{bucket}/{out}", force=True)
    assert s3server.keys(server, bucket, PREFIX) == {path.name for path in built.path.iterdir()}


def _loadable(local: Path) -> bool:
    """Whether torch's own ``dcp.load`` accepts ``local`` as a whole checkpoint."""
    try:
        dk.resume(local, "adamw", "optim", False, steps=0)
    except CheckpointException:  # a BaseException: what dcp.load raises for a checkpoint it cannot load
        return False
    return True


def test_a_killed_fix_never_leaves_a_loadable_prefix_and_the_next_run_cleans_up(
    server: s3server.Server, stored: tuple[str, Built], tmp_path: Path
) -> None:
    bucket, _ = stored
    command = [sys.executable, "-m", "optim_repair", "fix", f"s3://{bucket}/{PREFIX}", "--out"]
    environment = {**os.environ, claim.LEASE_VARIABLE: "1"}  # a killed run's claim lapses after a second
    started = time.monotonic()
    subprocess.run([*command, f"s3://{bucket}/timed/"], check=True, capture_output=True, env=environment)
    whole = time.monotonic() - started
    chance = random.Random(19)
    for trial in range(20):
        out = f"killed-{trial}/"
        running = subprocess.Popen(
            [*command, f"s3://{bucket}/{out}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment
        )
        time.sleep(chance.uniform(0.2, whole))
        running.send_signal(signal.SIGKILL if trial % 2 else signal.SIGTERM)
        running.wait()
        left = s3server.keys(server, bucket, out)
        if METADATA_FILE in left:  # it got as far as its commit: the copy is whole
            assert _loadable(s3server.download(server, bucket, out, tmp_path / f"whole-{trial}"))
            continue
        if left:
            assert not _loadable(s3server.download(server, bucket, out, tmp_path / f"left-{trial}"))
            assert running.returncode == -signal.SIGKILL, left  # a SIGTERM deletes what it wrote
            assert claim.MARKER in left
            time.sleep(2.1)  # its lease lapses
        again = subprocess.run([*command, f"s3://{bucket}/{out}"], capture_output=True, text=True, env=environment)
        assert again.returncode == 0, again.stderr
        assert ("a stopped run left" in again.stderr) == bool(left)
        assert _loadable(s3server.download(server, bucket, out, tmp_path / f"again-{trial}"))


def test_a_remote_checkpoint_is_repaired_into_a_local_copy(
    server: s3server.Server, stored: tuple[str, Built], tmp_path: Path
) -> None:
    bucket, built = stored
    out = tmp_path / "fixed"
    result = api.fix(f"s3://{bucket}/{PREFIX}", out)
    assert result.out == out and result.verification.proof is None and result.verification.tensors > 0
    assert result.traffic is not None and result.traffic.read >= sum(p.stat().st_size for p in built.path.iterdir())
    assert {path.name for path in tmp_path.iterdir()} == {"in", "fixed"}  # the download is gone
    resumed = dk.resume(out, "adamw", "optim", False)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    with pytest.raises(OutputError, match="already exists"):
        api.fix(f"s3://{bucket}/{PREFIX}", out)


def test_a_local_checkpoint_is_repaired_into_a_store(
    server: s3server.Server, stored: tuple[str, Built], tmp_path: Path
) -> None:
    bucket, built = stored
    result = api.fix(built.path, f"s3://{bucket}/uploaded/")
    assert result.verification.proof == "uploaded, checked by S3 CRC32"
    assert fix_document(result)["verification"]["proof"].endswith("each object checked by S3 CRC32 on receipt")
    assert result.traffic is not None and result.traffic.read == 0 and result.traffic.copied == 0
    names = {path.name for path in built.path.iterdir()}
    assert server.requests(bucket)[-3:] == [
        f"PUT /{bucket}/uploaded/{claim.MARKER}",  # the claim renewed
        f"PUT /{bucket}/uploaded/{METADATA_FILE}",  # then the commit, after every shard
        f"DELETE /{bucket}/uploaded/{claim.MARKER}",  # then the marker is deleted
    ]
    assert s3server.keys(server, bucket, "uploaded/") == names | {"__optim_repair_0.distcp"}
    assert {path.name for path in built.path.parent.iterdir()} == {built.path.name}  # the staged copy is gone
    local = s3server.download(server, bucket, "uploaded/", tmp_path / "back")
    resumed = dk.resume(local, "adamw", "optim", False)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def test_a_torch_file_is_repaired_from_a_store_and_into_one(server: s3server.Server, tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in", steps=2)
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, PREFIX)
    (tmp_path / "out").mkdir()
    local = api.fix(f"s3://{bucket}/{PREFIX}optimizer.pt", f"{tmp_path}/out/")
    assert local.out == tmp_path / "out" / "optimizer.pt"
    uploaded = api.fix(built.path / "optimizer.pt", f"s3://{bucket}/fixed/")
    assert uploaded.out == f"s3://{bucket}/fixed/optimizer.pt"
    back = s3server.download(server, bucket, "fixed/", tmp_path / "back") / "optimizer.pt"
    assert back.read_bytes() == Path(local.out).read_bytes()
    with pytest.raises(OutputError, match="already exists"):
        api.fix(built.path / "optimizer.pt", f"s3://{bucket}/fixed/optimizer.pt")


def test_large_objects_are_copied_and_uploaded_in_parts(
    server: s3server.Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects over S3's single-request limits (5 GiB) go in parts; the limits are lowered here to 5 MiB, S3's
    smallest part, so that a 12 MiB shard takes three."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(1800, 1800), "unused": torch.nn.Linear(4, 4)})
    for name, value in (("COPY_LIMIT", 5 << 20), ("COPY_PART", 5 << 20), ("PUT_LIMIT", 5 << 20), ("PUT_PART", 5 << 20)):
        monkeypatch.setattr(store, name, value)
    optimizer = torch.optim.AdamW(model.parameters())
    model["used"](torch.randn(2, 1800)).sum().backward()
    optimizer.step()
    path = tmp_path / "in"
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    bucket = s3server.new_bucket(server)
    s3server.upload(server, path, bucket, "large/")
    copied = api.fix(f"s3://{bucket}/large/", f"s3://{bucket}/copied/")
    assert copied.verification.proof == "S3 CRC32" and copied.plan.additions
    uploaded = api.fix(path, f"s3://{bucket}/uploaded/")
    for prefix in ("copied/", "uploaded/"):
        back = s3server.download(server, bucket, prefix, tmp_path / prefix)
        assert all(
            back.joinpath(p.name).read_bytes() == p.read_bytes() for p in path.iterdir() if p.suffix == ".distcp"
        )
    assert any(
        request.startswith(f"PUT /{bucket}/copied/") and "partNumber=3" in request
        for request in server.requests(bucket)
    )
    assert uploaded.verification.tensors == copied.verification.tensors


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_a_stopped_copy_between_a_store_and_a_disk_leaves_nothing_loadable(
    server: s3server.Server, stored: tuple[str, Built], tmp_path: Path, direction: str
) -> None:
    bucket, built = stored
    chance = random.Random(direction)
    environment = {**os.environ, claim.LEASE_VARIABLE: "1"}  # a killed run's claim lapses after a second
    for trial in range(6):
        if direction == "upload":
            source, out = str(built.path), f"s3://{bucket}/up-{trial}/"
        else:
            source, out = f"s3://{bucket}/{PREFIX}", str(tmp_path / f"down-{trial}")
        command = [sys.executable, "-m", "optim_repair", "fix", source, "--out", out]
        running = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment)
        time.sleep(chance.uniform(0.3, 2.0))
        running.send_signal(signal.SIGKILL if trial % 2 else signal.SIGTERM)
        running.wait()
        if direction == "upload":
            left = s3server.keys(server, bucket, f"up-{trial}/")
            whole = METADATA_FILE in left
            if left and not whole:
                assert not _loadable(s3server.download(server, bucket, f"up-{trial}/", tmp_path / f"left-{trial}"))
        else:
            whole = Path(out).exists()
            if whole:
                assert _loadable(Path(out))
        if running.returncode == -signal.SIGTERM or running.returncode == 128 + signal.SIGTERM:
            beside = built.path.parent if direction == "upload" else tmp_path
            name = built.path.name if direction == "upload" else f"down-{trial}"
            assert not [path for path in beside.iterdir() if f"{name}.optim-repair-tmp-" in path.name]  # none left
        if not whole:
            time.sleep(2.1)  # the claim of a killed run lapses
            again = subprocess.run(command, capture_output=True, text=True, env=environment)
            assert again.returncode == 0, again.stderr


def test_a_trainer_directory_is_repaired_inside_the_store(server: s3server.Server, tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, PREFIX)
    result = api.fix(f"s3://{bucket}/{PREFIX}", f"s3://{bucket}/fixed/", fill="empty")
    assert result.verification.proof == "S3 CRC32" and result.plan.additions
    names = {path.name for path in built.path.iterdir()}
    assert s3server.keys(server, bucket, "fixed/") == names  # no marker left, no file missing
    back = s3server.download(server, bucket, "fixed/", tmp_path / "back")
    local = api.fix(built.path, tmp_path / "local", fill="empty")
    assert all(
        back.joinpath(name).read_bytes() == built.path.joinpath(name).read_bytes() for name in names - {"optimizer.pt"}
    )
    assert inspect_document(api.inspect(back))["optimizers"] == inspect_document(api.inspect(local.out))["optimizers"]
    resumed, expected = (torch.load(root / "optimizer.pt", weights_only=True) for root in (back, Path(local.out)))
    assert resumed["param_groups"] == expected["param_groups"] and resumed["state"].keys() == expected["state"].keys()


def test_a_torch_file_is_spliced_inside_the_store_and_resumes(server: s3server.Server, tmp_path: Path) -> None:
    """The new pickle is uploaded, every other record copied by the store: an 18 MiB file moves less than
    twice 5 MiB and its pickle each way, and torch.load of the copy resumes exactly as the local repair does."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(1500, 1500), "unused": torch.nn.Linear(8, 8)})
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model["used"](torch.randn(2, 1500)).sum().backward()
        optimizer.step()
    path = tmp_path / "in" / "optimizer.pt"
    path.parent.mkdir()
    torch.save(optimizer.state_dict(), path)
    bucket = s3server.new_bucket(server)
    s3server.upload(server, path.parent, bucket, "run/")
    result = api.fix(f"s3://{bucket}/run/optimizer.pt", f"s3://{bucket}/fixed/", fill="empty")
    assert result.out == f"s3://{bucket}/fixed/" and result.verification.proof == "S3 CRC32"
    with zipfile.ZipFile(path) as archive:
        pickle_size = archive.getinfo("optimizer/data.pkl").file_size
    traffic = result.traffic
    assert traffic is not None
    assert traffic.written < 2 * ((5 << 20) + pickle_size) and traffic.read < 2 * ((5 << 20) + pickle_size)
    assert traffic.copied > path.stat().st_size - (6 << 20)  # the rest never passed through the client
    spliced = s3server.download(server, bucket, "fixed/", tmp_path / "spliced") / "optimizer.pt"
    local = api.fix(path, tmp_path / "local.pt", fill="empty")
    assert api.inspect(spliced).verdict == api.inspect(local.out).verdict == "healthy"
    resumed = torch.load(spliced, weights_only=True)
    expected = torch.load(local.out, weights_only=True)
    assert resumed["param_groups"] == expected["param_groups"]
    assert resumed["state"].keys() == expected["state"].keys()
    for param, state in expected["state"].items():
        assert state.keys() == resumed["state"][param].keys()
        assert all(torch.equal(state[key], resumed["state"][param][key]) for key in state)
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(resumed)  # the loader HF Trainer resumes through


def test_the_unfinished_upload_of_a_killed_run_is_aborted_by_the_next(
    server: s3server.Server, stored: tuple[str, Built], tmp_path: Path
) -> None:
    """What SIGKILL leaves in the middle of a multipart upload (an upload begun, a part sent, never completed):
    invisible to a listing, billed until aborted."""
    bucket, _ = stored
    client = server.client()
    for key in ("fixed/__0_0.distcp", "single/optimizer.pt"):
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"half")
    notices: list[str] = []
    api.fix(f"s3://{bucket}/{PREFIX}", f"s3://{bucket}/fixed/", notice=notices.append)
    assert notices == [f"aborted 1 unfinished upload a stopped run left at s3://{bucket}/fixed/"]
    trainer = trainers.hf_trainer(tmp_path / "in")
    api.fix(trainer.path / "optimizer.pt", f"s3://{bucket}/single/optimizer.pt", notice=notices.append)
    assert notices[-1] == f"aborted 1 unfinished upload a stopped run left at s3://{bucket}/single/optimizer.pt"
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_write_that_finds_an_object_there_is_exit_5_and_deletes_nothing(
    server: s3server.Server, stored: tuple[str, Built], tmp_path: Path
) -> None:
    bucket, built = stored
    opened = S3Store(bucket)
    with pytest.raises(ObjectExists, match="exists: another writer put an object there first") as raised:
        metadata = built.path / METADATA_FILE
        opened.put_file(f"{PREFIX}{METADATA_FILE}", metadata, metadata.stat().st_size)
    assert raised.value.exit_code == 5 and raised.value.code == "exists"
    assert s3server.keys(server, bucket, PREFIX) == {path.name for path in built.path.iterdir()}
