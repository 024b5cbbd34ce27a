"""A store that lies, drips, cuts, replays or loses answers (``tests.factories.faulty_store``, a proxy on 127.0.0.1
in front of the real S3 server), and runs that race each other: every fault ends in a documented exit code and
one line, nothing is written outside the checkpoint and ``--out``, and nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from optim_repair import api
from optim_repair.errors import InputError, shown_name
from optim_repair.formats.dcp import METADATA_FILE
from optim_repair.storage import answers, claim, names
from optim_repair.storage.s3 import S3Store
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import faulty_store, s3server, trainers
from tests.factories.built import Built
from tests.factories.faulty_store import Fault
from tests.factories.s3server import PREFIX

pytestmark = pytest.mark.usefixtures("environment")


@pytest.fixture(scope="module")
def proxy(server: s3server.Server) -> Iterator[faulty_store.FaultyProxy]:
    started = faulty_store.start(server.endpoint)
    yield started
    faulty_store.stop(started)


@pytest.fixture
def faulty(proxy: faulty_store.FaultyProxy) -> Iterator[faulty_store.FaultyProxy]:
    """The proxy, with no fault armed when the test ends."""
    proxy.disarm()
    yield proxy
    proxy.disarm()


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("optim-repair: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _files(root: Path) -> set[Path]:
    return {path for path in root.rglob("*")}


@pytest.mark.parametrize("form", ["absolute", "parent", "dot", "empty"])
def test_a_listed_name_outside_the_prefix_is_refused_where_it_is_listed(
    faulty: faulty_store.FaultyProxy, server: s3server.Server, stored: tuple[str, Built], tmp_path: Path, form: str
) -> None:
    """``run//home/u/x/.metadata`` joined onto a local directory is ``/home/u/x/.metadata``: each command that reads
    the listing refuses it (exit 4, naming it), and nothing is written outside the checkpoint and ``--out``."""
    bucket, _ = stored
    outside = tmp_path / "outside"
    name = {
        "absolute": f"{PREFIX}/{outside.relative_to('/')}/{METADATA_FILE}",
        "parent": f"{PREFIX}../../outside/{METADATA_FILE}",
        "dot": f"{PREFIX}./{METADATA_FILE}",
        "empty": f"{PREFIX}step//{METADATA_FILE}",
    }[form]
    faulty.arm(Fault("hostile-names", names=(name,)))
    source, endpoint = f"s3://{bucket}/{PREFIX}", ["--endpoint-url", faulty.endpoint]
    commands = [
        ["inspect", source],
        ["fix", source, "--out", f"s3://{bucket}/fixed/"],
        ["fix", source, "--out", tmp_path / "local"],
        ["inspect", dk.sharded_dcp(tmp_path / "model").path, "--model", source],
    ]
    before = _files(tmp_path)
    for command in commands:
        result = run_cli([*command, *endpoint], code=4)
        line = _one_line(result.stderr)
        assert "names a path outside its prefix" in line and name.rpartition("/")[0][len(PREFIX) :] in line
    assert faulty.hits["hostile-names"] >= len(commands)
    assert _files(tmp_path) == before and not outside.exists()
    assert s3server.keys(server, bucket, "fixed/") == set()


@pytest.mark.parametrize("name", ["a\x00.distcp", "a\x1b]0;x\x07.distcp"])
def test_a_listed_name_no_file_can_have_is_refused_where_it_is_listed(
    faulty: faulty_store.FaultyProxy, stored: tuple[str, Built], tmp_path: Path, name: str
) -> None:
    """A listing asked with ``encoding-type=url`` (as botocore asks) can spell a NUL as ``%00``: it made the download
    of ``fix --out DIR`` fail ("embedded null byte", exit 70). It is refused where it is listed, before anything
    is downloaded, and shown escaped."""
    bucket, _ = stored
    faulty.arm(Fault("hostile-names", names=(f"{PREFIX}{name}",)))
    before = _files(tmp_path)
    for args in (["inspect", f"s3://{bucket}/{PREFIX}"], ["fix", f"s3://{bucket}/{PREFIX}", "--out", tmp_path / "out"]):
        result = run_cli([*args, "--endpoint-url", faulty.endpoint], code=4)
        line = _one_line(result.stderr)
        assert f"{shown_name(f's3://{bucket}/{PREFIX}{name}')}: is listed by a name holding a NUL" in line
        assert "downloading" not in result.stderr
    assert faulty.hits["hostile-names"] == 2 and _files(tmp_path) == before


def test_a_listing_whose_token_repeats_is_exit_4(faulty: faulty_store.FaultyProxy, stored: tuple[str, Built]) -> None:
    bucket, _ = stored
    faulty.arm(Fault("repeat-token"))
    result = run_cli(["inspect", f"s3://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    assert "repeats its listing" in _one_line(result.stderr)
    assert faulty.hits["repeat-token"] == 2  # the first page, and its repetition


@pytest.mark.parametrize(
    "contents",
    [
        "<Size>1</Size><Size>2</Size>",
        f"<Size>{'9' * 5000}</Size>",
        "<Size>1</Size><LastModified>no time</LastModified>",
    ],
    ids=["two sizes", "a size of 5,000 digits", "a time of no time"],
)
def test_a_listing_botocore_cannot_read_is_exit_4(
    faulty: faulty_store.FaultyProxy, stored: tuple[str, Built], tmp_path: Path, contents: str
) -> None:
    """botocore reads a ``<Contents>`` element by its model: two ``<Size>`` elements went to int() as a list
    (TypeError), a size of 5,000 digits past Python's digit limit and a time of no time raised ValueError, all exit
    70. Each is an answer the store got wrong."""
    bucket, _ = stored
    body = (
        '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>{bucket}</Name><Prefix>{PREFIX}</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
        f'<IsTruncated>false</IsTruncated><Contents><Key>{PREFIX}{METADATA_FILE}</Key><ETag>"0"</ETag>{contents}'
        "</Contents></ListBucketResult>"
    ).encode()
    faulty.arm(Fault("answer-body", method="GET", match="list-type=2", body=body))
    before = _files(tmp_path)
    result = run_cli(
        ["fix", f"s3://{bucket}/{PREFIX}", "--out", tmp_path / "out", "--endpoint-url", faulty.endpoint], code=4
    )
    assert f"s3://{bucket}/{PREFIX}: answered with what botocore cannot read" in _one_line(result.stderr)
    assert faulty.hits["answer-body"] >= 1 and _files(tmp_path) == before


def test_a_listing_past_its_memory_budget_is_exit_4(
    stored: tuple[str, Built], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names a listing keeps are bounded by the memory they take, not by their count alone: 4.4 million tiny
    objects under the count's limit took over 1 GiB. With a budget of three names, the three objects of this
    checkpoint are refused at the third."""
    bucket, _ = stored
    monkeypatch.setattr(names, "LISTED_BYTES", 3 * names.NAME_OVERHEAD)
    before = _files(tmp_path)
    result = run_cli(["fix", f"s3://{bucket}/{PREFIX}", "--out", tmp_path / "out"], code=4)
    line = _one_line(result.stderr)
    assert f"s3://{bucket}/{PREFIX}: lists more names than {3 * names.NAME_OVERHEAD:,} bytes of memory hold" in line
    assert _files(tmp_path) == before


def test_a_store_that_ignores_range_is_refused_before_its_body_is_read(
    faulty: faulty_store.FaultyProxy, stored: tuple[str, Built]
) -> None:
    bucket, _ = stored
    faulty.arm(Fault("ignore-range"))
    with pytest.raises(InputError, match=r"answered a read by range with its whole body \(HTTP 200, not 206\)"):
        api.inspect(f"s3://{bucket}/{PREFIX}", endpoint_url=faulty.endpoint)
    result = run_cli(["inspect", f"s3://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    assert "not 206" in _one_line(result.stderr)
    assert faulty.hits["ignore-range"] >= 1


def test_a_content_range_of_more_digits_than_a_size_has_is_refused_unread(
    faulty: faulty_store.FaultyProxy, stored: tuple[str, Built], tmp_path: Path
) -> None:
    """A Content-Range whose total has 5,000 digits went to int(), past Python's limit on the digits it converts
    (ValueError, exit 70)."""
    bucket, _ = stored
    given = f"bytes 0-9/{'9' * 5000}"
    faulty.arm(Fault("answer-headers", method="GET", header="range", headers=(("Content-Range", given),)))
    before = _files(tmp_path)
    result = run_cli(
        ["fix", f"s3://{bucket}/{PREFIX}", "--out", tmp_path / "out", "--endpoint-url", faulty.endpoint], code=4
    )
    assert f"answered a read by range with a Content-Range of no range ({given[:100]})" in _one_line(result.stderr)
    assert faulty.hits["answer-headers"] >= 1 and _files(tmp_path) == before


def test_a_store_that_drips_is_given_up_past_the_grace(
    faulty: faulty_store.FaultyProxy, stored: tuple[str, Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore's read timeout is per socket read: a byte a second never trips it. The floor does."""
    bucket, _ = stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    faulty.arm(Fault("drip", method="GET", match=METADATA_FILE, delay=0.2))
    started = time.monotonic()
    result = run_cli(["inspect", f"s3://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    assert "answers too slowly" in _one_line(result.stderr)
    assert time.monotonic() - started < 10


def test_a_listing_that_drips_is_given_up_at_its_deadline(
    faulty: faulty_store.FaultyProxy, stored: tuple[str, Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing's answer is read whole by botocore, past the floor's reach: it has a deadline of its own (the
    grace, and a page's worth of bytes at the floor's pace; lowered here to two seconds). Its answer drips for about
    fifteen."""
    bucket, _ = stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    monkeypatch.setattr(answers, "WHOLE_ANSWER_BYTES", answers.FLOOR_BYTES_PER_SECOND)
    faulty.arm(Fault("drip", method="GET", match="list-type=2", delay=0.01))
    started = time.monotonic()
    result = run_cli(["inspect", f"s3://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    line = _one_line(result.stderr)
    assert f"s3://{bucket}/{PREFIX}: did not answer in time (no answer from {faulty.endpoint} within 2 s)" in line
    assert time.monotonic() - started < 8
    assert faulty.hits["drip"] == 1


def test_a_get_object_redirected_is_exit_4_naming_where_it_pointed(
    faulty: faulty_store.FaultyProxy, elsewhere: faulty_store.Elsewhere, stored: tuple[str, Built]
) -> None:
    """botocore follows no redirect (a 307 was exit 4 already, as 'the store refused the request (307: Temporary
    Redirect)'); the message names where it pointed now."""
    bucket, _ = stored
    faulty.arm(Fault("redirect", method="GET", match=METADATA_FILE, location=elsewhere.endpoint))
    result = run_cli(["inspect", f"s3://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    line = _one_line(result.stderr)
    assert faulty.hits["redirect"] >= 1
    assert line == (
        f"optim-repair: error: s3://{bucket}/{PREFIX}{METADATA_FILE}: answered with a redirect (HTTP 307) to "
        f"{elsewhere.endpoint}, which is not followed"
    )
    assert elsewhere.requests == []


def test_a_get_object_whose_headers_drip_is_given_up_at_its_deadline(
    faulty: faulty_store.FaultyProxy, stored: tuple[str, Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GetObject's status line and headers one byte at a time, without end, never trip botocore's read timeout,
    which is per socket read; the request's deadline (lowered here to two seconds) does."""
    bucket, _ = stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    monkeypatch.setattr(answers, "WHOLE_ANSWER_BYTES", answers.FLOOR_BYTES_PER_SECOND)
    faulty.arm(Fault("drip-headers", method="GET", match=METADATA_FILE, delay=0.05))
    result = run_cli(["inspect", f"s3://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    assert _one_line(result.stderr) == (
        f"optim-repair: error: s3://{bucket}/{PREFIX}{METADATA_FILE}: did not answer in time (no answer from "
        f"{faulty.endpoint} within 2 s)"
    )
    assert faulty.hits["drip-headers"] >= 1


def test_a_body_cut_off_is_exit_4_naming_the_key(faulty: faulty_store.FaultyProxy, stored: tuple[str, Built]) -> None:
    bucket, _ = stored
    faulty.arm(Fault("cut", method="GET", match=METADATA_FILE, after=10))
    result = run_cli(["inspect", f"s3://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    line = _one_line(result.stderr)
    assert f"s3://{bucket}/{PREFIX}{METADATA_FILE}: the store's answer was cut off after 10 of " in line


@pytest.mark.parametrize("lost", ["metadata", "shard copy"])
def test_a_write_whose_answer_was_lost_is_known_for_the_runs_own(
    faulty: faulty_store.FaultyProxy, server: s3server.Server, stored: tuple[str, Built], tmp_path: Path, lost: str
) -> None:
    """The write took effect, its answer was lost (500), botocore retried, and the retry's no-replace got 412: the
    run reads the key back, finds its own object, and goes on."""
    bucket, built = stored
    match = f"fixed/{METADATA_FILE}" if lost == "metadata" else "fixed/__0_0.distcp"
    faulty.arm(Fault("lose-answer", method="PUT", match=match, times=1))
    result = run_cli(
        ["fix", f"s3://{bucket}/{PREFIX}", "--out", f"s3://{bucket}/fixed/", "--endpoint-url", faulty.endpoint]
    )
    assert faulty.hits["lose-answer"] == 1, result.stderr
    copied = s3server.keys(server, bucket, "fixed/")
    assert copied == {path.name for path in built.path.iterdir()} | {"__optim_repair_0.distcp"}
    local = s3server.download(server, bucket, "fixed/", tmp_path / "fixed")
    resumed = dk.resume(local, "adamw", "optim", False)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def _spliceable(tmp_path: Path) -> Path:
    """A torch file, keyed by names, large enough to be spliced by a multipart upload (its storages over 5 MiB)."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(1500, 1500), "unused": torch.nn.Linear(8, 8)})
    optimizer = torch.optim.AdamW(model.parameters())
    model["used"](torch.randn(2, 1500)).sum().backward()
    optimizer.step()
    path = tmp_path / "in" / "optimizer.pt"
    path.parent.mkdir()
    torch.save(get_optimizer_state_dict(model, optimizer), path)
    return path


def test_a_failed_completion_and_a_failed_abort_leave_nothing_at_the_output(
    faulty: faulty_store.FaultyProxy, server: s3server.Server, tmp_path: Path
) -> None:
    path = _spliceable(tmp_path)
    bucket = s3server.new_bucket(server)
    s3server.upload(server, path.parent, bucket, "run/")
    faulty.arm(Fault("fail", method="POST", match="uploadId="), Fault("fail", method="DELETE", match="uploadId="))
    command = ["fix", f"s3://{bucket}/run/optimizer.pt", "--out", f"s3://{bucket}/fixed/", "--fill", "empty"]
    result = run_cli([*command, "--endpoint-url", faulty.endpoint], code=5)
    assert "the store refused the request (InternalError" in _one_line(result.stderr)
    assert faulty.hits["fail"] >= 2  # the completion, and the abort
    assert s3server.keys(server, bucket, "fixed/") == set()  # no object, no marker
    faulty.disarm()
    again = run_cli([*command, "--endpoint-url", faulty.endpoint])
    assert "aborted 1 unfinished upload a stopped run left" in again.stderr
    assert s3server.keys(server, bucket, "fixed/") == {"optimizer.pt"}


def test_credentials_in_the_endpoint_are_never_shown(stored: tuple[str, Built], server: s3server.Server) -> None:
    bucket, _ = stored
    host = server.endpoint.removeprefix("http://")
    for args in (["inspect", f"s3://{bucket}/{PREFIX}"], ["inspect", f"s3://{bucket}/{PREFIX}", "--json"]):
        result = run_cli([*args, "--endpoint-url", f"http://AKIDKEY:TOPSECRET@{host}"], code=2)
        assert "TOPSECRET" not in result.stderr + result.stdout and "AKIDKEY" not in result.stderr + result.stdout
        if "--json" in args:
            assert json.loads(result.stdout)["error"]["code"] == "usage"
        else:
            assert f"http://{host}: an endpoint URL holds no credentials" in _one_line(result.stderr)


@pytest.mark.parametrize("endpoint", ["ftp://127.0.0.1", "http://127.0.0.1:99999", "http://[::1", "http://"])
def test_a_malformed_endpoint_is_a_usage_error(stored: tuple[str, Built], endpoint: str) -> None:
    bucket, _ = stored
    result = run_cli(["inspect", f"s3://{bucket}/{PREFIX}", "--endpoint-url", endpoint], code=2)
    assert "is not an endpoint URL" in _one_line(result.stderr)


def test_force_deletes_nothing_before_a_splice_is_known_to_succeed(server: s3server.Server, tmp_path: Path) -> None:
    path = _spliceable(tmp_path)
    bucket = s3server.new_bucket(server)
    s3server.upload(server, path.parent, bucket, "run/")
    server.client().put_object(Bucket=bucket, Key="fixed/optimizer.pt", Body=b"the user's own")
    command = ["fix", f"s3://{bucket}/run/optimizer.pt", "--out", f"s3://{bucket}/fixed/", "--force"]
    result = run_cli([*command, "--drop", r"^used\.bias$"], code=2)
    assert "dropping state from a torch file in a store is done into a local copy" in _one_line(result.stderr)
    body = server.client().get_object(Bucket=bucket, Key="fixed/optimizer.pt")["Body"].read()
    assert body == b"the user's own" and s3server.keys(server, bucket, "fixed/") == {"optimizer.pt"}


def test_a_marker_that_no_run_wrote_is_never_taken_for_one(server: s3server.Server, stored: tuple[str, Built]) -> None:
    """A prefix holding an object named as the marker beside a user's objects is not emptied without force."""
    bucket, _ = stored
    client = server.client()
    client.put_object(Bucket=bucket, Key=f"fixed/{claim.MARKER}", Body=b"not a marker")
    client.put_object(Bucket=bucket, Key="fixed/notes.txt", Body=b"keep me")
    result = run_cli(["fix", f"s3://{bucket}/{PREFIX}", "--out", f"s3://{bucket}/fixed/"], code=5)
    assert "is not a marker optim-repair wrote" in _one_line(result.stderr)
    assert s3server.keys(server, bucket, "fixed/") == {claim.MARKER, "notes.txt"}


def test_a_live_runs_marker_is_refused_and_a_stopped_runs_cleared_only_of_what_it_wrote(
    server: s3server.Server, stored: tuple[str, Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, _ = stored
    store = S3Store(bucket)
    marker = f"fixed/{claim.MARKER}"
    monkeypatch.setenv(claim.LEASE_VARIABLE, "2")
    held = claim.Claim(store, marker, ["fixed/a", "fixed/b", "fixed/c"])
    held.take(lambda _: None)
    held.writing("fixed/a", lambda: store.put_bytes("fixed/a", b"the stopped run's"))
    server.client().put_object(Bucket=bucket, Key="fixed/b", Body=b"another writer's, under a planned name")
    result = run_cli(["fix", f"s3://{bucket}/{PREFIX}", "--out", f"s3://{bucket}/fixed/"], code=5)
    assert "is writing a copy here" in _one_line(result.stderr)
    held._stop_renewing()  # the run stops renewing, as a killed one does
    time.sleep(3.1)
    result = run_cli(["fix", f"s3://{bucket}/{PREFIX}", "--out", f"s3://{bucket}/fixed/"], code=5)
    assert "removing 1 object a stopped run left" in result.stderr
    assert "already holds objects" in _one_line(result.stderr)  # the other writer's object is kept, and refused
    assert s3server.keys(server, bucket, "fixed/") == {"b"}


def test_the_run_whose_claim_was_taken_over_does_not_commit(server: s3server.Server, stored: tuple[str, Built]) -> None:
    bucket, _ = stored
    store = S3Store(bucket)
    marker = f"fixed/{claim.MARKER}"
    held = claim.Claim(store, marker, ["fixed/a"])
    held.take(lambda _: None)
    held._stop_renewing()
    server.client().delete_object(Bucket=bucket, Key=marker)  # another run cleared it after its lease lapsed
    with pytest.raises(Exception, match="this run's claim was taken over by another run"):
        held.commit(lambda: store.put_bytes("fixed/a", b"late"))
    assert s3server.keys(server, bucket, "fixed/") == set()


@pytest.mark.parametrize("source", ["store", "disk"])
def test_of_two_fixes_into_one_prefix_at_most_one_succeeds_and_its_copy_loads(
    server: s3server.Server, stored: tuple[str, Built], tmp_path: Path, source: str
) -> None:
    """Every node of a job runs the resume script: 20 trials of two fixes at once into one prefix."""
    bucket, built = stored
    checkpoint = f"s3://{bucket}/{PREFIX}" if source == "store" else str(built.path)
    expected = {path.name for path in built.path.iterdir()} | {"__optim_repair_0.distcp"}
    for trial in range(20):
        out = f"race-{source}-{trial}/"
        command = [sys.executable, "-m", "optim_repair", "fix", checkpoint, "--out", f"s3://{bucket}/{out}"]
        runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        answers = [(run.wait(timeout=120), run.stderr.read() if run.stderr else "") for run in runs]
        for run in runs:
            run.stdout.close() if run.stdout else None
            run.stderr.close() if run.stderr else None
        codes = sorted(code for code, _ in answers)
        assert codes in ([0, 5], [5, 5]), answers
        for code, stderr in answers:
            if code == 5:
                assert "is writing a copy here" in stderr or "already holds objects" in stderr, stderr
        left = s3server.keys(server, bucket, out)
        if codes == [0, 5]:
            assert left == expected, (answers, left)  # the winner's copy, whole: the loser deleted none of it
            local = s3server.download(server, bucket, out, tmp_path / out)
            dk.resume(local, "adamw", "optim", False, steps=0)
        else:
            assert left == set()


def test_dry_run_and_latest_work_on_a_store(server: s3server.Server, stored: tuple[str, Built], tmp_path: Path) -> None:
    bucket, built = stored
    s3server.upload(server, built.path, bucket, "run/step-3/")
    s3server.upload(server, built.path, bucket, "run/step-10/")
    client = server.client()
    client.delete_object(Bucket=bucket, Key=f"run/step-10/{METADATA_FILE}")  # still being saved
    assert api.latest_checkpoint(f"s3://{bucket}/run/") == f"s3://{bucket}/run/step-3/"
    result = run_cli(
        ["fix", f"s3://{bucket}/run/", "--latest", "--out", f"s3://{bucket}/fixed/", "--dry-run", "--json"]
    )
    planned = json.loads(result.stdout)
    assert planned["dry_run"] is True and planned["free_bytes"] is None and planned["added"]
    assert f"newest complete step: s3://{bucket}/run/step-3/" in result.stderr
    assert s3server.keys(server, bucket, "fixed/") == set()
    local = api.dry_run(f"s3://{bucket}/run/step-3/", tmp_path / "local")
    assert local.free_bytes is not None and local.bytes_to_write > 0 and not (tmp_path / "local").exists()
    up = api.dry_run(built.path, f"s3://{bucket}/up/")
    assert up.free_bytes is None and up.out == f"s3://{bucket}/up/"


def test_a_local_checkpoint_is_uploaded_without_writing_beside_it(
    server: s3server.Server, stored: tuple[str, Built]
) -> None:
    bucket, built = stored
    beside = sorted(os.listdir(built.path.parent))
    inside = sorted(os.listdir(built.path))
    result = run_cli(["fix", built.path, "--out", f"s3://{bucket}/uploaded/"])
    assert str(built.path.parent) not in result.stderr.replace(str(built.path), "")
    assert sorted(os.listdir(built.path.parent)) == beside and sorted(os.listdir(built.path)) == inside
    assert METADATA_FILE in s3server.keys(server, bucket, "uploaded/")


def test_a_killed_uploads_temporary_is_removed_by_the_next_run(
    server: s3server.Server, stored: tuple[str, Built], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staged copy of an upload lives under TMPDIR, locked while its run lives; one left by a killed run (no
    lock, older than the staleness) is removed by the next upload, which says so."""
    bucket, built = stored
    private = tmp_path / "tmpdir"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    left = private / ".optim-repair-upload.optim-repair-tmp-0badc0de"
    (left / "checkpoint-3").mkdir(parents=True)
    os.utime(left, (time.time() - 60, time.time() - 60))
    notices: list[str] = []
    api.fix(built.path, f"s3://{bucket}/uploaded/", notice=notices.append)
    assert f"removed {left}, a temporary copy left by a run that was killed" in notices
    assert list(private.iterdir()) == []


def test_a_single_objects_claim_aborts_only_that_objects_unfinished_uploads(
    server: s3server.Server, tmp_path: Path
) -> None:
    """A killed run's upload to the output key is aborted; another object's beside it, whose name the key begins
    (``optimizer.pth`` beside ``optimizer.pt``: maybe a live run's), is not this claim's and stays."""
    path = _spliceable(tmp_path)
    bucket = s3server.new_bucket(server)
    client = server.client()
    uploads = {key: client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
               for key in ("single/optimizer.pt", "single/optimizer.pth")}  # fmt: skip
    notices: list[str] = []
    api.fix(path, f"s3://{bucket}/single/optimizer.pt", notice=notices.append)
    assert f"aborted 1 unfinished upload a stopped run left at s3://{bucket}/single/optimizer.pt" in notices
    left = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [(upload["Key"], upload["UploadId"]) for upload in left] == [
        ("single/optimizer.pth", uploads["single/optimizer.pth"])
    ]


def test_a_stopped_runs_marker_cannot_name_keys_outside_what_it_claimed(
    server: s3server.Server, stored: tuple[str, Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A marker is an object anyone with write access may have put: the keys it lists are cleaned up only inside
    the prefix it claims, even where they carry its run's id."""
    bucket, _ = stored
    store = S3Store(bucket)
    monkeypatch.setenv(claim.LEASE_VARIABLE, "1")
    held = claim.Claim(store, f"fixed/{claim.MARKER}", ["fixed/a", "elsewhere/b"])
    held.take(lambda _: None)
    held.writing("fixed/a", lambda: store.put_bytes("fixed/a", b"inside"))
    held.writing("elsewhere/b", lambda: store.put_bytes("elsewhere/b", b"outside"))
    held._stop_renewing()
    time.sleep(2.1)
    run_cli(["fix", f"s3://{bucket}/{PREFIX}", "--out", f"s3://{bucket}/fixed/"])
    assert "b" in s3server.keys(server, bucket, "elsewhere/") and "a" not in s3server.keys(server, bucket, "fixed/")


def test_an_answer_without_the_objects_etag_is_exit_4_or_5_and_leaves_nothing(
    faulty: faulty_store.FaultyProxy, server: s3server.Server, stored: tuple[str, Built], tmp_path: Path
) -> None:
    """botocore leaves out what an answer lacks: a read of a torch file's end, or a write's answer, without an ETag
    was a KeyError (exit 70). A read is exit 4; a write exit 5, and the run removes what it wrote."""
    built = trainers.hf_trainer(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, "run/")
    faulty.arm(Fault("answer-headers", method="GET", headers=(("ETag", None),)))
    result = run_cli(["inspect", f"s3://{bucket}/run/optimizer.pt", "--endpoint-url", faulty.endpoint], code=4)
    assert f"s3://{bucket}/run/optimizer.pt: answered without the object's ETag" in _one_line(result.stderr)
    source, _ = stored
    faulty.arm(Fault("answer-headers", method="PUT", match="fixed/__optim_repair_0", headers=(("ETag", None),)))
    command = ["fix", f"s3://{source}/{PREFIX}", "--out", f"s3://{source}/fixed/", "--endpoint-url", faulty.endpoint]
    result = run_cli(command, code=5)
    assert f"s3://{source}/fixed/__optim_repair_0.distcp: answered without the object's ETag" in _one_line(
        result.stderr
    )
    assert faulty.hits["answer-headers"] == 1 and s3server.keys(server, source, "fixed/") == set()


def test_a_whole_object_for_a_range_that_is_the_whole_object_is_accepted(
    faulty: faulty_store.FaultyProxy, server: s3server.Server, tmp_path: Path
) -> None:
    """A server may answer a range with 200 and the whole body (RFC 9110): where the range asked was the whole
    object, that is what was asked, and a torch file smaller than the tail read is read so."""
    built = trainers.hf_trainer(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, "run/")
    faulty.arm(Fault("ignore-range"))
    diagnosis = api.inspect(f"s3://{bucket}/run/optimizer.pt", endpoint_url=faulty.endpoint)
    assert diagnosis.verdict in ("healthy", "repairable") and faulty.hits["ignore-range"] >= 1
