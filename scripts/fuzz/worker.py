"""The worker process: limits, the audit hook, then one case per request, its outcome as plain data."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import resource
import signal
import site
import sys
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any

from fuzz import oracle
from fuzz.audit import Auditor

METADATA = ".metadata"
EXIT_CODES = (2, 3, 4, 5)
"""The exit codes of documented errors (``optim_repair.errors.ExitCode``: usage, malformed, input, output)."""


def status_kib(pid: int | str, field_name: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as stream:
            for line in stream:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _frames(tb: TracebackType | None, package_dir: str) -> tuple[str, str]:
    """(innermost optim_repair frame, innermost frame) of a traceback, as ``file:function``."""
    ours = last = ""
    for frame, _line in traceback.walk_tb(tb):
        name = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
        last = name
        if frame.f_code.co_filename.startswith(package_dir):
            rel = os.path.relpath(frame.f_code.co_filename, os.path.dirname(package_dir))
            ours = f"{rel}:{frame.f_code.co_name}"
    return ours, last


def _causes(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _describe(exc: BaseException | None, package_dir: str) -> dict[str, Any]:
    """A call's outcome as plain data (called with the audit hook disarmed: formatting reads source files)."""
    if exc is None:
        return {"status": "ok"}
    from optim_repair.errors import OptimRepairError

    try:
        message = str(exc)
    except Exception as error:  # str() of a library error must not fail, but may
        message = f"<str() raised {type(error).__name__}: {error}>"
    chain = _causes(exc)
    deepest = chain[-1]
    where, innermost = _frames(deepest.__traceback__, package_dir)
    if not where:
        where = _frames(exc.__traceback__, package_dir)[0]
    record: dict[str, Any] = {
        "type": type(exc).__name__,
        "message": message,
        "causes": [f"{type(c).__name__}" + (f"[errno {c.errno}]" if isinstance(c, OSError) else "") for c in chain],
        "where": where,
        "innermost": innermost,
    }
    if isinstance(exc, OptimRepairError):
        record.update(status="error", exit_code=int(exc.exit_code))
        suspicious = "\n" in message or int(exc.exit_code) not in EXIT_CODES or len(chain) > 1
    else:
        record["status"] = "exception"
        suspicious = True
    if suspicious:
        text = "".join(traceback.format_exception(exc))
        record["traceback"] = text if len(text) < 20_000 else text[:4_000] + "\n...\n" + text[-12_000:]
    return record


def _guarded(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # everything, SystemExit and RecursionError included, is an outcome
        return None, exc


def _open_fds() -> dict[str, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return fds


@dataclass(frozen=True)
class WorkerConfig:
    log: str
    cwd: str
    """An empty directory to work in, so that a relative path resolves to nothing of the fuzzer's."""
    rss_mib: int
    fsize_mib: int


def _set_limits(config: WorkerConfig) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    fsize = config.fsize_mib << 20
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize if hard == resource.RLIM_INFINITY else min(fsize, hard), hard))
    # A backstop under the supervisor's RSS watch: allocations far beyond --rss-mib fail at once.
    data = (status_kib("self", "VmData") << 10) + (4 * config.rss_mib << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data if hard == resource.RLIM_INFINITY else min(data, hard), hard))


def preload_modules() -> list[str]:
    """What the forkserver imports once, so that a new worker is a fork, not a Python start-up.

    ``compression.zstd`` (Python 3.14) too, which the DCP reader tries first: where it is absent, that import
    searches every directory on ``sys.path``, and torch 2.8 (not 2.13) appends one of its own under the temporary
    directory (``torch.distributed.nn.jit.instantiator``); searched once here, it is not listed during a case.
    """
    return [__name__, "optim_repair", "optim_repair.formats.dcp.writer", "optim_repair.render", "torch",
            "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem", "compression.zstd",
            "zstandard", "bz2", "lzma"]  # fmt: skip


def worker_main(conn: Connection, config: WorkerConfig) -> None:
    """The worker: limits, audit hook, then one case per request until the pipe closes."""
    log = open(config.log, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.chdir(config.cwd)
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    warnings.simplefilter("ignore")
    for module in preload_modules()[1:]:
        with contextlib.suppress(ImportError):
            __import__(module)
    import optim_repair

    optim_repair.versions()  # reads the environment's package metadata (sys.path) once, before any case
    package_dir = os.path.dirname(os.path.realpath(optim_repair.__file__))
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, package_dir, "/proc/self",
             f"/proc/{os.getpid()}", "/dev/urandom", "/sys/devices/system/cpu", *site.getsitepackages()}  # fmt: skip
    auditor = Auditor(sorted(os.path.realpath(root) for root in roots), package_dir)
    sys.addaudithook(auditor)
    _set_limits(config)
    conn.send({"ready": os.getpid()})
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        os.write(log.fileno(), f"\n@@@ case {request['index']} @@@\n".encode())
        conn.send(run_request(request, auditor, package_dir))


def _whole_read_disagrees(
    path: str, dereference: bool, diagnosis: Any, inspected: BaseException | None, in_dir: str
) -> str | None:
    """What ``inspect``, which reads a DCP ``.metadata`` summarized, said that reading it whole does not say, for
    an input holding one: a different diagnosis, or another outcome (each error as its exit code and message)."""
    if not any(METADATA in files for _, _, files in os.walk(in_dir)):
        return None
    from optim_repair import api
    from optim_repair.checkpoint.reading import DiskListing
    from optim_repair.errors import OptimRepairError
    from optim_repair.render import inspect_document

    def whole() -> Any:
        listing = DiskListing(api.discover(Path(path), dereference=dereference))
        inventory, _ = api._read_unchanged(listing, keep=True)
        return api.diagnose(inventory)

    def outcome(result: Any, error: BaseException | None) -> str:
        if error is None:
            return json.dumps(inspect_document(result), sort_keys=True)
        code = int(error.exit_code) if isinstance(error, OptimRepairError) else None
        return f"error {code}: {type(error).__name__}: {error}"

    summarized, read_whole = outcome(diagnosis, inspected), outcome(*_guarded(whole))
    return None if summarized == read_whole else f"summarized: {summarized[:240]} | whole: {read_whole[:240]}"


def _scans_disagree(path: str, dereference: bool, diagnosis: Any, inspected: BaseException | None) -> list[str]:
    """Where the compiled pickle scan ran: what inspect says with the Python one instead, where it differs."""
    import optim_repair
    from optim_repair.formats import pickle_limits
    from optim_repair.render import inspect_document

    if pickle_limits.SCANNER != "compiled":
        return []
    pickle_limits.SCANNER = "pure-python"
    try:
        again, failed = _guarded(lambda: optim_repair.inspect(path, dereference=dereference))
    finally:
        pickle_limits.SCANNER = "compiled"

    def outcome(result: Any, error: BaseException | None) -> str:
        if error is not None:
            return f"{type(error).__name__}: {error}"
        return json.dumps(inspect_document(result), sort_keys=True)

    compiled, python = outcome(diagnosis, inspected), outcome(again, failed)
    return [] if compiled == python else [f"scans: compiled {compiled[:240]} | python {python[:240]}"]


def run_request(request: Mapping[str, Any], auditor: Auditor, package_dir: str) -> dict[str, Any]:
    """Run one case in this process: inspect, and maybe fix and inspect the copy; what happened, as plain data."""
    import optim_repair
    from optim_repair.render import inspect_document

    try:
        with open("/proc/self/clear_refs", "w") as stream:
            stream.write("5")  # VmHWM becomes this case's peak
    except OSError:
        pass
    fds = _open_fds()
    path, out = request["path"], request["out"]
    dereference = request["dereference"]
    auditor.arm(request["in_dir"], request["out_dir"], dereference=dereference)
    diagnosis, inspected = _guarded(lambda: optim_repair.inspect(path, dereference=dereference))
    rendered: BaseException | None = None
    if inspected is None:
        rendered = _guarded(lambda: json.dumps(inspect_document(diagnosis)))[1]
    disagreement = _whole_read_disagrees(path, dereference, diagnosis, inspected, request["in_dir"])
    unlike: list[str] = _scans_disagree(path, dereference, diagnosis, inspected)
    diffed: BaseException | None = None
    if not dereference:  # diff walks as inspect does without it: against itself, it holds the same
        difference, diffed = _guarded(lambda: optim_repair.diff(path, path))
        if diffed is None and not difference.same:
            unlike.append(f"against itself: {[leaf.name for leaf in difference.leaves][:8]}")
    fixed = reinspected = rediffed = None
    problems: list[tuple[str, str]] = []
    if request["fix"]:
        operations = optim_repair.model_changes(**request["operations"])
        result, fixed = _guarded(
            lambda: optim_repair.fix(
                path, out, fill=request["fill"], link=request["link"], dereference=dereference, operations=operations
            )
        )
        if fixed is None:
            _, reinspected = _guarded(lambda: optim_repair.inspect(out, dereference=dereference))
        if fixed is None and not dereference and not request["operations"]:
            # every leaf of the original is in the copy, unchanged: the copy only adds
            copied, rediffed = _guarded(lambda: optim_repair.diff(path, out))
            changed = [leaf for leaf in copied.leaves if leaf.a is not None] if rediffed is None else []
            unlike.extend(f"in the copy: {leaf.name} {leaf.what}: {leaf.a} -> {leaf.b}" for leaf in changed[:8])
    auditor.armed = False
    events = auditor.events
    if request["fix"] and fixed is None:  # the second opinion: torch's own loaders, outside the audit
        files = [file.file for file in result.diagnosis.inventory.files]
        problems = oracle.check(Path(path), Path(out), files, compare=not request["operations"])
    response: dict[str, Any] = {
        "inspect": _describe(inspected, package_dir),
        "render": _describe(rendered, package_dir) if inspected is None else None,
        "fix": _describe(fixed, package_dir) if request["fix"] else None,
        "reinspect": _describe(reinspected, package_dir) if request["fix"] and fixed is None else None,
        "events": events,
        "torch": problems,
        "summary": disagreement,
        "diff": _describe(diffed, package_dir) if not dereference else None,
        "rediff": _describe(rediffed, package_dir) if request["fix"] and fixed is None else None,
        "unlike": unlike,
    }
    diagnosis = inspected = rendered = fixed = reinspected = diffed = rediffed = None
    leaked = {fd: target for fd, target in _open_fds().items() if fd not in fds}
    if leaked:
        gc.collect()
        leaked = {fd: target for fd, target in _open_fds().items() if fd not in fds}
    response["leaked_fds"] = sorted(leaked.values())
    response["hwm_mib"] = status_kib("self", "VmHWM") / 1024
    return response
