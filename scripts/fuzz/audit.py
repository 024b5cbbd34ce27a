"""The worker's audit hook: every file touched outside the case's directories, every exec and import."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from fuzz.trees import under

_PATH_EVENTS: dict[str, tuple[tuple[tuple[int, str], ...], int | None]] = {
    "shutil.copyfile": (((0, "read"), (1, "write")), None),
    "shutil.copymode": (((0, "read"), (1, "write")), None),
    "shutil.copystat": (((0, "read"), (1, "write")), None),
    "shutil.copytree": (((0, "read"), (1, "write")), None),
    "shutil.rmtree": (((0, "write"),), 1),
    "os.link": (((0, "read"), (1, "write")), 2),
    "os.symlink": (((1, "write"),), 2),
    "os.rename": (((0, "write"), (1, "write")), 2),
    "os.remove": (((0, "write"),), 1),
    "os.rmdir": (((0, "write"),), 1),
    "os.mkdir": (((0, "write"),), 2),
    "os.truncate": (((0, "write"),), None),
    "os.chmod": (((0, "write"),), 2),
    "os.chown": (((0, "write"),), 3),
    "os.utime": (((0, "write"),), 3),
    "os.listdir": (((0, "read"),), None),
    "os.scandir": (((0, "read"),), None),
}
"""Audit events that name paths: (argument position, access) of each path, and the position of a ``dir_fd``."""
_NOFOLLOW_EVENTS = frozenset({"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.symlink", "shutil.rmtree"})
"""Events that act on a link itself, not on what it points to."""
_EXEC_EVENTS = frozenset({"os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                          "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen", "socket.connect", "socket.bind",
                          "socket.getaddrinfo", "urllib.Request", "webbrowser.open"})  # fmt: skip
_IMPORTS_ALLOWED = frozenset({"optim_repair", "torch", "zstandard", "compression", "bz2", "_bz2", "lzma",
                              "_lzma", "zlib", "_compression", "encodings", "safetensors", "rich", "typer",
                              "numpy"})  # fmt: skip
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _in_rmtree() -> bool:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name.startswith("_rmtree") and frame.f_code.co_filename == shutil.__file__:
            return True
        frame = frame.f_back
    return False


class Auditor:
    """An audit hook: while armed, records every path touched outside the case's directories, and worse."""

    def __init__(self, static_roots: Sequence[str], package_dir: str) -> None:
        self.armed = False
        self.busy = False
        self.static_roots = tuple(static_roots)
        self.package_dir = package_dir
        self.input_dir = ""
        self.dereference = False
        self.case_roots: tuple[str, ...] = ()
        self.events: list[dict[str, str]] = []
        self._seen: set[tuple[str, ...]] = set()

    def arm(self, input_dir: str, output_dir: str, *, dereference: bool = False) -> None:
        self.dereference = dereference
        self.input_dir = os.path.realpath(input_dir)
        self.case_roots = (self.input_dir, os.path.realpath(output_dir))
        self.events, self._seen = [], set()
        self.armed = True

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.armed or self.busy:
            return
        self.busy = True
        try:
            self._audit(event, args)
        except Exception:  # an audit hook must never break the code under test
            pass
        finally:
            self.busy = False

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            mode, flags = args[1], args[2]
            writes = bool(set(mode) & set("wax+")) if isinstance(mode, str) else bool(flags & _WRITE_FLAGS)
            follow = not (isinstance(flags, int) and flags & getattr(os, "O_NOFOLLOW", 0))
            self._path(event, args[0], "write" if writes else "read", follow=follow)
        elif event in _PATH_EVENTS:
            paths, dir_fd = _PATH_EVENTS[event]
            relative_to_fd = dir_fd is not None and len(args) > dir_fd and args[dir_fd] is not None
            for position, access in paths:
                value = args[position] if len(args) > position else None
                if relative_to_fd and isinstance(value, (str, bytes)) and not os.path.isabs(value):
                    continue
                value = "." if value is None and event in ("os.listdir", "os.scandir") else value
                follow = event not in _NOFOLLOW_EVENTS and (event, position) != ("os.link", 1)
                self._path(event, value, access, follow=follow)
        elif event in _EXEC_EVENTS:
            if event == "ctypes.dlopen" and args[0] is None:
                return  # dlopen(NULL): the symbols already loaded (staging's renameat2), no new code
            self._record("exec", event, repr(args)[:200])
        elif event == "pickle.find_class":
            self._record("plain-unpickle", event, f"{args[0]}.{args[1]}")
        elif event == "import":
            top = str(args[0]).partition(".")[0]
            if top not in _IMPORTS_ALLOWED:
                self._record("import", event, str(args[0]))

    def _path(self, event: str, value: Any, access: str, *, follow: bool = True) -> None:
        if value is None or isinstance(value, int):
            return
        text = os.fsdecode(os.fspath(value))
        if not os.path.isabs(text) and _in_rmtree():
            return  # shutil.rmtree opens names relative to a directory descriptor; its root was audited
        if follow:
            real = os.path.realpath(text)
        else:  # O_NOFOLLOW: a link as the last component is not followed (the open fails)
            real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(text))), os.path.basename(text))
        if any(under(real, root) for root in self.case_roots):
            if access == "write" and under(real, self.input_dir):
                self._record("input-write", event, real)
            return
        reachable = os.path.isfile(real) or (self.dereference and os.path.isdir(real))
        if access == "read" and follow and reachable and self._named_inside(text):
            return  # a link in the checkpoint to a regular file (or with -L through a directory), read through
        if access == "read" and self.dereference and self._linked_from_inside(real):
            return  # with -L, a linked directory is walked at its resolved path (discovery resolves each link once)
        if access == "read" and any(under(real, root) for root in self.static_roots):
            return
        if real == "/dev/null":
            return
        self._record(f"outside-{access}", event, real)

    def _linked_from_inside(self, real: str) -> bool:
        """Whether ``real`` is, or lies in, the directory a link in the case's input leads to (one link deep: a
        link found in such a directory is not followed here, so a read past it is still a finding)."""
        for top, directories, files in os.walk(self.input_dir):
            for name in (*directories, *files):
                path = os.path.join(top, name)
                if os.path.islink(path) and os.path.isdir(path) and under(real, os.path.realpath(path)):
                    return True
        return False

    def _named_inside(self, text: str) -> bool:
        """Whether ``text`` names a path in the case's directories, reached through a link to a file there, or
        with ``dereference`` through linked directories too."""
        directory = os.path.dirname(os.path.abspath(text))
        directory = directory if self.dereference else os.path.realpath(directory)
        return any(under(directory, root) for root in self.case_roots)

    def _record(self, kind: str, event: str, detail: str) -> None:
        where = ""
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.package_dir):
                rel = os.path.relpath(frame.f_code.co_filename, os.path.dirname(self.package_dir))
                where = f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
                break
            frame = frame.f_back
        key = (kind, event, detail, where)
        if key not in self._seen:
            self._seen.add(key)
            self.events.append({"kind": kind, "event": event, "path": detail, "where": where})
