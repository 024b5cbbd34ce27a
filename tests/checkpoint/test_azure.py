"""``az://`` checkpoints on a real Azure Blob emulator on 127.0.0.1 (Azurite), through the azure extra's client:
the cases that hold for ``gs://`` hold here, each result loaded by torch's own readers and resumed bit-identically,
interruptions never left loadable. Azurite implements no Put Block From URL, so a torch file's kept range takes the
store's fallback here (read, pinned, and sent as blocks); no test depends on a check the emulator skips
(``tests/factories/azurite``)."""

from __future__ import annotations

import base64
import hashlib
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
from optim_repair.storage.azure import store
from tests.conftest import run_cli
from tests.factories import azurite, trainers
from tests.factories import dcp as dk
from tests.factories.azurite import ACCOUNT, PREFIX
from tests.factories.built import Built

pytestmark = pytest.mark.usefixtures("azure_environment")

PINNED = "pinned to each source's ETag"
PINNED_DOCUMENT = (
    "copied inside the store pinned to each source's ETag, not proven (--verify download reads the copies back)"
)


def _shards(built: Built) -> list[Path]:
    return sorted(built.path.glob("*.distcp"))


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


def _blocks(server: azurite.Server, container: str, key: str) -> int:
    """How many committed blocks the blob ``key`` is made of."""
    committed, _ = azurite.client(server).get_blob_client(container, key).get_block_list("committed")
    return len(committed)


def test_inspect_reads_the_metadata_and_one_range_a_shard(azure_stored: tuple[str, Built]) -> None:
    container, built = azure_stored
    diagnosis = api.inspect(f"az://{container}/{PREFIX}")
    traffic = diagnosis.inventory.traffic
    assert traffic is not None and traffic.requests <= 2 + len(_shards(built))
    metadata = (built.path / METADATA_FILE).stat().st_size
    assert metadata < traffic.read <= metadata + 64 * 1024  # never the tensors' bytes
    assert traffic.read < metadata + min(path.stat().st_size for path in _shards(built))
    assert diagnosis.verdict == api.inspect(built.path).verdict == "repairable"


def test_errors_name_the_container_and_key(azure_stored: tuple[str, Built]) -> None:
    container, _ = azure_stored
    with pytest.raises(InputError, match=r"^az://no-such-container-here/x/: no such container$"):
        api.inspect("az://no-such-container-here/x/")
    with pytest.raises(InputError, match=rf"^az://{container}/{PREFIX}optimizer.pt: no such object"):
        api.inspect(f"az://{container}/{PREFIX}optimizer.pt")
    result = run_cli(["inspect", "az://no-such-container-here/x/"], code=4)
    assert result.stderr.strip() == "optim-repair: error: az://no-such-container-here/x/: no such container"
    with pytest.raises(UsageError, match="--profile names an AWS profile"):
        api.inspect(f"az://{container}/{PREFIX}", profile="default")


def test_without_a_connection_string_or_an_account_the_error_names_the_account(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No account to reach: exit 2 before any credential is looked for (Azure AD's chain, which would probe the
    network, is never built) and before a request."""
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT", raising=False)
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # reaching for Azure AD would fail loudly
    started = time.monotonic()
    result = run_cli(["inspect", "az://container/run/"], code=2)
    assert time.monotonic() - started < 5
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "names no storage account" in lines[0] and "--account" in lines[0]
    assert "Traceback" not in result.stderr


def test_a_connection_string_whose_key_is_no_key_is_exit_2_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=acct01;AccountKey=not*base64!")
    result = run_cli(["inspect", "az://container/run/"], code=2)
    assert result.stderr.strip() == (
        "optim-repair: error: AZURE_STORAGE_CONNECTION_STRING holds an AccountKey that is not base64"
    )


def test_an_empty_torch_file_is_named_empty_as_on_a_disk(azure: azurite.Server) -> None:
    container = azurite.new_container(azure)
    azurite.put(azure, container, f"{PREFIX}optimizer.pt", b"")
    with pytest.raises(InputError, match=rf"^az://{container}/{PREFIX}optimizer.pt: empty file$"):
        api.inspect(f"az://{container}/{PREFIX}optimizer.pt")
    azurite.put(azure, container, f"{PREFIX}notes.pt", b"these are notes, not a checkpoint\n")
    result = run_cli(["inspect", f"az://{container}/{PREFIX}notes.pt"], code=4)  # as on a disk: no usage error
    assert "notes.pt: not a torch file (no zip archive, no legacy magic number)" in result.stderr


@pytest.mark.parametrize("out", ["fixed/../elsewhere/", "fixed//inner/", "./fixed/"])
def test_a_key_with_dot_or_empty_segments_is_refused_before_anything_is_read(
    azure: azurite.Server, azure_stored: tuple[str, Built], out: str
) -> None:
    """A store keeps ``a/../b`` as it is written; this tool refuses to read such a name back (it would lead a
    download outside its directory), so it never writes one."""
    container, built = azure_stored
    result = run_cli(["fix", f"az://{container}/{PREFIX}", "--out", f"az://{container}/{out}"], code=2)
    assert "names a key with an empty, '.' or '..' segment" in result.stderr
    assert azurite.keys(azure, container) == {f"{PREFIX}{path.name}" for path in built.path.iterdir()}


@pytest.mark.parametrize("missing", ["azure.storage.blob", "azure.identity"])
def test_without_the_client_the_error_names_the_extra(
    azure: azurite.Server, azure_stored: tuple[str, Built], missing: str
) -> None:
    """Azure's SDK makes a connection string's SAS; azure-identity is asked only without a connection string."""
    container, _ = azure_stored
    code = f"import sys; sys.modules[{missing!r}] = None; from optim_repair.console import main; main()"
    environment = dict(os.environ)
    arguments = ["inspect", f"az://{container}/{PREFIX}"]
    if missing == "azure.identity":
        del environment["AZURE_STORAGE_CONNECTION_STRING"]
        arguments += ["--account", ACCOUNT, "--endpoint-url", azure.endpoint]
    ran = subprocess.run([sys.executable, "-c", code, *arguments], capture_output=True, text=True, env=environment)
    assert ran.returncode == 2, ran.stderr
    assert "pip install 'optim-repair[azure]'" in ran.stderr and "Traceback" not in ran.stderr


def test_fix_copies_inside_the_store_and_the_copy_resumes_bit_identically(
    azure: azurite.Server, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    container, built = azure_stored
    before = {path.name: path.read_bytes() for path in built.path.iterdir()}
    other = azurite.new_container(azure)
    for out in (f"az://{container}/fixed/", f"az://{other}/fixed/"):
        result = api.fix(f"az://{container}/{PREFIX}", out)
        traffic = result.traffic
        assert traffic is not None
        assert traffic.copied == sum(path.stat().st_size for path in built.path.iterdir() if path.name != METADATA_FILE)
        metadata = (built.path / METADATA_FILE).stat().st_size
        assert traffic.read <= metadata + 64 * 1024  # no shard's bytes pass through the client
        assert result.verification.proof == PINNED and result.verification.tensors > 0
        assert fix_document(result)["verification"]["proof"] == PINNED_DOCUMENT
        written = out.removeprefix("az://").split("/")[0]
        assert azurite.keys(azure, written, "fixed/") == set(before) | {"__optim_repair_0.distcp"}  # no marker left
        local = azurite.download(azure, written, "fixed/", tmp_path / written)
        assert all(local.joinpath(name).read_bytes() == data for name, data in before.items() if name != METADATA_FILE)
        resumed = dk.resume(local, "adamw", "optim", False)
        reference = dk.uninterrupted("adamw")
        assert all(torch.equal(resumed[name], reference[name]) for name in reference)
        assert api.inspect(out).verdict == "healthy"
    assert azurite.keys(azure, container, PREFIX) == set(before)


def test_the_json_report_says_the_copies_are_pinned_not_proven(azure_stored: tuple[str, Built]) -> None:
    container, _ = azure_stored
    document = json.loads(
        run_cli(["fix", f"az://{container}/{PREFIX}", "--out", f"az://{container}/fixed/", "--json"]).stdout
    )
    assert document["verification"]["proof"] == PINNED_DOCUMENT


def test_read_back_compares_every_copied_byte(azure_stored: tuple[str, Built]) -> None:
    container, built = azure_stored
    result = api.fix(f"az://{container}/{PREFIX}", f"az://{container}/fixed/", verify="download")
    assert result.verification.proof == "read back"
    assert fix_document(result)["verification"]["proof"] != PINNED_DOCUMENT
    assert result.traffic is not None
    assert result.traffic.read >= 2 * sum(path.stat().st_size for path in _shards(built))


def test_a_prefix_that_holds_objects_is_refused_unless_forced(
    azure: azurite.Server, azure_stored: tuple[str, Built]
) -> None:
    container, built = azure_stored
    azurite.put(azure, container, "fixed/notes.txt", b"keep me")
    with pytest.raises(OutputError, match="already holds objects; pass force=True to replace them"):
        api.fix(f"az://{container}/{PREFIX}", f"az://{container}/fixed/")
    assert azurite.keys(azure, container, "fixed/") == {"notes.txt"}
    with pytest.raises(OutputError, match=r"holds 1 object the copy would not write \(notes.txt\): it is no earlier"):
        api.fix(f"az://{container}/{PREFIX}", f"az://{container}/fixed/", force=True)  # as on a disk: not a copy's
    assert azurite.keys(azure, container, "fixed/") == {"notes.txt"}
    assert azurite.get(azure, container, "fixed/notes.txt") == b"keep me"
    run_cli(["fix", f"az://{container}/{PREFIX}", "--out", f"az://{container}/fixed/", "--force"], code=5)
    api.fix(f"az://{container}/{PREFIX}", f"az://{container}/earlier/")
    api.fix(f"az://{container}/{PREFIX}", f"az://{container}/earlier/", force=True)  # an earlier copy is replaced
    assert azurite.keys(azure, container, "earlier/") == {path.name for path in built.path.iterdir()} | {
        "__optim_repair_0.distcp"
    }
    for out in ("run/", PREFIX, f"{PREFIX}fixed/"):
        with pytest.raises(UsageError, match="holds the checkpoint or lies inside it"):
            api.fix(f"az://{container}/{PREFIX}", f"az://{container}/{out}", force=True)
    assert azurite.keys(azure, container, PREFIX) == {path.name for path in built.path.iterdir()}


def _trained_file(tmp_path: Path, width: int = 1500) -> tuple[torch.nn.ModuleDict, Path]:
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(width, width), "unused": torch.nn.Linear(8, 8)})
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model["used"](torch.randn(2, width)).sum().backward()
        optimizer.step()
    path = tmp_path / "in" / "optimizer.pt"
    path.parent.mkdir(parents=True)
    torch.save(optimizer.state_dict(), path)
    return model, path


def _resumes_as_the_local_repair(model: torch.nn.ModuleDict, spliced: Path, path: Path, tmp_path: Path) -> None:
    """``spliced`` is healthy and loads (mmap too, and as a zip archive) as the local repair of ``path`` does."""
    local = api.fix(path, tmp_path / "local.pt", fill="empty")
    assert api.inspect(spliced).verdict == api.inspect(local.out).verdict == "healthy"
    with zipfile.ZipFile(spliced) as archive:
        assert archive.testzip() is None
    expected = torch.load(local.out, weights_only=True)
    for mmap in (False, True):
        resumed = torch.load(spliced, weights_only=True, mmap=mmap)
        assert resumed["param_groups"] == expected["param_groups"]
        assert resumed["state"].keys() == expected["state"].keys()
        for param, state in expected["state"].items():
            assert state.keys() == resumed["state"][param].keys()
            assert all(torch.equal(state[key], resumed["state"][param][key]) for key in state)
    torch.optim.AdamW(model.parameters()).load_state_dict(resumed)  # the loader HF Trainer resumes through


@pytest.mark.parametrize("where", ["same container", "another container"])
def test_a_torch_file_is_spliced_as_blocks_and_resumes(azure: azurite.Server, tmp_path: Path, where: str) -> None:
    """A splice is a block blob: the new head, the original's kept range, the new tail, committed as one block list.
    Azurite copies no range (Put Block From URL answers 501, or 500): the kept range is read, pinned to the
    original's ETag, and sent as blocks; the copy is pinned, not proven, and torch.load of it (mmap too) resumes
    exactly as the local repair does."""
    model, path = _trained_file(tmp_path)
    container = azurite.new_container(azure)
    azurite.upload(azure, path.parent, container, "run/")
    written = container if where == "same container" else azurite.new_container(azure)
    result = api.fix(f"az://{container}/run/optimizer.pt", f"az://{written}/fixed/", fill="empty")
    assert result.out == f"az://{written}/fixed/" and result.verification.proof == PINNED
    assert fix_document(result)["verification"]["proof"] == PINNED_DOCUMENT
    with zipfile.ZipFile(path) as archive:
        pickle_size = archive.getinfo("optimizer/data.pkl").file_size
    size = path.stat().st_size
    traffic = result.traffic
    assert traffic is not None
    assert traffic.copied == 0  # the emulator copies no range: the fallback sent it
    assert size - (1 << 20) < traffic.read < size + 2 * pickle_size + (1 << 20)  # the kept range, read once
    assert size - (1 << 20) < traffic.written < size + 2 * pickle_size + (1 << 20)
    assert azurite.keys(azure, written, "fixed/") == {"optimizer.pt"}  # no marker, no scratch object left
    assert _blocks(azure, written, "fixed/optimizer.pt") >= 3  # head, kept range (16 MiB blocks), tail
    spliced = azurite.download(azure, written, "fixed/", tmp_path / "spliced") / "optimizer.pt"
    _resumes_as_the_local_repair(model, spliced, path, tmp_path)
    assert azurite.get(azure, container, "run/optimizer.pt") == path.read_bytes()
    with pytest.raises(OutputError, match="already exists"):
        api.fix(f"az://{container}/run/optimizer.pt", f"az://{written}/fixed/optimizer.pt")


def test_a_torch_file_splice_read_back_compares_its_bytes(azure: azurite.Server, tmp_path: Path) -> None:
    model, path = _trained_file(tmp_path, width=400)
    container = azurite.new_container(azure)
    azurite.upload(azure, path.parent, container, "run/")
    result = api.fix(f"az://{container}/run/optimizer.pt", f"az://{container}/fixed/", fill="empty", verify="download")
    assert result.verification.proof == "read back"
    spliced = azurite.download(azure, container, "fixed/", tmp_path / "spliced") / "optimizer.pt"
    _resumes_as_the_local_repair(model, spliced, path, tmp_path)


def test_a_torch_file_is_repaired_from_a_store_and_into_one(azure: azurite.Server, tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in", steps=2)
    container = azurite.new_container(azure)
    azurite.upload(azure, built.path, container, PREFIX)
    (tmp_path / "out").mkdir()
    local = api.fix(f"az://{container}/{PREFIX}optimizer.pt", f"{tmp_path}/out/")
    assert local.out == tmp_path / "out" / "optimizer.pt"
    uploaded = api.fix(built.path / "optimizer.pt", f"az://{container}/fixed/")
    assert uploaded.out == f"az://{container}/fixed/optimizer.pt"
    proof = fix_document(uploaded)["verification"]["proof"]
    assert proof.endswith("each object checked by Azure Content-MD5 on receipt")
    back = azurite.download(azure, container, "fixed/", tmp_path / "back") / "optimizer.pt"
    assert back.read_bytes() == Path(local.out).read_bytes()


def test_a_remote_checkpoint_is_repaired_into_a_local_copy_and_a_local_one_into_the_store(
    azure: azurite.Server, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    container, built = azure_stored
    out = tmp_path / "fixed"
    result = api.fix(f"az://{container}/{PREFIX}", out)
    assert result.out == out and api.inspect(out).verdict == "healthy"
    resumed = dk.resume(out, "adamw", "optim", False)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    uploaded = api.fix(built.path, f"az://{container}/uploaded/")
    assert uploaded.verification.proof == "uploaded, checked by Azure Content-MD5"
    assert uploaded.traffic is not None and uploaded.traffic.read == 0 and uploaded.traffic.copied == 0
    back = azurite.download(azure, container, "uploaded/", tmp_path / "back")
    assert {path.name for path in back.iterdir()} == {path.name for path in out.iterdir()}
    assert all(back.joinpath(path.name).read_bytes() == path.read_bytes() for path in _shards(built))
    assert api.inspect(back).verdict == "healthy"


def test_large_files_are_uploaded_and_spliced_in_blocks(
    azure: azurite.Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files over ``SIMPLE_LIMIT`` go as blocks of ``BLOCK``, committed by one block list that sets the file's MD5;
    a kept range the store cannot copy goes in blocks of ``THROUGH_BLOCK``. Lowered here to 1 MiB and 256 KiB so
    that a 12 MiB shard and a 2 MiB torch file take many."""
    monkeypatch.setattr(store, "SIMPLE_LIMIT", 1 << 20)
    monkeypatch.setattr(store, "BLOCK", 256 << 10)
    monkeypatch.setattr(store, "THROUGH_BLOCK", 256 << 10)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(1800, 1800), "unused": torch.nn.Linear(4, 4)})
    optimizer = torch.optim.AdamW(model.parameters())
    model["used"](torch.randn(2, 1800)).sum().backward()
    optimizer.step()
    path = tmp_path / "in"
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    container = azurite.new_container(azure)
    uploaded = api.fix(path, f"az://{container}/uploaded/")
    copied = api.fix(f"az://{container}/uploaded/", f"az://{container}/copied/")
    assert copied.verification.proof == PINNED and not copied.plan.additions
    largest = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    assert largest.stat().st_size > 8 << 20
    assert _blocks(azure, container, f"uploaded/{largest.name}") == -(-largest.stat().st_size // (256 << 10))
    properties = azurite.client(azure).get_blob_client(container, f"uploaded/{largest.name}").get_blob_properties()
    kept = properties.content_settings.content_md5
    assert kept is not None and base64.b64encode(kept).decode() == _md5(largest.read_bytes())
    for prefix in ("uploaded/", "copied/"):
        back = azurite.download(azure, container, prefix, tmp_path / prefix)
        assert api.inspect(back).verdict == "healthy"
        assert all(
            back.joinpath(p.name).read_bytes() == p.read_bytes() for p in path.iterdir() if p.suffix == ".distcp"
        )
    assert uploaded.verification.tensors > 0
    small, torch_file = _trained_file(tmp_path / "file", width=500)
    azurite.upload(azure, torch_file.parent, container, "file/")
    spliced = api.fix(f"az://{container}/file/optimizer.pt", f"az://{container}/spliced/", fill="empty")
    assert spliced.verification.proof == PINNED
    assert _blocks(azure, container, "spliced/optimizer.pt") >= torch_file.stat().st_size // (256 << 10)
    back = azurite.download(azure, container, "spliced/", tmp_path / "spliced") / "optimizer.pt"
    _resumes_as_the_local_repair(small, back, torch_file, tmp_path / "file")


def _loadable(local: Path) -> bool:
    try:
        dk.resume(local, "adamw", "optim", False, steps=0)
    except CheckpointException:
        return False
    return True


def test_a_killed_fix_never_leaves_a_loadable_prefix_and_the_next_run_cleans_up(
    azure: azurite.Server, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    container, _ = azure_stored
    command = [sys.executable, "-m", "optim_repair", "fix", f"az://{container}/{PREFIX}", "--out"]
    private = tmp_path / "private"  # the runs' TMPDIR: what they stage and fetch there
    private.mkdir()
    environment = {**os.environ, claim.LEASE_VARIABLE: "1", "TMPDIR": str(private)}  # a killed claim lapses in 1 s
    started = time.monotonic()
    timed = subprocess.run([*command, f"az://{container}/timed/"], capture_output=True, text=True, env=environment)
    assert timed.returncode == 0, timed.stderr
    whole = time.monotonic() - started
    chance = random.Random(29)
    stopped_writing = 0
    for trial in range(20):
        out = f"killed-{trial}/"
        running = subprocess.Popen(
            [*command, f"az://{container}/{out}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment
        )
        if trial % 4 == 1:  # a SIGKILL while it writes (its claim is there): a run spends most of its time before
            while not azurite.keys(azure, container, out) and running.poll() is None:
                time.sleep(0.005)
            pause = chance.uniform(0, 0.1)
            time.sleep(pause if trial > 1 else 0)  # the first at once, so that one lands mid-write however loaded
        else:
            time.sleep(chance.uniform(0.2, whole))
        running.send_signal(signal.SIGKILL if trial % 2 else signal.SIGTERM)
        running.wait()
        left = azurite.keys(azure, container, out)
        if METADATA_FILE in left:  # it got as far as its commit: the copy is whole
            assert _loadable(azurite.download(azure, container, out, tmp_path / f"whole-{trial}"))
            continue
        if left:
            assert not _loadable(azurite.download(azure, container, out, tmp_path / f"left-{trial}"))
            assert running.returncode == -signal.SIGKILL, left  # a SIGTERM deletes what it wrote
            assert claim.MARKER in left
            stopped_writing += 1
            time.sleep(2.1)  # its lease lapses
        again = subprocess.run([*command, f"az://{container}/{out}"], capture_output=True, text=True, env=environment)
        assert again.returncode == 0, again.stderr
        assert ("a stopped run left" in again.stderr) == bool(left)
        assert _loadable(azurite.download(azure, container, out, tmp_path / f"again-{trial}"))
    assert stopped_writing > 0  # some run was killed halfway through its copy
    time.sleep(disk_staging.STALE_AFTER_SECONDS + 0.5)  # what the last killed runs left is stale now
    last = subprocess.run([*command, f"az://{container}/last/"], capture_output=True, text=True, env=environment)
    assert last.returncode == 0, last.stderr
    assert list(private.iterdir()) == []  # what each killed run staged or fetched was removed by a later run


def test_a_sigterm_while_it_writes_deletes_what_it_wrote_or_leaves_a_whole_copy(
    azure: azurite.Server, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """SIGTERM undoes the run (exit 143, "nothing was written": the prefix is empty, its marker gone), unless the
    copy was already whole (exit 0, no marker). Sent from the moment its claim appears, through its copies."""
    container, _ = azure_stored
    command = [sys.executable, "-m", "optim_repair", "fix", f"az://{container}/{PREFIX}", "--out"]
    environment = {**os.environ, claim.LEASE_VARIABLE: "1", "TMPDIR": str(tmp_path)}
    outcomes = []
    for trial in range(10):
        out = f"terminated-{trial}/"
        running = subprocess.Popen(
            [*command, f"az://{container}/{out}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=environment,
        )  # fmt: skip
        while not azurite.keys(azure, container, out) and running.poll() is None:
            time.sleep(0.002)
        time.sleep(0.006 * trial)
        running.send_signal(signal.SIGTERM)
        _, stderr = running.communicate()
        left = azurite.keys(azure, container, out)
        outcomes.append((trial, running.returncode, sorted(left), stderr.strip()[-200:]))
    wrong = [
        outcome
        for outcome in outcomes
        if not (outcome[1] == 128 + signal.SIGTERM and outcome[2] == [] and "nothing was written" in outcome[3])
        and not (outcome[1] == 0 and METADATA_FILE in outcome[2] and claim.MARKER not in outcome[2])
    ]
    assert wrong == []


def test_a_dry_run_refuses_what_fix_would_refuse(
    azure: azurite.Server, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """Before it writes, fix refuses an output that is taken (or, with --force, holds what is no earlier copy) and
    one over or inside the checkpoint, on either side: its dry run refuses alike, and writes nothing."""
    container, built = azure_stored
    azurite.put(azure, container, "taken/notes.txt", b"keep me")
    (tmp_path / "local").mkdir()
    source, taken = f"az://{container}/{PREFIX}", f"az://{container}/taken/"
    for checkpoint, out, force in ((source, taken, False), (source, taken, True), (built.path, taken, False),
                                   (built.path, taken, True), (source, tmp_path / "local", False)):  # fmt: skip
        with pytest.raises(OutputError):
            api.dry_run(checkpoint, out, force=force)
    with pytest.raises(UsageError, match="holds the checkpoint or lies inside it"):
        api.dry_run(source, f"{source}inner/")
    assert api.dry_run(source, tmp_path / "local", force=True).free_bytes is not None
    assert api.dry_run(source, f"az://{container}/fresh/").free_bytes is None
    assert azurite.keys(azure, container, "taken/") == {"notes.txt"}
    assert azurite.keys(azure, container, "fresh/") == set()


def test_dry_run_latest_and_a_model_in_the_store(azure: azurite.Server, tmp_path: Path) -> None:
    built = trainers.hf_trainer(tmp_path / "in", steps=2)
    container = azurite.new_container(azure)
    azurite.upload(azure, built.path, container, "run/checkpoint-2/")
    azurite.upload(azure, built.path, container, "run/checkpoint-1/")
    assert api.latest_checkpoint(f"az://{container}/run/") == f"az://{container}/run/checkpoint-2/"
    planned = json.loads(
        run_cli(
            ["fix", f"az://{container}/run/", "--latest", "--out", f"az://{container}/fixed/", "--dry-run", "--json"]
        ).stdout
    )
    assert planned["dry_run"] is True and planned["free_bytes"] is None and planned["added"]
    assert azurite.keys(azure, container, "fixed/") == set()
    model = f"az://{container}/run/checkpoint-2/model.safetensors"
    with_model = api.inspect(f"az://{container}/run/checkpoint-2/optimizer.pt", model=model)
    assert (
        with_model.verdict == api.inspect(built.path / "optimizer.pt", model=built.path / "model.safetensors").verdict
    )


def test_https_and_abfs_urls_name_the_account_and_reach_the_endpoint_given(
    azure: azurite.Server, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """``https://ACCOUNT.blob.core.windows.net/C/P`` and ``abfs://C@ACCOUNT.dfs.core.windows.net/P`` name the
    account; ``--endpoint-url`` reaches it at the emulator (the connection string's account is the URL's)."""
    container, built = azure_stored
    https = f"https://{ACCOUNT}.blob.core.windows.net/{container}/"
    abfs = f"abfs://{container}@{ACCOUNT}.dfs.core.windows.net/"
    expected = api.inspect(built.path).verdict
    for url in (f"{https}{PREFIX}", f"{abfs}{PREFIX}", f"abfs://{container}/{PREFIX}"):
        assert api.inspect(url, endpoint_url=azure.endpoint).verdict == expected
        assert api.inspect(url, endpoint_url=azure.endpoint, account=ACCOUNT).verdict == expected
        inspected = json.loads(run_cli(["inspect", url, "--endpoint-url", azure.endpoint, "--json"], code=1).stdout)
        assert inspected["verdict"] == expected
    result = api.fix(f"{https}{PREFIX}", f"{https}fixed/", endpoint_url=azure.endpoint)
    assert result.verification.proof == PINNED
    assert azurite.keys(azure, container, "fixed/") == {path.name for path in built.path.iterdir()} | {
        "__optim_repair_0.distcp"
    }
    run_cli(["fix", f"{abfs}{PREFIX}", "--out", f"{abfs}abfs/", "--endpoint-url", azure.endpoint])
    resumed = dk.resume(azurite.download(azure, container, "abfs/", tmp_path / "abfs"), "adamw", "optim", False)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    for url in (f"{https}{PREFIX}", f"{abfs}{PREFIX}"):
        refused = run_cli(["inspect", url, "--account", "otheraccount", "--endpoint-url", azure.endpoint], code=2)
        assert "otheraccount" in refused.stderr and ACCOUNT in refused.stderr
        with pytest.raises(UsageError, match="not the --account otheraccount"):
            api.inspect(url, endpoint_url=azure.endpoint, account="otheraccount")
    with pytest.raises(UsageError, match="names its Azure account otherwise than the checkpoint does"):
        api.fix(f"az://{container}/{PREFIX}", f"{https}other/", endpoint_url=azure.endpoint)
    with pytest.raises(UsageError, match="names no container and account"):
        api.inspect(f"abfs://{container}@{ACCOUNT}.example.com/{PREFIX}", endpoint_url=azure.endpoint)
    assert azurite.keys(azure, container, "other/") == set()
