"""The supervisor: runs cases in a worker forked from a forkserver, replaces it on a hang, crash or blowup."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from fuzz.worker import WorkerConfig, preload_modules, status_kib, worker_main

POLL_S = 0.02
"""How often the supervisor looks at a busy worker's memory."""
LOG_LIMIT = 1 << 20


@dataclass
class Raw:
    """What the supervisor saw of one case: the worker's response, or how the worker died."""

    response: dict[str, Any] | None
    death: str | None = None
    log: str = ""
    peak_rss_mib: float = 0.0
    seconds: float = 0.0


class Supervisor:
    """Runs cases in a worker forked from a forkserver; kills and replaces it on a hang, a crash or a blowup."""

    def __init__(self, workdir: Path, rss_mib: int, fsize_mib: int) -> None:
        self.log = workdir / "worker.log"
        self.rss_mib = rss_mib
        (workdir / "cwd").mkdir(exist_ok=True)
        self.config = WorkerConfig(str(self.log), str(workdir / "cwd"), rss_mib, fsize_mib)
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(preload_modules())
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None
        self.starts = 0

    def start(self) -> None:
        """Start a worker now (the first start also starts the forkserver, which imports torch)."""
        if self.process is None:
            self._start()

    def _start(self) -> tuple[BaseProcess, Connection]:
        parent, child = self.context.Pipe()
        saved = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = "ignore"  # the forkserver's own imports (torch's NumPy warning)
        try:
            process = self.context.Process(target=worker_main, args=(child, self.config), daemon=True)
            process.start()
        finally:
            if saved is None:
                del os.environ["PYTHONWARNINGS"]
            else:
                os.environ["PYTHONWARNINGS"] = saved
        child.close()
        if not parent.poll(300):
            process.kill()
            raise RuntimeError(f"the fuzz worker did not start; see {self.log}")
        parent.recv()
        self.starts += 1
        self.process, self.conn = process, parent
        return process, parent

    def run(self, request: dict[str, Any], timeout: float) -> Raw:
        process, conn = (self.process, self.conn) if self.process and self.conn else self._start()
        start = time.monotonic()
        peak = 0.0
        try:
            conn.send(request)
        except OSError:
            process, conn = self._start()
            conn.send(request)
        pid = process.pid or 0
        while True:
            if conn.poll(POLL_S):
                try:
                    response = conn.recv()
                except (EOFError, OSError):
                    return self._dead(request, self._exit_reason(), start, peak)
                return Raw(response, peak_rss_mib=max(peak, response.get("hwm_mib", 0.0)),
                           seconds=time.monotonic() - start)  # fmt: skip
            rss = status_kib(pid, "VmRSS") / 1024
            peak = max(peak, rss)
            if rss > self.rss_mib:
                self._kill(dump=True)
                return self._dead(request, "memory", start, peak)
            if not process.is_alive():
                return self._dead(request, self._exit_reason(), start, peak)
            if time.monotonic() - start > timeout:
                self._kill(dump=True)
                return self._dead(request, "hang", start, peak)

    def _exit_reason(self) -> str:
        process = self.process
        self.process = self.conn = None
        if process is None:
            return "exit-unknown"
        process.join(5)
        code = process.exitcode
        if code is None:
            process.kill()
            return "exit-unknown"
        if code < 0:
            try:
                return f"signal-{signal.Signals(-code).name}"
            except ValueError:
                return f"signal-{-code}"
        return f"exit-{code}"

    def _kill(self, *, dump: bool) -> None:
        process = self.process
        if process is not None and process.pid is not None and process.is_alive():
            if dump:  # faulthandler writes every thread's stack to the log first
                os.kill(process.pid, signal.SIGUSR1)
                time.sleep(0.3)
            process.kill()
            process.join(5)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None

    def _dead(self, request: Mapping[str, Any], death: str, start: float, peak: float) -> Raw:
        self._kill(dump=False)
        return Raw(None, death, self._log_since(request["index"]), peak, time.monotonic() - start)

    def _log_since(self, index: int) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        marker = f"@@@ case {index} @@@"
        tail = text[text.rfind(marker) + len(marker) :] if marker in text else text[-20_000:]
        return tail.strip()[-20_000:]

    def trim_log(self) -> None:
        try:
            if self.log.stat().st_size > LOG_LIMIT:
                os.truncate(self.log, 0)
        except OSError:
            pass

    def stop(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.send(None)
        if self.process is not None:
            self.process.join(2)
        self._kill(dump=False)
