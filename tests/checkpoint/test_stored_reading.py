"""Reading ``s3://`` checkpoints from a real S3-compatible server on 127.0.0.1: DCP checkpoints and torch files
inspected by ranges, the requests counted at the server, the answers those of the same checkpoint read locally."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from optim_repair import api
from optim_repair.errors import InputError, RepairRefused, UsageError
from optim_repair.formats.dcp import METADATA_FILE, read_metadata
from optim_repair.render import inspect_document
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import s3server, trainers
from tests.factories.built import Built
from tests.factories.s3server import PREFIX

pytestmark = pytest.mark.usefixtures("environment")


def _shards(built: Built) -> list[Path]:
    return sorted(built.path.glob("*.distcp"))


def test_inspect_reads_the_metadata_and_one_range_a_shard(server: s3server.Server, stored: tuple[str, Built]) -> None:
    bucket, built = stored
    before = len(server.requests(bucket))
    diagnosis = api.inspect(f"s3://{bucket}/{PREFIX}")
    made = server.requests(bucket)[before:]
    shards = _shards(built)
    holding = {info.relative_path for key, info in read_metadata(built.path).storage.items() if key[1] is None}
    assert made[0].startswith(f"GET /{bucket}?list-type=2")  # the listing, .metadata, one ranged GET a shard
    assert made[1:] == [f"GET /{bucket}/{PREFIX}{name}" for name in (METADATA_FILE, *sorted(holding))]
    assert len(made) <= 2 + len(shards)  # counted at the server
    traffic = diagnosis.inventory.traffic
    assert traffic is not None and traffic.requests == len(made)
    metadata = (built.path / METADATA_FILE).stat().st_size
    assert metadata < traffic.read <= metadata + 64 * 1024  # never the tensors' bytes
    assert traffic.read < metadata + min(path.stat().st_size for path in shards)
    assert traffic.written == traffic.copied == 0

    local = inspect_document(api.inspect(built.path))
    remote = inspect_document(diagnosis)
    assert remote["verdict"] == "repairable" and remote["remote"] is not None
    assert {**remote, "path": local["path"], "remote": None} == local


def test_errors_name_the_bucket_and_key(stored: tuple[str, Built]) -> None:
    bucket, _ = stored
    with pytest.raises(InputError, match=r"^s3://no-such-bucket-here/x/: no such bucket$"):
        api.inspect("s3://no-such-bucket-here/x/")
    with pytest.raises(InputError, match="holds no objects"):
        api.inspect(f"s3://{bucket}/nothing-here/")
    with pytest.raises(InputError, match=rf"^s3://{bucket}/{PREFIX}optimizer.pt: no such object"):
        api.inspect(f"s3://{bucket}/{PREFIX}optimizer.pt")
    result = run_cli(["inspect", "s3://no-such-bucket-here/x/"], code=4)
    assert result.stderr.strip() == "optim-repair: error: s3://no-such-bucket-here/x/: no such bucket"


def test_without_boto3_the_error_names_the_extra(stored: tuple[str, Built]) -> None:
    bucket, _ = stored
    code = "import sys; sys.modules['boto3'] = None; from optim_repair.console import main; main()"
    ran = subprocess.run(
        [sys.executable, "-c", code, "inspect", f"s3://{bucket}/{PREFIX}"], capture_output=True, text=True
    )
    assert ran.returncode == 2
    assert "pip install 'optim-repair[s3]'" in ran.stderr and "Traceback" not in ran.stderr


def _local_view(document: Mapping[str, object], path: Path) -> object:
    """The document of a remote checkpoint as that of its local copy at ``path`` reads: its URL is that path."""
    named = json.dumps({**document, "remote": None}).replace(json.dumps(str(document["path"]))[1:-1], str(path))
    return json.loads(named)


@pytest.mark.parametrize(
    "factory", [trainers.hf_trainer, trainers.accelerate, trainers.lightning], ids=lambda f: f.__name__
)
def test_a_torch_checkpoint_directory_reads_as_it_does_locally(
    server: s3server.Server, tmp_path: Path, factory: Callable[[Path], Built]
) -> None:
    built = factory(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    directory = built.path if built.path.is_dir() else built.path.parent
    s3server.upload(server, directory, bucket, PREFIX)
    target = f"s3://{bucket}/{PREFIX}" + ("" if built.path.is_dir() else built.path.name)
    remote = inspect_document(api.inspect(target))
    local = inspect_document(api.inspect(built.path))
    assert remote["remote"] is not None and remote["path"] == target
    assert _local_view(remote, built.path) == local


def _large_optimizer(path: Path, width: int = 600) -> Path:
    """An AdamW state of moments over a MiB, by name (as torch's full-state getter writes it), one layer never used."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(width, 600), "unused": torch.nn.Linear(width, 600)})
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model["used"](torch.randn(2, width)).sum().backward()
        optimizer.step()
    path.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}, path / "run.pt")
    return path / "run.pt"


def test_a_torch_file_is_read_by_its_end_its_head_and_its_record_headers(
    server: s3server.Server, tmp_path: Path
) -> None:
    optimizer = _large_optimizer(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, optimizer.parent, bucket, PREFIX)
    before = len(server.requests(bucket))
    diagnosis = api.inspect(f"s3://{bucket}/{PREFIX}run.pt")
    made = server.requests(bucket)[before:]
    assert made[1].startswith(f"GET /{bucket}?list-type=2") and "delimiter=/" in made[1]  # safetensors beside it
    made = [made[0], *made[2:]]
    assert all(request == f"GET /{bucket}/{PREFIX}run.pt" for request in made)
    with zipfile.ZipFile(optimizer) as archive:
        storages = [info for info in archive.infolist() if "/data/" in info.filename]
    assert 2 < len(made) <= 2 + len(storages)  # its end, its head, then local headers with the step values
    traffic = diagnosis.inventory.traffic
    assert traffic is not None and traffic.requests == len(made) + 1
    assert diagnosis.verdict == "repairable"
    assert _local_view(inspect_document(diagnosis), optimizer) == inspect_document(api.inspect(optimizer))

    wider = _large_optimizer(tmp_path / "wider", width=1200)  # the same records, twice the bytes of each weight
    s3server.upload(server, wider.parent, bucket, "wider/")
    read = api.inspect(f"s3://{bucket}/wider/run.pt").inventory.traffic
    assert read is not None and read.requests == traffic.requests
    assert abs(read.read - traffic.read) < 1024  # the bytes read grow with records, not with tensor bytes


def test_access_denied_is_exit_4_naming_the_bucket_and_key(tmp_path: Path) -> None:
    """A server that checks IAM after the four requests that set it up: a bucket, its object, a user, its keys."""
    server = s3server.start(tmp_path / "requests.log", checked_after=4)
    try:
        client = server.client()
        client.create_bucket(Bucket="locked-bucket")
        client.put_object(Bucket="locked-bucket", Key=f"{PREFIX}{METADATA_FILE}", Body=b"")
        keys = s3server.iam_user_keys(server)
        result = run_cli(
            ["inspect", f"s3://locked-bucket/{PREFIX}", "--endpoint-url", server.endpoint, "--json"],
            code=4,
            env={**s3server.CREDENTIALS, **keys},
        )
        error = json.loads(result.stdout)["error"]
        assert error["message"] == f"s3://locked-bucket/{PREFIX}: access denied (AccessDenied)"
        assert error["path"] == f"s3://locked-bucket/{PREFIX}"
    finally:
        s3server.stop(server)


def test_a_legacy_torch_file_is_not_read_from_a_store_yet(server: s3server.Server, tmp_path: Path) -> None:
    built = trainers.legacy_format(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path.parent, bucket, PREFIX)
    with pytest.raises(UsageError, match=r"legacy.pt: is a legacy-format torch file: not read in object storage yet"):
        api.inspect(f"s3://{bucket}/{PREFIX}legacy.pt")
    with pytest.raises(InputError, match=r"no optimizer state found in any file \(1 file\(s\) skipped\)"):
        api.inspect(f"s3://{bucket}/{PREFIX}")


def test_the_model_may_be_in_a_store_too(server: s3server.Server, tmp_path: Path) -> None:
    """A DCP step of the model alone, and a safetensors file, each read from the store for the shapes of the
    parameters without state, as a local --model is read."""
    optimizer_only = dk.flattened_without_model(tmp_path / "in").path
    titan = dk.torchtitan_model_only(tmp_path / "titan")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, titan, bucket, "model/")
    before = len(server.requests(bucket))
    local = api.fix(optimizer_only, tmp_path / "local", model=titan)
    remote = api.fix(optimizer_only, tmp_path / "remote", model=f"s3://{bucket}/model/")
    assert remote.plan == local.plan and remote.plan.additions
    assert all(request.startswith("GET") for request in server.requests(bucket)[before:])  # read, never written
    weights = tmp_path / "model.safetensors"
    trainers.save_safetensors({"unrelated.weight": torch.zeros(2)}, weights)
    s3server.upload(server, tmp_path, bucket, "files/")
    with pytest.raises(RepairRefused, match=f"looked in s3://{bucket}/files/model.safetensors"):
        api.fix(optimizer_only, tmp_path / "c", model=f"s3://{bucket}/files/model.safetensors", fill="fresh")


def test_an_empty_torch_file_is_named_empty_as_on_a_disk(server: s3server.Server, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "optimizer.pt").write_bytes(b"")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, tmp_path / "in", bucket, PREFIX)
    with pytest.raises(InputError, match=rf"^s3://{bucket}/{PREFIX}optimizer.pt: empty file$"):
        api.inspect(f"s3://{bucket}/{PREFIX}optimizer.pt")
    with pytest.raises(InputError, match=r"^optimizer\.pt: empty file; a damaged torch file may have held optimizer"):
        api.inspect(f"s3://{bucket}/{PREFIX}")


def test_a_torch_file_reads_the_safetensors_beside_it_as_it_does_locally(
    server: s3server.Server, tmp_path: Path
) -> None:
    """HF Trainer's optimizer.pt beside model.safetensors: the store reads the shapes beside a single file, as a
    disk does (fuzz --s3 found that it did not)."""
    built = trainers.hf_trainer(tmp_path / "in")
    assert (built.path / "model.safetensors").is_file()
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, PREFIX)
    local = inspect_document(api.inspect(built.path / "optimizer.pt"))
    remote = inspect_document(api.inspect(f"s3://{bucket}/{PREFIX}optimizer.pt"))
    assert remote["optimizers"][0]["model"]["sources"] == local["optimizers"][0]["model"]["sources"]
    assert _local_view(remote, built.path / "optimizer.pt") == local


def test_a_shard_named_with_a_trailing_slash_is_read_as_torch_reads_it(server: s3server.Server, tmp_path: Path) -> None:
    """``__0_0.distcp/`` joined onto a directory is the shard, on a disk and in torch's own reader; in a store it is
    found as the same object (fuzz --s3, seed 0, cases 1189 and 1754)."""
    built = dk.sharded_dcp(tmp_path / "in")
    metadata_path = built.path / METADATA_FILE
    with metadata_path.open("rb") as stream:  # torch's own classes, edited as the fuzzer edits them
        saved = pickle.load(stream)
    index = next(key for key in saved.storage_data if key.fqn.startswith("optim.param_groups"))
    info = saved.storage_data[index]
    saved.storage_data[index] = dataclasses.replace(info, relative_path=f"{info.relative_path}/")
    with metadata_path.open("wb") as stream:
        pickle.dump(saved, stream)
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, PREFIX)
    local = inspect_document(api.inspect(built.path))
    remote = inspect_document(api.inspect(f"s3://{bucket}/{PREFIX}"))
    assert local["verdict"] == "repairable" and _local_view(remote, built.path) == local


def test_latest_in_a_store_passes_over_an_hf_step_without_its_trainer_state(
    server: s3server.Server, tmp_path: Path
) -> None:
    """As on a disk: the HF Trainer writes ``trainer_state.json`` last, so a step without it is still being saved."""
    run = tmp_path / "run"
    for steps in (3, 5):
        trainers.hf_trainer(run, steps=steps)
    (run / "checkpoint-5" / "trainer_state.json").unlink()
    bucket = s3server.new_bucket(server)
    s3server.upload(server, run, bucket, "run/")
    assert api.latest_checkpoint(f"s3://{bucket}/run/") == f"s3://{bucket}/run/checkpoint-3/"


def test_lightnings_sharded_checkpoint_in_a_store_is_judged_by_lightnings_loader(
    server: s3server.Server, tmp_path: Path
) -> None:
    """As on a disk: Lightning's ``meta.pt`` beside a DCP checkpoint's ``.metadata`` names the loader."""
    built = dk.unirl_dcp(tmp_path / "run")
    torch.save({"epoch": 0, "global_step": dk.PRE_STEPS}, built.path / "meta.pt")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, "lightning/")
    document = json.loads(run_cli(["inspect", f"s3://{bucket}/lightning/", "--json"], code=0).stdout)
    assert document["verdict"] == "healthy" and document["optimizers"][0]["loader"] == "lightning-fsdp"
