"""``gs://`` checkpoints on a real GCS emulator on 127.0.0.1 (fake-gcs-server), through the gcs extra's client:
the cases that hold for ``s3://`` hold here, each result loaded by torch's own readers and resumed bit-identically,
interruptions never left loadable. No test depends on a check the emulator skips (``tests/factories/gcsserver``)."""

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
from optim_repair.errors import InputError, OutputError, UsageError
from optim_repair.formats.dcp import METADATA_FILE
from optim_repair.render import fix_document
from optim_repair.storage import claim, disk_staging
from optim_repair.storage.gcs import store
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import gcsserver, trainers
from tests.factories.built import Built
from tests.factories.gcsserver import PREFIX

pytestmark = pytest.mark.usefixtures("gcs_environment")


def _shards(built: Built) -> list[Path]:
    return sorted(built.path.glob("*.distcp"))


def test_inspect_reads_the_metadata_and_one_range_a_shard(gcs_stored: tuple[str, Built]) -> None:
    bucket, built = gcs_stored
    diagnosis = api.inspect(f"gs://{bucket}/{PREFIX}")
    traffic = diagnosis.inventory.traffic
    assert traffic is not None and traffic.requests <= 2 + len(_shards(built))
    metadata = (built.path / METADATA_FILE).stat().st_size
    assert metadata < traffic.read <= metadata + 64 * 1024  # never the tensors' bytes
    assert traffic.read < metadata + min(path.stat().st_size for path in _shards(built))
    assert diagnosis.verdict == api.inspect(built.path).verdict == "repairable"


def test_errors_name_the_bucket_and_key(gcs_stored: tuple[str, Built]) -> None:
    bucket, _ = gcs_stored
    with pytest.raises(InputError, match=r"^gs://no-such-bucket-here/x/: no such bucket$"):
        api.inspect("gs://no-such-bucket-here/x/")
    with pytest.raises(InputError, match=rf"^gs://{bucket}/{PREFIX}optimizer.pt: no such object"):
        api.inspect(f"gs://{bucket}/{PREFIX}optimizer.pt")
    result = run_cli(["inspect", "gs://no-such-bucket-here/x/"], code=4)
    assert result.stderr.strip() == "optim-repair: error: gs://no-such-bucket-here/x/: no such bucket"
    with pytest.raises(UsageError, match="--profile names an AWS profile"):
        api.inspect(f"gs://{bucket}/{PREFIX}", profile="default")


def test_without_credentials_the_service_is_not_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No emulator named and no application default credentials: exit 4 before a request; an emulator named by
    STORAGE_EMULATOR_HOST is reached anonymously, as Google's own client reaches it (the other tests)."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud login here
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # nothing listens: no metadata server
    result = run_cli(["inspect", "gs://bucket/run/"], code=4)
    assert "no Google Cloud credentials found" in result.stderr and "Traceback" not in result.stderr


def test_an_empty_torch_file_is_named_empty_as_on_a_disk(gcs: gcsserver.Server) -> None:
    bucket = gcsserver.new_bucket(gcs)
    gcsserver.put(gcs, bucket, f"{PREFIX}optimizer.pt", b"")
    with pytest.raises(InputError, match=rf"^gs://{bucket}/{PREFIX}optimizer.pt: empty file$"):
        api.inspect(f"gs://{bucket}/{PREFIX}optimizer.pt")
    gcsserver.put(gcs, bucket, f"{PREFIX}notes.pt", b"these are notes, not a checkpoint\n")
    result = run_cli(["inspect", f"gs://{bucket}/{PREFIX}notes.pt"], code=4)  # as on a disk: no usage error
    assert "notes.pt: not a torch file (no zip archive, no legacy magic number)" in result.stderr


@pytest.mark.parametrize("out", ["fixed/../elsewhere/", "fixed//inner/", "./fixed/"])
def test_a_key_with_dot_or_empty_segments_is_refused_before_anything_is_read(
    gcs: gcsserver.Server, gcs_stored: tuple[str, Built], out: str
) -> None:
    """A store keeps ``a/../b`` as it is written; this tool refuses to read such a name back (it would lead a
    download outside its directory), so it never writes one."""
    bucket, _ = gcs_stored
    result = run_cli(["fix", f"gs://{bucket}/{PREFIX}", "--out", f"gs://{bucket}/{out}"], code=2)
    assert "names a key with an empty, '.' or '..' segment" in result.stderr
    assert gcsserver.keys(gcs, bucket) == {f"{PREFIX}{name}" for name in gcsserver.keys(gcs, bucket, PREFIX)}


def test_without_the_client_the_error_names_the_extra(gcs_stored: tuple[str, Built]) -> None:
    bucket, _ = gcs_stored
    code = "import sys; sys.modules['google.auth'] = None; from optim_repair.console import main; main()"
    ran = subprocess.run(
        [sys.executable, "-c", code, "inspect", f"gs://{bucket}/{PREFIX}"], capture_output=True, text=True
    )
    assert ran.returncode == 2
    assert "pip install 'optim-repair[gcs]'" in ran.stderr and "Traceback" not in ran.stderr


def test_fix_copies_inside_the_store_and_the_copy_resumes_bit_identically(
    gcs: gcsserver.Server, gcs_stored: tuple[str, Built], tmp_path: Path
) -> None:
    bucket, built = gcs_stored
    before = {path.name: path.read_bytes() for path in built.path.iterdir()}
    other = gcsserver.new_bucket(gcs)
    for out in (f"gs://{bucket}/fixed/", f"gs://{other}/fixed/"):
        result = api.fix(f"gs://{bucket}/{PREFIX}", out)
        traffic = result.traffic
        assert traffic is not None
        assert traffic.copied == sum(path.stat().st_size for path in built.path.iterdir() if path.name != METADATA_FILE)
        metadata = (built.path / METADATA_FILE).stat().st_size
        assert traffic.read <= metadata + 64 * 1024  # no shard's bytes pass through the client
        assert result.verification.proof == "GCS CRC32C" and result.verification.tensors > 0
        assert fix_document(result)["verification"]["proof"] == "verified by GCS CRC32C, not read back"
        written = out.removeprefix("gs://").split("/")[0]
        assert gcsserver.keys(gcs, written, "fixed/") == set(before) | {"__optim_repair_0.distcp"}  # no marker left
        local = gcsserver.download(gcs, written, "fixed/", tmp_path / written)
        assert all(local.joinpath(name).read_bytes() == data for name, data in before.items() if name != METADATA_FILE)
        resumed = dk.resume(local, "adamw", "optim", False)
        reference = dk.uninterrupted("adamw")
        assert all(torch.equal(resumed[name], reference[name]) for name in reference)
        assert api.inspect(out).verdict == "healthy"
    assert gcsserver.keys(gcs, bucket, PREFIX) == set(before)


def test_read_back_compares_every_copied_byte(gcs_stored: tuple[str, Built]) -> None:
    bucket, built = gcs_stored
    result = api.fix(f"gs://{bucket}/{PREFIX}", f"gs://{bucket}/fixed/", verify="download")
    assert result.verification.proof == "read back"
    assert result.traffic is not None
    assert result.traffic.read >= 2 * sum(path.stat().st_size for path in _shards(built))


def test_a_prefix_that_holds_objects_is_refused_unless_forced(
    gcs: gcsserver.Server, gcs_stored: tuple[str, Built]
) -> None:
    bucket, built = gcs_stored
    gcsserver.put(gcs, bucket, "fixed/notes.txt", b"keep me")
    with pytest.raises(OutputError, match="already holds objects; pass force=True to replace them"):
        api.fix(f"gs://{bucket}/{PREFIX}", f"gs://{bucket}/fixed/")
    assert gcsserver.keys(gcs, bucket, "fixed/") == {"notes.txt"}
    with pytest.raises(OutputError, match=r"holds 1 object the copy would not write \(notes.txt\): it is no earlier"):
        api.fix(f"gs://{bucket}/{PREFIX}", f"gs://{bucket}/fixed/", force=True)  # as on a disk: not a copy's
    assert gcsserver.keys(gcs, bucket, "fixed/") == {"notes.txt"}
    api.fix(f"gs://{bucket}/{PREFIX}", f"gs://{bucket}/earlier/")
    api.fix(f"gs://{bucket}/{PREFIX}", f"gs://{bucket}/earlier/", force=True)  # an earlier copy is replaced
    assert gcsserver.keys(gcs, bucket, "earlier/") == {path.name for path in built.path.iterdir()} | {
        "__optim_repair_0.distcp"
    }
    for out in ("run/", PREFIX, f"{PREFIX}fixed/"):
        with pytest.raises(UsageError, match="holds the checkpoint or lies inside it"):
            api.fix(f"gs://{bucket}/{PREFIX}", f"gs://{bucket}/{out}", force=True)
    assert gcsserver.keys(gcs, bucket, PREFIX) == {path.name for path in built.path.iterdir()}


def _trained_file(tmp_path: Path) -> tuple[torch.nn.ModuleDict, Path]:
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(1500, 1500), "unused": torch.nn.Linear(8, 8)})
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model["used"](torch.randn(2, 1500)).sum().backward()
        optimizer.step()
    path = tmp_path / "in" / "optimizer.pt"
    path.parent.mkdir()
    torch.save(optimizer.state_dict(), path)
    return model, path


@pytest.mark.parametrize("where", ["same bucket", "another bucket"])
def test_a_torch_file_is_composed_after_the_whole_original_and_resumes(
    gcs: gcsserver.Server, tmp_path: Path, where: str
) -> None:
    """GCS composes whole objects: the copy is the original, composed inside the store, then the tail uploaded
    (new pickle, new storages, new directory); an 18 MiB file moves its tail and its pickle, never its tensors, and
    torch.load of the copy (mmap too) resumes exactly as the local repair does."""
    model, path = _trained_file(tmp_path)
    bucket = gcsserver.new_bucket(gcs)
    gcsserver.upload(gcs, path.parent, bucket, "run/")
    written = bucket if where == "same bucket" else gcsserver.new_bucket(gcs)
    result = api.fix(f"gs://{bucket}/run/optimizer.pt", f"gs://{written}/fixed/", fill="empty")
    assert result.out == f"gs://{written}/fixed/" and result.verification.proof == "GCS CRC32C"
    with zipfile.ZipFile(path) as archive:
        pickle_size = archive.getinfo("optimizer/data.pkl").file_size
    traffic = result.traffic
    assert traffic is not None
    assert traffic.written < 2 * pickle_size + (1 << 20) and traffic.read < 2 * pickle_size + (1 << 20)
    assert traffic.copied >= path.stat().st_size  # the original, composed (and rewritten first, from elsewhere)
    assert gcsserver.keys(gcs, written, "fixed/") == {"optimizer.pt"}  # no marker, no scratch copy left
    composed = gcsserver.download(gcs, written, "fixed/", tmp_path / "composed") / "optimizer.pt"
    assert composed.read_bytes().startswith(path.read_bytes())
    local = api.fix(path, tmp_path / "local.pt", fill="empty")
    assert api.inspect(composed).verdict == api.inspect(local.out).verdict == "healthy"
    expected = torch.load(local.out, weights_only=True)
    for mmap in (False, True):
        resumed = torch.load(composed, weights_only=True, mmap=mmap)
        assert resumed["param_groups"] == expected["param_groups"]
        assert resumed["state"].keys() == expected["state"].keys()
        for param, state in expected["state"].items():
            assert all(torch.equal(state[key], resumed["state"][param][key]) for key in state)
    torch.optim.AdamW(model.parameters()).load_state_dict(resumed)  # the loader HF Trainer resumes through
    with pytest.raises(OutputError, match="already exists"):
        api.fix(f"gs://{bucket}/run/optimizer.pt", f"gs://{written}/fixed/optimizer.pt")


def test_a_torch_file_is_repaired_from_a_store_and_into_one(gcs: gcsserver.Server, tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in", steps=2)
    bucket = gcsserver.new_bucket(gcs)
    gcsserver.upload(gcs, built.path, bucket, PREFIX)
    (tmp_path / "out").mkdir()
    local = api.fix(f"gs://{bucket}/{PREFIX}optimizer.pt", f"{tmp_path}/out/")
    assert local.out == tmp_path / "out" / "optimizer.pt"
    uploaded = api.fix(built.path / "optimizer.pt", f"gs://{bucket}/fixed/")
    assert uploaded.out == f"gs://{bucket}/fixed/optimizer.pt"
    assert fix_document(uploaded)["verification"]["proof"].endswith("each object checked by GCS CRC32C on receipt")
    back = gcsserver.download(gcs, bucket, "fixed/", tmp_path / "back") / "optimizer.pt"
    assert back.read_bytes() == Path(local.out).read_bytes()


def test_a_remote_checkpoint_is_repaired_into_a_local_copy_and_a_local_one_into_the_store(
    gcs: gcsserver.Server, gcs_stored: tuple[str, Built], tmp_path: Path
) -> None:
    bucket, built = gcs_stored
    out = tmp_path / "fixed"
    result = api.fix(f"gs://{bucket}/{PREFIX}", out)
    assert result.out == out and api.inspect(out).verdict == "healthy"
    resumed = dk.resume(out, "adamw", "optim", False)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    uploaded = api.fix(built.path, f"gs://{bucket}/uploaded/")
    assert uploaded.verification.proof == "uploaded, checked by GCS CRC32C"
    assert uploaded.traffic is not None and uploaded.traffic.read == 0 and uploaded.traffic.copied == 0
    back = gcsserver.download(gcs, bucket, "uploaded/", tmp_path / "back")
    assert {path.name for path in back.iterdir()} == {path.name for path in out.iterdir()}
    assert all(back.joinpath(path.name).read_bytes() == path.read_bytes() for path in _shards(built))
    assert api.inspect(back).verdict == "healthy"


def test_large_files_are_uploaded_in_parts_and_copied_in_rounds(
    gcs: gcsserver.Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files over ``SIMPLE_LIMIT`` go by a resumable upload in parts; lowered here to 1 MiB and 256 KiB (GCS's
    smallest part) so that a 12 MiB shard takes many."""
    monkeypatch.setattr(store, "SIMPLE_LIMIT", 1 << 20)
    monkeypatch.setattr(store, "PART", 256 << 10)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(1800, 1800), "unused": torch.nn.Linear(4, 4)})
    optimizer = torch.optim.AdamW(model.parameters())
    model["used"](torch.randn(2, 1800)).sum().backward()
    optimizer.step()
    path = tmp_path / "in"
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    bucket = gcsserver.new_bucket(gcs)
    uploaded = api.fix(path, f"gs://{bucket}/uploaded/")
    copied = api.fix(f"gs://{bucket}/uploaded/", f"gs://{bucket}/copied/")
    assert copied.verification.proof == "GCS CRC32C" and not copied.plan.additions
    for prefix in ("uploaded/", "copied/"):
        back = gcsserver.download(gcs, bucket, prefix, tmp_path / prefix)
        assert api.inspect(back).verdict == "healthy"
        assert all(
            back.joinpath(p.name).read_bytes() == p.read_bytes() for p in path.iterdir() if p.suffix == ".distcp"
        )
    assert uploaded.verification.tensors > 0


def _loadable(local: Path) -> bool:
    try:
        dk.resume(local, "adamw", "optim", False, steps=0)
    except CheckpointException:
        return False
    return True


def test_a_killed_fix_never_leaves_a_loadable_prefix_and_the_next_run_cleans_up(
    gcs: gcsserver.Server, gcs_stored: tuple[str, Built], tmp_path: Path
) -> None:
    bucket, _ = gcs_stored
    command = [sys.executable, "-m", "optim_repair", "fix", f"gs://{bucket}/{PREFIX}", "--out"]
    private = tmp_path / "private"  # the runs' TMPDIR: what they stage and fetch there
    private.mkdir()
    environment = {**os.environ, claim.LEASE_VARIABLE: "1", "TMPDIR": str(private)}  # a killed claim lapses in 1 s
    started = time.monotonic()
    subprocess.run([*command, f"gs://{bucket}/timed/"], check=True, capture_output=True, env=environment)
    whole = time.monotonic() - started
    chance = random.Random(29)
    for trial in range(20):
        out = f"killed-{trial}/"
        running = subprocess.Popen(
            [*command, f"gs://{bucket}/{out}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment
        )
        time.sleep(chance.uniform(0.2, whole))
        running.send_signal(signal.SIGKILL if trial % 2 else signal.SIGTERM)
        running.wait()
        left = gcsserver.keys(gcs, bucket, out)
        if METADATA_FILE in left:  # it got as far as its commit: the copy is whole
            assert _loadable(gcsserver.download(gcs, bucket, out, tmp_path / f"whole-{trial}"))
            continue
        if left:
            assert not _loadable(gcsserver.download(gcs, bucket, out, tmp_path / f"left-{trial}"))
            assert running.returncode == -signal.SIGKILL, left  # a SIGTERM deletes what it wrote
            assert claim.MARKER in left
            time.sleep(2.1)  # its lease lapses
        again = subprocess.run([*command, f"gs://{bucket}/{out}"], capture_output=True, text=True, env=environment)
        assert again.returncode == 0, again.stderr
        assert ("a stopped run left" in again.stderr) == bool(left)
        assert _loadable(gcsserver.download(gcs, bucket, out, tmp_path / f"again-{trial}"))
    time.sleep(disk_staging.STALE_AFTER_SECONDS + 0.5)  # what the last killed runs left is stale now
    subprocess.run([*command, f"gs://{bucket}/last/"], check=True, capture_output=True, env=environment)
    assert list(private.iterdir()) == []  # what each killed run staged or fetched was removed by a later run


def test_a_dry_run_refuses_what_fix_would_refuse(
    gcs: gcsserver.Server, gcs_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """Before it writes, fix refuses an output that is taken (or, with --force, holds what is no earlier copy) and
    one over or inside the checkpoint, on either side: its dry run refuses alike, and writes nothing."""
    bucket, built = gcs_stored
    gcsserver.put(gcs, bucket, "taken/notes.txt", b"keep me")
    (tmp_path / "local").mkdir()
    source, taken = f"gs://{bucket}/{PREFIX}", f"gs://{bucket}/taken/"
    for checkpoint, out, force in ((source, taken, False), (source, taken, True), (built.path, taken, False),
                                   (built.path, taken, True), (source, tmp_path / "local", False)):  # fmt: skip
        with pytest.raises(OutputError):
            api.dry_run(checkpoint, out, force=force)
    with pytest.raises(UsageError, match="holds the checkpoint or lies inside it"):
        api.dry_run(source, f"{source}inner/")
    assert api.dry_run(source, tmp_path / "local", force=True).free_bytes is not None
    assert api.dry_run(source, f"gs://{bucket}/fresh/").free_bytes is None
    assert gcsserver.keys(gcs, bucket, "taken/") == {"notes.txt"} and gcsserver.keys(gcs, bucket, "fresh/") == set()


def test_dry_run_latest_and_a_model_in_the_store(gcs: gcsserver.Server, tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in", steps=2)
    bucket = gcsserver.new_bucket(gcs)
    gcsserver.upload(gcs, built.path, bucket, "run/checkpoint-2/")
    gcsserver.upload(gcs, built.path, bucket, "run/checkpoint-1/")
    assert api.latest_checkpoint(f"gs://{bucket}/run/") == f"gs://{bucket}/run/checkpoint-2/"
    planned = json.loads(
        run_cli(
            ["fix", f"gs://{bucket}/run/", "--latest", "--out", f"gs://{bucket}/fixed/", "--dry-run", "--json"]
        ).stdout
    )
    assert planned["dry_run"] is True and planned["free_bytes"] is None and planned["added"]
    assert gcsserver.keys(gcs, bucket, "fixed/") == set()
    model = f"gs://{bucket}/run/checkpoint-2/model.safetensors"
    with_model = api.inspect(f"gs://{bucket}/run/checkpoint-2/optimizer.pt", model=model)
    assert (
        with_model.verdict == api.inspect(built.path / "optimizer.pt", model=built.path / "model.safetensors").verdict
    )
