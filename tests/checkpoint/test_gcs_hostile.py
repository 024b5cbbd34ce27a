"""A hostile or faulty GCS: the faulty proxy of ``tests.factories.faulty_store`` in front of the real emulator
(its faults that know no protocol: ranges ignored, drips, cuts, lost and failed answers), names a bucket may
really hold, and runs that race or are stopped. What the emulator does not check is said where it matters."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from optim_repair import api
from optim_repair.errors import InputError, UsageError, shown_name
from optim_repair.formats.dcp import METADATA_FILE
from optim_repair.storage import answers, names
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories import faulty_store, gcsserver
from tests.factories.built import Built
from tests.factories.faulty_store import Fault
from tests.factories.gcsserver import PREFIX

pytestmark = pytest.mark.usefixtures("gcs_environment")


@pytest.fixture(scope="module")
def proxy(gcs: gcsserver.Server) -> Iterator[faulty_store.FaultyProxy]:
    started = faulty_store.start(gcs.endpoint)
    yield started
    faulty_store.stop(started)


@pytest.fixture
def faulty(proxy: faulty_store.FaultyProxy) -> Iterator[faulty_store.FaultyProxy]:
    proxy.disarm()
    yield proxy
    proxy.disarm()


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("optim-repair: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_name_outside_the_prefix_is_refused_where_it_is_listed(
    gcs: gcsserver.Server, gcs_stored: tuple[str, Built]
) -> None:
    """GCS takes any name: ``..`` and empty segments are names it really holds, and would lead a download outside
    the directory it fills."""
    bucket, _ = gcs_stored
    gcsserver.put(gcs, bucket, f"{PREFIX}../../escaped.distcp", b"x")
    result = run_cli(["inspect", f"gs://{bucket}/{PREFIX}"], code=4)
    assert "names a path outside its prefix" in _one_line(result.stderr)


@pytest.mark.parametrize("name", ["../../outside/.metadata", "a//b.distcp", "/etc/x.distcp", "x" * 1100])
def test_a_listed_name_outside_the_prefix_is_refused_where_it_is_listed(
    faulty: faulty_store.FaultyProxy, gcs_stored: tuple[str, Built], tmp_path: Path, name: str
) -> None:
    """A store that lies in its listing: a name that would lead outside the directory a download fills."""
    bucket, _ = gcs_stored
    faulty.arm(Fault("hostile-names", names=(f"{PREFIX}{name}",)))
    result = run_cli(
        ["fix", f"gs://{bucket}/{PREFIX}", "--out", tmp_path / "out", "--endpoint-url", faulty.endpoint], code=4
    )
    assert "names a path outside its prefix" in _one_line(result.stderr)
    assert not (tmp_path / "out").exists() and not (tmp_path / "outside").exists()


@pytest.mark.parametrize("name", ["a\x00.distcp", "a\udc80.distcp", "a\x1b]0;x\x07.distcp"])
def test_a_listed_name_no_file_can_have_is_refused_where_it_is_listed(
    faulty: faulty_store.FaultyProxy, gcs_stored: tuple[str, Built], tmp_path: Path, name: str
) -> None:
    """GCS's JSON can spell a NUL, a lone surrogate (no UTF-8 text) or an escape in a name: the first made the
    download of ``fix --out DIR`` fail ("embedded null byte"), the second could not be encoded (both exit 70).
    Each is refused where it is listed, before anything is downloaded, and shown escaped."""
    bucket, _ = gcs_stored
    faulty.arm(Fault("hostile-names", names=(f"{PREFIX}{name}",)))
    before = set(tmp_path.rglob("*"))
    for args in (["inspect", f"gs://{bucket}/{PREFIX}"], ["fix", f"gs://{bucket}/{PREFIX}", "--out", tmp_path / "out"]):
        result = run_cli([*args, "--endpoint-url", faulty.endpoint], code=4)
        line = _one_line(result.stderr)
        assert f"{shown_name(f'gs://{bucket}/{PREFIX}{name}')}: is listed by a name holding a NUL" in line
        assert "downloading" not in result.stderr
    assert faulty.hits["hostile-names"] == 2 and set(tmp_path.rglob("*")) == before


def test_a_listing_whose_page_token_repeats_is_exit_4(
    faulty: faulty_store.FaultyProxy, gcs_stored: tuple[str, Built]
) -> None:
    bucket, _ = gcs_stored
    faulty.arm(Fault("repeat-token"))
    result = run_cli(["inspect", f"gs://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    assert "the store repeats its listing" in _one_line(result.stderr)  # its first page came twice
    assert faulty.hits["repeat-token"] == 2


def test_a_listing_nested_deeper_than_any_answer_is_refused_unparsed(
    faulty: faulty_store.FaultyProxy, gcs_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """A listing's page of 200,000 nested arrays (400 KB, under a page's cap) made Python's JSON parser recurse
    past its limit (RecursionError, exit 70): it is refused before it is parsed."""
    bucket, _ = gcs_stored
    body = b'{"items": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    faulty.arm(Fault("answer-body", method="GET", match="prefix=", body=body))
    before = set(tmp_path.rglob("*"))
    result = run_cli(
        ["fix", f"gs://{bucket}/{PREFIX}", "--out", tmp_path / "out", "--endpoint-url", faulty.endpoint], code=4
    )
    assert f"gs://{bucket}/{PREFIX}: answered with JSON nested deeper than 32 levels" in _one_line(result.stderr)
    assert faulty.hits["answer-body"] == 1 and set(tmp_path.rglob("*")) == before


def test_a_listing_past_its_memory_budget_is_exit_4(
    gcs_stored: tuple[str, Built], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names a listing keeps are bounded by the memory they take, not by their count alone: 4.4 million tiny
    objects under the count's limit took over 1 GiB. With a budget of three names, the three objects of this
    checkpoint are refused at the third."""
    bucket, _ = gcs_stored
    monkeypatch.setattr(names, "LISTED_BYTES", 3 * names.NAME_OVERHEAD)
    before = set(tmp_path.rglob("*"))
    result = run_cli(["fix", f"gs://{bucket}/{PREFIX}", "--out", tmp_path / "out"], code=4)
    line = _one_line(result.stderr)
    assert f"gs://{bucket}/{PREFIX}: lists more names than {3 * names.NAME_OVERHEAD:,} bytes of memory hold" in line
    assert set(tmp_path.rglob("*")) == before


def test_a_store_that_ignores_range_is_refused_before_its_body_is_read(
    faulty: faulty_store.FaultyProxy, gcs_stored: tuple[str, Built]
) -> None:
    bucket, _ = gcs_stored
    faulty.arm(Fault("ignore-range"))
    with pytest.raises(InputError, match=r"answered a read by range with its whole body \(HTTP 200, not 206\)"):
        api.inspect(f"gs://{bucket}/{PREFIX}", endpoint_url=faulty.endpoint)
    assert faulty.hits["ignore-range"] >= 1


def test_a_content_range_of_more_digits_than_a_size_has_is_refused_unread(
    faulty: faulty_store.FaultyProxy, gcs_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """A Content-Range whose total has 5,000 digits went to int(), past Python's limit on the digits it converts
    (ValueError, exit 70)."""
    bucket, _ = gcs_stored
    given = f"bytes 0-9/{'9' * 5000}"
    faulty.arm(Fault("answer-headers", method="GET", header="range", headers=(("Content-Range", given),)))
    before = set(tmp_path.rglob("*"))
    result = run_cli(
        ["fix", f"gs://{bucket}/{PREFIX}", "--out", tmp_path / "out", "--endpoint-url", faulty.endpoint], code=4
    )
    assert f"answered a read by range with a Content-Range of no range ({given[:100]})" in _one_line(result.stderr)
    assert faulty.hits["answer-headers"] >= 1 and set(tmp_path.rglob("*")) == before


def test_a_store_that_drips_is_given_up_past_the_grace(
    faulty: faulty_store.FaultyProxy, gcs_stored: tuple[str, Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, _ = gcs_stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    faulty.arm(Fault("drip", method="GET", match="alt=media", delay=0.2))
    started = time.monotonic()
    result = run_cli(["inspect", f"gs://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    assert "answers too slowly" in _one_line(result.stderr)
    assert time.monotonic() - started < 10


def test_a_listing_that_drips_is_given_up_at_its_deadline(
    faulty: faulty_store.FaultyProxy, gcs_stored: tuple[str, Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, _ = gcs_stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    monkeypatch.setattr(answers, "WHOLE_ANSWER_BYTES", answers.FLOOR_BYTES_PER_SECOND)
    faulty.arm(Fault("drip", method="GET", match="prefix=", delay=0.01))
    started = time.monotonic()
    result = run_cli(["inspect", f"gs://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    assert "answers too slowly" in _one_line(result.stderr)
    assert time.monotonic() - started < 8


_REDIRECTED = [  # what a store's redirect hits, and the exit code of the command it fails
    pytest.param(Fault("redirect", method="GET", match="alt=media"), 4, id="redirect-read"),
    pytest.param(Fault("redirect", method="GET", match="prefix="), 4, id="redirect-listing"),
    pytest.param(Fault("redirect", method="POST", match="uploadType=multipart"), 5, id="redirect-upload"),
]


@pytest.mark.parametrize(("fault", "code"), _REDIRECTED)
def test_a_redirect_is_never_followed(
    faulty: faulty_store.FaultyProxy,
    elsewhere: faulty_store.Elsewhere,
    gcs: gcsserver.Server,
    gcs_stored: tuple[str, Built],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    fault: Fault,
    code: int,
) -> None:
    """A 307 to another origin: requests would follow it for a read (its bytes then judged as the store's) and,
    for an upload, send the body there."""
    bucket, _ = gcs_stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    monkeypatch.setattr(answers, "WHOLE_ANSWER_BYTES", answers.FLOOR_BYTES_PER_SECOND)
    faulty.arm(
        Fault(fault.kind, method=fault.method, match=fault.match, delay=fault.delay, location=elsewhere.endpoint)
    )
    out = f"gs://{bucket}/fixed-{fault.kind}/"
    command = ["inspect", f"gs://{bucket}/{PREFIX}"] if code == 4 else ["fix", f"gs://{bucket}/{PREFIX}", "--out", out]
    result = run_cli([*command, "--endpoint-url", faulty.endpoint], code=code)
    line = _one_line(result.stderr)
    assert faulty.hits[fault.kind] >= 1
    if fault.kind == "redirect":
        assert f"answered with a redirect (HTTP 307) to {elsewhere.endpoint}, which is not followed" in line
    else:
        assert f"did not answer in time (no answer from {faulty.endpoint} within 2 s)" in line
    assert elsewhere.requests == []
    assert gcsserver.keys(gcs, bucket, f"fixed-{fault.kind}/") == set()
    assert not any(tmp_path.joinpath("in").glob("**/*optim_repair*"))


def test_a_redirect_is_shown_without_the_credentials_and_query_of_its_location(
    faulty: faulty_store.FaultyProxy, elsewhere: faulty_store.Elsewhere, gcs_stored: tuple[str, Built]
) -> None:
    bucket, _ = gcs_stored
    host = elsewhere.endpoint.removeprefix("http://")
    faulty.arm(Fault("redirect", method="GET", match="alt=media", location=f"http://KEY:TOPSECRET@{host}"))
    result = run_cli(["inspect", f"gs://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    assert _one_line(result.stderr).endswith(
        f": answered with a redirect (HTTP 307) to {elsewhere.endpoint}, which is not followed"
    )
    assert "TOPSECRET" not in result.stderr + result.stdout and "alt=media" not in result.stderr
    assert elsewhere.requests == []


_DRIPPED = [  # what a store's dripped headers hit, and the exit code of the command it fails
    pytest.param(Fault("drip-headers", method="GET", match="alt=media", delay=0.05), 4, id="read"),
    pytest.param(Fault("drip-headers", method="GET", match="prefix=", delay=0.05), 4, id="listing"),
    pytest.param(Fault("drip-headers", method="POST", match="uploadType=multipart", delay=0.05), 5, id="upload"),
]


@pytest.mark.parametrize(("fault", "code"), _DRIPPED)
def test_dripped_headers_are_given_up_at_the_requests_deadline(
    faulty: faulty_store.FaultyProxy,
    gcs: gcsserver.Server,
    gcs_stored: tuple[str, Built],
    monkeypatch: pytest.MonkeyPatch,
    fault: Fault,
    code: int,
) -> None:
    """A status line and headers one byte at a time, without end: the per-read timeout never trips; the request's
    deadline, from its first byte sent (lowered here to two seconds), does."""
    bucket, _ = gcs_stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    monkeypatch.setattr(answers, "WHOLE_ANSWER_BYTES", answers.FLOOR_BYTES_PER_SECOND)
    faulty.arm(fault)
    out = f"gs://{bucket}/fixed-dripped/"
    command = ["inspect", f"gs://{bucket}/{PREFIX}"] if code == 4 else ["fix", f"gs://{bucket}/{PREFIX}", "--out", out]
    result = run_cli([*command, "--endpoint-url", faulty.endpoint], code=code)
    line = _one_line(result.stderr)
    assert f"did not answer in time (no answer from {faulty.endpoint} within 2 s)" in line
    assert faulty.hits["drip-headers"] >= 1
    assert gcsserver.keys(gcs, bucket, "fixed-dripped/") == set()


def test_a_body_cut_off_is_exit_4_naming_the_key(
    faulty: faulty_store.FaultyProxy, gcs_stored: tuple[str, Built]
) -> None:
    bucket, _ = gcs_stored
    faulty.arm(Fault("cut", method="GET", match="metadata?alt=media", after=10))
    result = run_cli(["inspect", f"gs://{bucket}/{PREFIX}", "--endpoint-url", faulty.endpoint], code=4)
    assert f"gs://{bucket}/{PREFIX}{METADATA_FILE}: " in _one_line(result.stderr)


@pytest.mark.parametrize("lost", ["upload", "rewrite"])
def test_a_write_whose_answer_was_lost_is_known_for_the_runs_own(
    faulty: faulty_store.FaultyProxy, gcs: gcsserver.Server, gcs_stored: tuple[str, Built], tmp_path: Path, lost: str
) -> None:
    """The write took effect, its answer was lost (500), the transport retried. An upload's retry gets 412 (no
    object may be there) and the run reads the key back and finds its own. (The emulator ignores the precondition
    of a rewrite's destination, so that a rewrite's retry simply writes again: its 412 path is the upload's.)"""
    bucket, built = gcs_stored
    match = "uploadType=multipart" if lost == "upload" else "rewriteTo"
    faulty.arm(Fault("lose-answer", method="POST", match=match, times=1))
    result = run_cli(
        ["fix", f"gs://{bucket}/{PREFIX}", "--out", f"gs://{bucket}/fixed/", "--endpoint-url", faulty.endpoint]
    )
    assert faulty.hits["lose-answer"] == 1, result.stderr
    copied = gcsserver.keys(gcs, bucket, "fixed/")
    assert copied == {path.name for path in built.path.iterdir()} | {"__optim_repair_0.distcp"}
    local = gcsserver.download(gcs, bucket, "fixed/", tmp_path / "fixed")
    resumed = dk.resume(local, "adamw", "optim", False)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def test_a_failing_store_leaves_nothing_at_the_output(
    faulty: faulty_store.FaultyProxy, gcs: gcsserver.Server, gcs_stored: tuple[str, Built]
) -> None:
    bucket, _ = gcs_stored
    faulty.arm(Fault("fail", method="POST", match="rewriteTo", status=503))
    result = run_cli(
        ["fix", f"gs://{bucket}/{PREFIX}", "--out", f"gs://{bucket}/fixed/", "--endpoint-url", faulty.endpoint], code=5
    )
    assert "the store refused the request (HTTP 503" in _one_line(result.stderr)
    assert faulty.hits["fail"] >= 2  # retried by the transport before it gave up
    assert gcsserver.keys(gcs, bucket, "fixed/") == set()  # no object, no marker


@pytest.mark.parametrize("done", ["9" * 5000, "\u0663"], ids=["5,000 digits", "an Arabic-Indic digit"])
def test_a_rewrite_whose_progress_is_no_count_is_exit_5_and_leaves_nothing(
    faulty: faulty_store.FaultyProxy, gcs: gcsserver.Server, gcs_stored: tuple[str, Built], done: str
) -> None:
    """A rewrite's answer gives its bytes done as a string of digits: 5,000 of them went to int() past Python's
    digit limit, and a digit ``str.isdigit`` takes (Arabic-Indic three) was read as a number (exit 70 either way,
    or 3 bytes done). Either is refused as no progress, and what the run wrote is removed."""
    bucket, built = gcs_stored
    size = str((built.path / "__0_0.distcp").stat().st_size)
    body = json.dumps({"kind": "storage#rewriteResponse", "totalBytesRewritten": done, "objectSize": size}).encode()
    faulty.arm(Fault("answer-body", method="POST", match="__0_0.distcp/rewriteTo", body=body))
    result = run_cli(
        ["fix", f"gs://{bucket}/{PREFIX}", "--out", f"gs://{bucket}/fixed/", "--endpoint-url", faulty.endpoint], code=5
    )
    assert "answered a rewrite without its progress and the object's size" in _one_line(result.stderr)
    assert faulty.hits["answer-body"] >= 1 and gcsserver.keys(gcs, bucket, "fixed/") == set()


def test_credentials_in_the_endpoint_are_never_shown(gcs_stored: tuple[str, Built], gcs: gcsserver.Server) -> None:
    bucket, _ = gcs_stored
    host = gcs.endpoint.removeprefix("http://")
    result = run_cli(["inspect", f"gs://{bucket}/{PREFIX}", "--endpoint-url", f"http://KEY:TOPSECRET@{host}"], code=2)
    assert "TOPSECRET" not in result.stderr + result.stdout
    with pytest.raises(UsageError, match="is not an endpoint URL"):
        api.inspect(f"gs://{bucket}/{PREFIX}", endpoint_url="ftp://127.0.0.1")


def test_of_two_fixes_into_one_prefix_at_most_one_succeeds_and_its_copy_loads(
    gcs: gcsserver.Server, gcs_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """Every node of a job runs the resume script: 10 trials of two fixes at once into one prefix. The claim's
    marker is written with ``ifGenerationMatch=0``, which the emulator checks on uploads."""
    bucket, built = gcs_stored
    expected = {path.name for path in built.path.iterdir()} | {"__optim_repair_0.distcp"}
    for trial in range(10):
        out = f"race-{trial}/"
        command = [
            sys.executable,
            "-m",
            "optim_repair",
            "fix",
            f"gs://{bucket}/{PREFIX}",
            "--out",
            f"gs://{bucket}/{out}",
        ]
        runs = [
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)
        ]
        ended = [(run.wait(timeout=120), run.stderr.read() if run.stderr else "") for run in runs]
        for run in runs:
            run.stderr.close() if run.stderr else None
        codes = sorted(code for code, _ in ended)
        assert codes in ([0, 5], [5, 5]), ended
        left = gcsserver.keys(gcs, bucket, out)
        if codes == [0, 5]:
            assert left == expected, (ended, left)
            dk.resume(gcsserver.download(gcs, bucket, out, tmp_path / out), "adamw", "optim", False, steps=0)
        else:
            assert left == set()
