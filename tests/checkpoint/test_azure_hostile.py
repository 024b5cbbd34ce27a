"""A hostile or faulty Azure Blob store: the faulty proxy of ``tests.factories.faulty_store`` in front of the real
emulator (Azurite), reached as ``--endpoint-url http://127.0.0.1:PORT/devstoreaccount1`` with the SAS made from the
connection string in each query; names a container may really hold, XML that declares entities, and runs that
race. Through the proxy's ``copies-ranges``, a torch file's kept range is copied inside the store by Put Block From
URL, as the service does it and Azurite does not. What the emulator does not check is said where it matters."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from optim_repair import api
from optim_repair.errors import InputError, UsageError, shown_name
from optim_repair.formats.dcp import METADATA_FILE
from optim_repair.storage import answers, names
from tests.conftest import run_cli
from tests.factories import azurite, faulty_store
from tests.factories import dcp as dk
from tests.factories.azurite import PREFIX
from tests.factories.built import Built
from tests.factories.faulty_store import Fault

pytestmark = pytest.mark.usefixtures("azure_environment")


@pytest.fixture(scope="module")
def proxy(azure: azurite.Server) -> Iterator[faulty_store.FaultyProxy]:
    started = faulty_store.start(azure.endpoint)
    yield started
    faulty_store.stop(started)


@pytest.fixture
def faulty(proxy: faulty_store.FaultyProxy) -> Iterator[faulty_store.FaultyProxy]:
    """The proxy, with no fault armed when the test ends."""
    proxy.disarm()
    yield proxy
    proxy.disarm()


def _endpoint(proxy: faulty_store.FaultyProxy) -> str:
    """The account's blob endpoint through the proxy (Azurite's URLs are path-style: the account leads the path)."""
    return f"{proxy.endpoint}/{azurite.ACCOUNT}"


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("optim-repair: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _names(azure: azurite.Server, container: str, prefix: str) -> set[str]:
    return {name[len(prefix) :] for name in azurite.names(azure, container, prefix)}


def _download(azure: azurite.Server, container: str, prefix: str, into: Path) -> Path:
    into.mkdir(parents=True)
    for name in _names(azure, container, prefix):
        into.joinpath(name).write_bytes(azurite.get(azure, container, f"{prefix}{name}"))
    return into


def test_a_name_outside_the_prefix_is_refused_where_it_is_listed(
    azure: azurite.Server, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """Azure takes empty segments as names it really holds (``.`` and ``..`` segments a client resolves before
    the request is sent), and ``step//x`` joined onto a local directory is ``step/x``, another file's place."""
    container, _ = azure_stored
    azurite.put(azure, container, f"{PREFIX}step//escaped.distcp", b"x")
    assert f"{PREFIX}step//escaped.distcp" in azurite.names(azure, container, PREFIX)  # held as named
    result = run_cli(["inspect", f"az://{container}/{PREFIX}"], code=4)
    assert "names a path outside its prefix" in _one_line(result.stderr)
    result = run_cli(["fix", f"az://{container}/{PREFIX}", "--out", tmp_path / "out"], code=4)
    assert "names a path outside its prefix" in _one_line(result.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../../outside/.metadata", "a//b.distcp", "/etc/x.distcp", "x" * 1100])
def test_a_listed_name_outside_the_prefix_is_refused_where_it_is_listed(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built], tmp_path: Path, name: str
) -> None:
    """A store that lies in its listing: a name that would lead outside the directory a download fills."""
    container, _ = azure_stored
    faulty.arm(Fault("hostile-names", names=(f"{PREFIX}{name}",)))
    result = run_cli(
        ["fix", f"az://{container}/{PREFIX}", "--out", tmp_path / "out", "--endpoint-url", _endpoint(faulty)], code=4
    )
    assert "names a path outside its prefix" in _one_line(result.stderr)
    assert faulty.hits["hostile-names"] >= 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "outside").exists()


def test_a_listed_name_azure_encoded_is_decoded_then_checked(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """Azure writes a name XML cannot hold percent-encoded, as ``<Name Encoded="true">``: decoded, the name
    ``run/step-2/../../outside/.metadata`` (every ``/`` encoded, so that undecoded it is not even under the
    prefix) is refused as any such name is."""
    container, _ = azure_stored
    faulty.arm(Fault("hostile-names", names=(f"{PREFIX}../../outside/{METADATA_FILE}",), encoded=True))
    result = run_cli(
        ["fix", f"az://{container}/{PREFIX}", "--out", tmp_path / "out", "--endpoint-url", _endpoint(faulty)], code=4
    )
    line = _one_line(result.stderr)
    assert "names a path outside its prefix" in line and "%2F" not in line
    assert faulty.hits["hostile-names"] >= 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "outside").exists()


@pytest.mark.parametrize("name", ["a\x00.distcp", "a\x1b]0;x\x07.distcp", "a%FF.distcp"])
def test_a_listed_name_no_file_can_have_is_refused_where_it_is_listed(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built], tmp_path: Path, name: str
) -> None:
    """Azure writes a name XML cannot hold percent-encoded (``<Name Encoded="true">``): decoded, ``%00`` is a NUL,
    which made the download of ``fix --out DIR`` fail ("embedded null byte", exit 70), and ``%FF`` no UTF-8 text
    (it was decoded to U+FFFD, a name the container does not hold). Each is refused where it is listed, before
    anything is downloaded, and shown escaped."""
    container, _ = azure_stored
    listed = urllib.parse.unquote(name, errors="surrogateescape")
    faulty.arm(Fault("hostile-names", names=(f"{PREFIX}{listed}",), encoded=True))
    before = set(tmp_path.rglob("*"))
    for args in (["inspect", f"az://{container}/{PREFIX}"],
                 ["fix", f"az://{container}/{PREFIX}", "--out", tmp_path / "out"]):  # fmt: skip
        result = run_cli([*args, "--endpoint-url", _endpoint(faulty)], code=4)
        line = _one_line(result.stderr)
        assert f"{shown_name(f'az://{container}/{PREFIX}{listed}')}: is listed by a name holding a NUL" in line
        assert "downloading" not in result.stderr
    assert faulty.hits["hostile-names"] == 2 and set(tmp_path.rglob("*")) == before


def test_a_listing_whose_marker_repeats_is_exit_4(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built]
) -> None:
    container, _ = azure_stored
    faulty.arm(Fault("repeat-token"))
    result = run_cli(["inspect", f"az://{container}/{PREFIX}", "--endpoint-url", _endpoint(faulty)], code=4)
    assert "the store repeats its listing" in _one_line(result.stderr)  # its first page came twice
    assert faulty.hits["repeat-token"] == 2
    assert f"marker={faulty_store.TOKEN}" in faulty.requests[-1]  # the second asked from the marker given


@pytest.mark.parametrize("kind", ["billion laughs", "entity naming a path"])
def test_an_xml_answer_that_declares_entities_is_refused_unexpanded(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built], kind: str
) -> None:
    """A listing that declares a document type is refused before it is parsed: neither the billion laughs (ten
    levels of ten, 10^9 ``lol``) nor an entity whose expansion is a name outside the prefix is expanded (expanded,
    the second would be refused as that name)."""
    container, _ = azure_stored
    if kind == "billion laughs":
        entities = '<!ENTITY lol0 "lol">' + "".join(
            f'<!ENTITY lol{level} "{f"&lol{level - 1};" * 10}">' for level in range(1, 10)
        )
        name = "&lol9;"
    else:
        entities = '<!ENTITY up "../../outside">'
        name = f"{PREFIX}&up;/{METADATA_FILE}"
    body = (
        f'<?xml version="1.0" encoding="utf-8"?><!DOCTYPE EnumerationResults [{entities}]>'
        f'<EnumerationResults ContainerName="{container}"><Prefix>{PREFIX}</Prefix><Blobs><Blob><Name>{name}</Name>'
        "<Properties><Etag>0x1</Etag><Content-Length>1</Content-Length></Properties></Blob></Blobs><NextMarker/>"
        "</EnumerationResults>"
    ).encode()
    faulty.arm(Fault("answer-body", method="GET", match="comp=list", body=body))
    started = time.monotonic()
    result = run_cli(["inspect", f"az://{container}/{PREFIX}", "--endpoint-url", _endpoint(faulty)], code=4)
    assert f"az://{container}/{PREFIX}: answered with XML that declares a document type" in _one_line(result.stderr)
    assert faulty.hits["answer-body"] == 1 and time.monotonic() - started < 10


def test_a_listing_past_its_memory_budget_is_exit_4(
    azure_stored: tuple[str, Built], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names a listing keeps are bounded by the memory they take, not by their count alone: 4.4 million tiny
    objects under the count's limit took over 1 GiB. With a budget of three names, the three objects of this
    checkpoint are refused at the third."""
    container, _ = azure_stored
    monkeypatch.setattr(names, "LISTED_BYTES", 3 * names.NAME_OVERHEAD)
    before = set(tmp_path.rglob("*"))
    result = run_cli(["fix", f"az://{container}/{PREFIX}", "--out", tmp_path / "out"], code=4)
    line = _one_line(result.stderr)
    assert f"az://{container}/{PREFIX}: lists more names than {3 * names.NAME_OVERHEAD:,} bytes of memory hold" in line
    assert set(tmp_path.rglob("*")) == before


def test_a_store_that_ignores_range_is_refused_before_its_body_is_read(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built]
) -> None:
    """Azure reads by ``x-ms-range``: the proxy drops it, and the store answers 200 with the whole object."""
    container, _ = azure_stored
    faulty.arm(Fault("ignore-range"))
    with pytest.raises(InputError, match=r"answered a read of another range than was asked \(HTTP 200\)"):
        api.inspect(f"az://{container}/{PREFIX}", endpoint_url=_endpoint(faulty))
    assert faulty.hits["ignore-range"] >= 1


def test_a_content_range_of_more_digits_than_a_size_has_is_refused_unread(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """A Content-Range whose total has 5,000 digits went to int(), past Python's limit on the digits it converts
    (ValueError, exit 70)."""
    container, _ = azure_stored
    given = f"bytes 0-9/{'9' * 5000}"
    faulty.arm(Fault("answer-headers", method="GET", header="x-ms-range", headers=(("Content-Range", given),)))
    before = set(tmp_path.rglob("*"))
    result = run_cli(
        ["fix", f"az://{container}/{PREFIX}", "--out", tmp_path / "out", "--endpoint-url", _endpoint(faulty)], code=4
    )
    assert f"answered a read of another range than was asked ({given[:100]})" in _one_line(result.stderr)
    assert faulty.hits["answer-headers"] >= 1 and set(tmp_path.rglob("*")) == before


def test_a_store_that_drips_is_given_up_past_the_grace(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    container, _ = azure_stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    faulty.arm(Fault("drip", method="GET", match=METADATA_FILE, delay=0.2))
    started = time.monotonic()
    result = run_cli(["inspect", f"az://{container}/{PREFIX}", "--endpoint-url", _endpoint(faulty)], code=4)
    assert f"az://{container}/{PREFIX}{METADATA_FILE}: answers too slowly" in _one_line(result.stderr)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("fault", ["drip", "slow-headers"])
def test_a_listing_that_drips_is_given_up_at_its_deadline(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built], monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A listing's page is read whole, against the floor's pace as it comes and within a deadline (the grace and a
    page's worth at the floor's pace, lowered here to two seconds): one that drips (for several seconds) is given
    up at the pace, one whose answer starts only after five seconds (the transport would wait sixty) at the
    deadline."""
    container, _ = azure_stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    monkeypatch.setattr(answers, "WHOLE_ANSWER_BYTES", answers.FLOOR_BYTES_PER_SECOND)
    faulty.arm(Fault(fault, method="GET", match="comp=list", delay=0.01 if fault == "drip" else 5))  # type: ignore[arg-type]
    started = time.monotonic()
    result = run_cli(["inspect", f"az://{container}/{PREFIX}", "--endpoint-url", _endpoint(faulty)], code=4)
    line = _one_line(result.stderr)
    if fault == "slow-headers":
        assert line.endswith(
            f"az://{container}/{PREFIX}: did not answer in time (no answer from {faulty.endpoint} within 2 s)"
        )
    else:
        assert f"az://{container}/{PREFIX}: answers too slowly (" in line
    assert time.monotonic() - started < 4.5
    assert faulty.hits[fault] == 1


_REDIRECTED = [  # what a store's redirect hits, and the exit code of the command it fails
    pytest.param(Fault("redirect", method="GET", header="x-ms-range"), 4, id="redirect-read"),
    pytest.param(Fault("redirect", method="HEAD", match=METADATA_FILE), 4, id="redirect-head"),
    pytest.param(Fault("redirect", method="GET", match="comp=list"), 4, id="redirect-listing"),
    pytest.param(Fault("redirect", method="PUT", header="x-ms-blob-type"), 5, id="redirect-put-blob"),
]


@pytest.mark.parametrize(("fault", "code"), _REDIRECTED)
def test_a_redirect_is_never_followed(
    faulty: faulty_store.FaultyProxy,
    elsewhere: faulty_store.Elsewhere,
    azure: azurite.Server,
    azure_stored: tuple[str, Built],
    monkeypatch: pytest.MonkeyPatch,
    fault: Fault,
    code: int,
) -> None:
    """A 307 to another origin: requests would follow it for a read or a HEAD (its answer then judged as the
    store's) and, for a Put Blob, send the body there."""
    container, _ = azure_stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    monkeypatch.setattr(answers, "WHOLE_ANSWER_BYTES", answers.FLOOR_BYTES_PER_SECOND)
    faulty.arm(
        Fault(
            fault.kind, method=fault.method, match=fault.match, header=fault.header, delay=fault.delay,
            location=elsewhere.endpoint,
        )
    )  # fmt: skip
    out = f"az://{container}/fixed-{fault.kind}/"
    source = f"az://{container}/{PREFIX}"
    command = ["inspect", source] if code == 4 else ["fix", source, "--out", out]
    result = run_cli([*command, "--endpoint-url", _endpoint(faulty)], code=code)
    line = _one_line(result.stderr)
    assert faulty.hits[fault.kind] >= 1
    if fault.kind == "redirect":
        assert f"answered with a redirect (HTTP 307) to {elsewhere.endpoint}, which is not followed" in line
    else:
        assert f"did not answer in time (no answer from {faulty.endpoint} within 2 s)" in line
    assert elsewhere.requests == []
    assert _names(azure, container, f"fixed-{fault.kind}/") == set()


_DRIPPED = [  # what a store's dripped headers hit, and the exit code of the command it fails
    pytest.param(Fault("drip-headers", method="GET", header="x-ms-range", delay=0.05), 4, id="read"),
    pytest.param(Fault("drip-headers", method="HEAD", match=METADATA_FILE, delay=0.05), 4, id="head"),
    pytest.param(Fault("drip-headers", method="GET", match="comp=list", delay=0.05), 4, id="listing"),
    pytest.param(Fault("drip-headers", method="PUT", header="x-ms-blob-type", delay=0.05), 5, id="put-blob"),
]


@pytest.mark.parametrize(("fault", "code"), _DRIPPED)
def test_dripped_headers_are_given_up_at_the_requests_deadline(
    faulty: faulty_store.FaultyProxy,
    azure: azurite.Server,
    azure_stored: tuple[str, Built],
    monkeypatch: pytest.MonkeyPatch,
    fault: Fault,
    code: int,
) -> None:
    """A status line and headers one byte at a time, without end: the per-read timeout never trips; the request's
    deadline, from its first byte sent (lowered here to two seconds), does."""
    container, _ = azure_stored
    monkeypatch.setattr(answers, "GRACE_SECONDS", 1.0)
    monkeypatch.setattr(answers, "WHOLE_ANSWER_BYTES", answers.FLOOR_BYTES_PER_SECOND)
    faulty.arm(fault)
    source = f"az://{container}/{PREFIX}"
    command = ["inspect", source] if code == 4 else ["fix", source, "--out", f"az://{container}/fixed-dripped/"]
    result = run_cli([*command, "--endpoint-url", _endpoint(faulty)], code=code)
    line = _one_line(result.stderr)
    assert f"did not answer in time (no answer from {faulty.endpoint} within 2 s)" in line
    assert faulty.hits["drip-headers"] >= 1
    assert _names(azure, container, "fixed-dripped/") == set()


def test_a_body_cut_off_is_exit_4_naming_the_key(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built]
) -> None:
    container, _ = azure_stored
    faulty.arm(Fault("cut", method="GET", match=METADATA_FILE, after=10))
    result = run_cli(["inspect", f"az://{container}/{PREFIX}", "--endpoint-url", _endpoint(faulty)], code=4)
    line = _one_line(result.stderr)
    assert f"az://{container}/{PREFIX}{METADATA_FILE}: " in line
    assert faulty.hits["cut"] >= 1


@pytest.mark.parametrize("lost", ["upload", "copy"])
def test_a_write_whose_answer_was_lost_is_known_for_the_runs_own(
    faulty: faulty_store.FaultyProxy, azure: azurite.Server, azure_stored: tuple[str, Built], tmp_path: Path, lost: str
) -> None:
    """The write took effect, its answer was lost (500), the transport retried; the retry's ``If-None-Match: *``
    is refused (the object is there), and the run reads the key back and finds its own (its run id)."""
    container, built = azure_stored
    if lost == "upload":
        fault = Fault("lose-answer", method="PUT", match=f"fixed/{METADATA_FILE}?", times=1)
    else:
        fault = Fault("lose-answer", method="PUT", match="fixed/__0_0.distcp?", header="x-ms-copy-source", times=1)
    faulty.arm(fault)
    out = f"az://{container}/fixed/"
    result = run_cli(["fix", f"az://{container}/{PREFIX}", "--out", out, "--endpoint-url", _endpoint(faulty)])
    assert faulty.hits["lose-answer"] == 1, result.stderr
    retried = [request for request in faulty.requests if request.startswith("PUT ") and fault.match in request]
    assert len(retried) >= 2  # the lost one, and its retry
    assert _names(azure, container, "fixed/") == {path.name for path in built.path.iterdir()} | {
        "__optim_repair_0.distcp"
    }
    local = _download(azure, container, "fixed/", tmp_path / "fixed")
    resumed = dk.resume(local, "adamw", "optim", False)
    reference = dk.uninterrupted("adamw")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def test_a_failing_store_leaves_nothing_at_the_output(
    faulty: faulty_store.FaultyProxy, azure: azurite.Server, azure_stored: tuple[str, Built]
) -> None:
    container, _ = azure_stored
    faulty.arm(Fault("fail", method="PUT", header="x-ms-copy-source", status=503))
    result = run_cli(
        ["fix", f"az://{container}/{PREFIX}", "--out", f"az://{container}/fixed/", "--endpoint-url", _endpoint(faulty)],
        code=5,
    )
    assert "the store refused the request (HTTP 503: InternalError" in _one_line(result.stderr)
    assert faulty.hits["fail"] >= 2  # retried by the transport before it gave up
    assert _names(azure, container, "fixed/") == set()  # no object, no marker


def _secrets(proxy: faulty_store.FaultyProxy) -> set[str]:
    """The account key, and the SAS signature every request through ``proxy`` carried (as sent, and decoded)."""
    found = {azurite.ACCOUNT_KEY}
    for request in proxy.requests:
        for value in urllib.parse.parse_qs(urllib.parse.urlsplit(request.partition(" ")[2]).query).get("sig", []):
            found |= {value, urllib.parse.quote(value, safe="")}
    return found


@pytest.mark.parametrize(
    ("case", "json_output"),
    [(case, json_output) for case in ("echoed error", "refused copy", "cut body", "ignored range")
     for json_output in (False, True)] + [("lost connection", True)],
)  # fmt: skip
def test_credentials_are_never_shown_by_a_failing_run(
    faulty: faulty_store.FaultyProxy, azure_stored: tuple[str, Built], case: str, json_output: bool
) -> None:
    """The SAS rides in every request's query and in a copy's source URL: no message of a failing run shows it (nor
    the account key), on stderr or in the JSON document, even where the store's own error message echoes the
    request's URL (as a gateway's may). (A connection refused is retried with the transport's backoff, some seven
    seconds: it runs once.)"""
    container, _ = azure_stored
    endpoint = _endpoint(faulty)
    command = ["inspect", f"az://{container}/{PREFIX}"]
    code = 4
    if case == "echoed error":
        faulty.arm(Fault("fail", method="GET", match="comp=list", status=403, message="Denied: GET {target}"))
    elif case == "lost connection":
        with socket.socket() as probe:  # a port nothing listens on: the connection is refused, and retried
            probe.bind(("127.0.0.1", 0))
            endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}/{azurite.ACCOUNT}"
    elif case == "refused copy":
        faulty.arm(Fault("fail", method="PUT", header="x-ms-copy-source", status=400, message="Bad source {target}"))
        command, code = ["fix", f"az://{container}/{PREFIX}", "--out", f"az://{container}/fixed-{time.time_ns()}/"], 5
    elif case == "cut body":
        faulty.arm(Fault("cut", method="GET", match=METADATA_FILE, after=10))
    else:
        faulty.arm(Fault("ignore-range"))
    result = run_cli([*command, "--endpoint-url", endpoint, *(["--json"] if json_output else [])], code=code)
    shown = result.stdout + result.stderr
    assert "sig=" not in shown and "sig%3D" not in shown.lower(), shown
    secrets = _secrets(faulty)
    assert case == "lost connection" or len(secrets) >= 2  # the key, and a signature the run sent
    assert not [secret for secret in secrets if secret in shown], shown
    if json_output:
        assert json.loads(result.stdout)["error"]["code"]
    else:
        _one_line(result.stderr)


def test_credentials_in_the_endpoint_are_never_shown(azure_stored: tuple[str, Built], azure: azurite.Server) -> None:
    container, _ = azure_stored
    host = azure.endpoint.removeprefix("http://")
    result = run_cli(
        ["inspect", f"az://{container}/{PREFIX}", "--endpoint-url", f"http://KEY:TOPSECRET@{host}"], code=2
    )
    assert "TOPSECRET" not in result.stderr + result.stdout and azurite.ACCOUNT_KEY not in result.stderr
    with pytest.raises(UsageError, match="is not an endpoint URL"):
        api.inspect(f"az://{container}/{PREFIX}", endpoint_url="ftp://127.0.0.1")


def test_of_two_fixes_into_one_prefix_at_most_one_succeeds_and_its_copy_loads(
    azure: azurite.Server, azure_stored: tuple[str, Built], tmp_path: Path
) -> None:
    """Every node of a job runs the resume script: trials of two fixes at once into one prefix. The claim's
    marker is written with ``If-None-Match: *``, which Azurite checks."""
    container, built = azure_stored
    expected = {path.name for path in built.path.iterdir()} | {"__optim_repair_0.distcp"}
    for trial in range(5):
        out = f"race-{trial}/"
        command = [
            sys.executable,
            "-m",
            "optim_repair",
            "fix",
            f"az://{container}/{PREFIX}",
            "--out",
            f"az://{container}/{out}",
        ]
        runs = [
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)
        ]
        ended = [(run.wait(timeout=120), run.stderr.read() if run.stderr else "") for run in runs]
        for run in runs:
            run.stderr.close() if run.stderr else None
        codes = sorted(code for code, _ in ended)
        assert codes in ([0, 5], [5, 5]), ended
        for code, stderr in ended:
            if code == 5:
                assert "is writing a copy here" in stderr or "already holds objects" in stderr, stderr
        left = _names(azure, container, out)
        if codes == [0, 5]:
            assert left == expected, (ended, left)
            dk.resume(_download(azure, container, out, tmp_path / out), "adamw", "optim", False, steps=0)
        else:
            assert left == set()


def _trained_file(tmp_path: Path) -> tuple[torch.nn.ModuleDict, Path]:
    """An AdamW state dict of 18 MiB, keyed by index, as ``optimizer.state_dict()`` saves it."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(1500, 1500), "unused": torch.nn.Linear(8, 8)})
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model["used"](torch.randn(2, 1500)).sum().backward()
        optimizer.step()
    path = tmp_path / "in" / "optimizer.pt"
    path.parent.mkdir()
    torch.save(optimizer.state_dict(), path)
    return model, path


@pytest.fixture
def copied_ranges(faulty: faulty_store.FaultyProxy) -> faulty_store.FaultyProxy:
    """The proxy serving Put Block From URL as the service does (Azurite answers it 500 under a SAS)."""
    faulty.arm(Fault("copies-ranges"))
    return faulty


def test_a_torch_file_is_spliced_inside_the_store_by_put_block_from_url(
    copied_ranges: faulty_store.FaultyProxy, azure: azurite.Server, tmp_path: Path
) -> None:
    """The copy is the new head, the original's kept range copied inside the store (Put Block From URL, pinned to
    the ETag read), and the new tail: an 18 MiB file moves its pickle and its tail through the client, never its
    tensors, and torch.load of the copy (mmap too) resumes exactly as the local repair does."""
    model, path = _trained_file(tmp_path)
    container = azurite.new_container(azure)
    azurite.upload(azure, path.parent, container, "run/")
    result = api.fix(
        f"az://{container}/run/optimizer.pt", f"az://{container}/fixed/", fill="empty",
        endpoint_url=_endpoint(copied_ranges),
    )  # fmt: skip
    assert copied_ranges.hits["copies-ranges"] >= 1  # the service's path: no fallback
    with zipfile.ZipFile(path) as archive:
        pickle_size = archive.getinfo("optimizer/data.pkl").file_size
    traffic = result.traffic
    assert traffic is not None
    size = path.stat().st_size
    assert size - (1 << 20) < traffic.copied <= size  # the original's storages, copied inside the store
    assert traffic.read < 2 * pickle_size + (1 << 20) and traffic.written < 2 * pickle_size + (1 << 20)
    assert _names(azure, container, "fixed/") == {"optimizer.pt"}  # no marker, no block left as an object
    composed = tmp_path / "composed.pt"
    composed.write_bytes(azurite.get(azure, container, "fixed/optimizer.pt"))
    with zipfile.ZipFile(composed) as archive:
        assert archive.testzip() is None
    local = api.fix(path, tmp_path / "local.pt", fill="empty")
    assert api.inspect(composed).verdict == api.inspect(local.out).verdict == "healthy"
    expected = torch.load(local.out, weights_only=True)
    for mmap in (False, True):
        resumed = torch.load(composed, weights_only=True, mmap=mmap)
        assert resumed["param_groups"] == expected["param_groups"]
        assert resumed["state"].keys() == expected["state"].keys()
        for param, state in expected["state"].items():
            assert all(torch.equal(state[key], resumed["state"][param][key]) for key in state)
    torch.optim.AdamW(model.parameters()).load_state_dict(resumed)


def test_an_original_changed_between_plan_and_copy_is_refused(
    copied_ranges: faulty_store.FaultyProxy, azure: azurite.Server, tmp_path: Path
) -> None:
    """Another writer saves the original again (same name, new ETag) after the run planned from it and before its
    kept range is copied: the copy, pinned to the ETag read (``x-ms-source-if-match``), is refused by the store
    (412 ``SourceConditionNotMet``), and the run says the original changed; nothing is left at the output."""
    _, path = _trained_file(tmp_path)
    container = azurite.new_container(azure)
    azurite.upload(azure, path.parent, container, "run/")
    saved_again = path.read_bytes()
    copied_ranges.arm(
        Fault("copies-ranges"),
        Fault("meanwhile", method="PUT", header="x-ms-copy-source", times=1,
              action=lambda: azurite.put(azure, container, "run/optimizer.pt", saved_again)),
    )  # fmt: skip
    command = ["fix", f"az://{container}/run/optimizer.pt", "--out", f"az://{container}/fixed/", "--fill", "empty"]
    result = run_cli([*command, "--endpoint-url", _endpoint(copied_ranges)], code=4)
    assert copied_ranges.hits["meanwhile"] == 1 and copied_ranges.hits["copies-ranges"] == 1
    line = _one_line(result.stderr)
    assert "changed while being read" in line
    assert f"az://{container}/run/optimizer.pt: " in line  # the original, which changed; not the copy
    assert _names(azure, container, "fixed/") == set()
