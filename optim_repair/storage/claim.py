"""A run's claim on where it writes in a store: at most one run writes there, and a run deletes only what it wrote.

A store cannot rename a finished copy into place, so a run writes where the copy is to be, and must keep other
runs out while it does. Before its first write, a run puts a marker (``.optim-repair-incomplete`` in the output
prefix, or ``KEY.optim-repair-incomplete`` beside a single object) that never replaces one: it names the run and
lists every key the run plans to write. While the run lives it renews the marker (its lease: 120 s, or
``OPTIM_REPAIR_LEASE_SECONDS``); it writes its commit (a DCP ``.metadata``) only after renewing it once more,
and deletes it last.

Another run that finds the marker refuses while the lease holds. Once it has lapsed by the store's clock (the
run was killed, its machine lost), the next run deletes, of the keys the marker lists, only the objects that
stopped run wrote (every object a run writes carries its id in its metadata), each only if unchanged since it
was read (``If-Match``), then the marker. A run that fails deletes the objects whose ETag it got back, and those
it was writing when it failed that carry its id, each pinned to its ETag. So a run never deletes what another
run, or a user, wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from optim_repair import signals
from optim_repair.errors import InputError, ObjectExists, OutputError, UsageError, counted, shown
from optim_repair.storage.interface import WritableStore
from optim_repair.storage.objects import Copied, Small

MARKER = ".optim-repair-incomplete"
"""The object a run writes first into its output prefix (or beside its output object) and deletes last."""
LEASE_VARIABLE = "OPTIM_REPAIR_LEASE_SECONDS"
DEFAULT_LEASE_SECONDS = 120.0
"""How long a marker holds without being renewed (``OPTIM_REPAIR_LEASE_SECONDS`` where set): a marker older than
its lease, by the store's clock, is a stopped run's. A run renews its own four times a lease."""
MARKER_LIMIT = 64 << 20
"""The largest marker read: one lists every key its run plans to write (a million keys is about 50 MB)."""
_Result = TypeVar("_Result")


def lease_seconds() -> float:
    """The lease a run's marker states: ``OPTIM_REPAIR_LEASE_SECONDS``, or ``DEFAULT_LEASE_SECONDS``."""
    text = os.environ.get(LEASE_VARIABLE)
    if text is None:
        return DEFAULT_LEASE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 1 <= value <= 86_400:
        raise UsageError(f"{LEASE_VARIABLE}={shown(text)} is not a number of seconds from 1 to 86400")
    return value


def marker_key(output: str) -> str:
    """The key of the marker of ``output``: inside a prefix (``run/fixed/``), or beside one object's key."""
    return f"{output}{MARKER}"


class Claim:
    """This run's claim on an output: its marker, the keys it plans to write, and what it has written."""

    def __init__(self, store: WritableStore, marker: str, planned: Sequence[str]) -> None:
        self.store, self.marker, self.planned = store, marker, tuple(planned)
        self._lease = lease_seconds()
        self._etag: str | None = None
        self._written: dict[str, str] = {}
        """Each key this run wrote, with the ETag the store gave back."""
        self._writing: set[str] = set()
        """The keys whose write has begun and not yet answered."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._lost: OutputError | None = None

    def _body(self) -> bytes:
        return json.dumps(
            {"run": self.store.run, "lease_seconds": self._lease, "planned": list(self.planned)}, separators=(",", ":")
        ).encode()

    def take(self, notice: Callable[[str], None]) -> None:
        """Put the marker, never over another's: a stopped run's is cleared first (``clear_stopped``); a live
        run's is refused (exit 5)."""
        found = self.store.read_small(self.marker, MARKER_LIMIT)
        if found is not None:
            clear_stopped(self.store, self.marker, found, notice)
        try:
            with signals.held():  # the marker and this run's record of it: both, or neither
                self._etag = self.store.put_bytes(self.marker, self._body()).etag
        except ObjectExists:
            again = self.store.read_small(self.marker, MARKER_LIMIT)
            raise _busy(self.store, self.marker, again) from None
        with signals.held():  # started and recorded together; the thread inherits the mask (``signals.held``)
            self._renewer = threading.Thread(target=self._renew_until_stopped, name="optim-repair-lease", daemon=True)
            self._renewer.start()

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self._lease / 4):
            try:
                self.renew()
            except OutputError as exc:
                self._lost = exc
                return
            except InputError:  # the store did not answer this time; the next renewal tries again
                continue

    def renew(self) -> None:
        """Write the marker again (its lease starts anew), only over this run's own; ``OutputError`` when it is not
        this run's any more (another run took it over after this one's lease lapsed). A renewal refused because an
        earlier attempt of it took effect (its answer lost, the transport retried) finds the marker still this
        run's, and keeps its new version."""
        with self._lock:
            etag = self._etag
            if etag is None:
                return
            try:
                self._etag = self.store.replace_own(self.marker, self._body(), etag).etag
            except (ObjectExists, InputError) as exc:
                if isinstance(exc, InputError) and "no such object" not in exc.reason:
                    raise
                found = self.store.owner(self.marker) if isinstance(exc, ObjectExists) else None
                if found is not None and found[0] == self.store.run:  # this renewal took effect, its answer was
                    self._etag = found[1].etag  # lost, and the transport's retry was refused: the marker is ours
                    return
                raise OutputError(
                    "this run's claim was taken over by another run (its lease lapsed); the copy is not committed",
                    path=self.store.where(self.marker),
                ) from None

    def check(self) -> None:
        """Raise what ended this run's claim, if anything did."""
        if self._lost is not None:
            raise self._lost

    def writing(self, key: str, write: Callable[[], Copied]) -> Copied:
        """``write`` of ``key``, recorded: its key before it begins (so that a failure meanwhile cleans it up), its
        ETag once the store answers."""
        self.check()
        with signals.held():
            self._writing.add(key)
        try:
            copied = write()
        except ObjectExists:
            with signals.held():
                self._writing.discard(key)  # another writer's object: never deleted
            raise
        with signals.held():
            self._written[key] = copied.etag
            self._writing.discard(key)
        return copied

    def commit(self, write: Callable[[], _Result]) -> _Result:
        """``write`` the commit, once the claim is known to hold (renewed just before). Once it is written the copy
        is whole, and the ending signals wait from then to the process's exit (``signals.settle``, where the
        console handles them): none turns a committed copy into a run that says nothing was written."""
        self.check()
        self.renew()
        committed = write()
        signals.settle()
        return committed

    def release(self) -> None:
        """The copy is whole: stop renewing and delete the marker."""
        self._stop_renewing()
        with signals.held():
            if self._etag is not None:
                self.store.delete_own(self.marker, self._etag)
                self._etag = None

    def undo(self) -> None:
        """The run failed: delete what it wrote, and only that, then its marker."""
        self._stop_renewing()
        with signals.held():
            owned = dict(self._written)
            for key in self._writing:  # begun, never answered: this run's only if it carries this run's id
                found = self.store.owner(key)
                if found is not None and found[0] == self.store.run:
                    owned[key] = found[1].etag
            _delete_each(self.store, owned.items())
            self._delete_marker()

    def _delete_marker(self) -> None:
        """Delete this run's marker by the version it wrote last; where the store holds another version that still
        carries this run's id (a renewal took effect, its answer lost or never given), by that one. (A release
        needs no such look: its commit renewed the marker just before, and knows its version.)"""
        if self._etag is None:
            return
        self.store.delete_own(self.marker, self._etag)
        found = self.store.owner(self.marker)
        if found is not None and found[0] == self.store.run:
            self.store.delete_own(self.marker, found[1].etag)
        self._etag = None

    def _stop_renewing(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()


def _busy(store: WritableStore, marker: str, found: Small | None) -> OutputError:
    """The error of a marker that a live run holds."""
    run, lease, _ = _parsed(found)
    since = f" (renewed {found.age:.0f} s ago)" if found is not None and found.age is not None else ""
    who = f"another run ({run})" if run else "another run"
    return ObjectExists(
        f"{who} is writing a copy here{since}; if it was stopped, run again once its lease of {lease:.0f} s has lapsed",
        path=store.where(marker),
    )


def _parsed(found: Small | None) -> tuple[str | None, float, tuple[str, ...]]:
    """The run, lease and planned keys a marker names; a marker that names none is no run's of optim-repair."""
    if found is None:
        return None, DEFAULT_LEASE_SECONDS, ()
    try:
        body = json.loads(found.data)
        run, lease, planned = body["run"], float(body["lease_seconds"]), body["planned"]
    except (ValueError, KeyError, TypeError):
        return None, DEFAULT_LEASE_SECONDS, ()
    if not (isinstance(run, str) and isinstance(planned, list) and all(isinstance(key, str) for key in planned)):
        return None, DEFAULT_LEASE_SECONDS, ()
    return run, lease, tuple(planned)


def clear_stopped(store: WritableStore, marker: str, found: Small, notice: Callable[[str], None]) -> None:
    """Clear the marker ``found`` if its run stopped (its lease lapsed, by the store's clock): the objects it lists
    that its run wrote, unchanged since, then the marker. A live run's marker is refused (exit 5); a marker that
    names no run (not optim-repair's) is an object like any other."""
    run, lease, planned = _parsed(found)
    if run is None or found.run != run:
        raise OutputError(
            "is not a marker optim-repair wrote; remove it if nothing is writing here", path=store.where(marker)
        )
    if found.age is None or found.age < lease:
        raise _busy(store, marker, found)
    scope = marker.removesuffix(MARKER)  # the prefix claimed, or the one key
    owned = []
    for key in planned:
        if key != scope and not (scope.endswith("/") and key.startswith(scope)):
            continue  # a marker names only keys of what it claimed: any other is no business of this cleanup
        owner = store.owner(key)
        if owner is not None and owner[0] == run:
            owned.append((key, owner[1].etag))
    notice(f"removing {counted(len(owned), 'object')} a stopped run left at {store.where(marker)}")
    with signals.held():
        _delete_each(store, owned)
        store.delete_own(marker, found.etag)


def _delete_each(store: WritableStore, owned: Iterable[tuple[str, str]]) -> None:
    with contextlib.closing(store.each(lambda item: store.delete_own(*item), list(owned))) as done:
        for _ in done:
            pass


@contextlib.contextmanager
def claimed(
    store: WritableStore, marker: str, planned: Sequence[str], notice: Callable[[str], None]
) -> Iterator[Claim]:
    """The claim on ``marker`` for ``planned`` keys, held for the block: released when it ends, everything the run
    wrote deleted when it raises."""
    claim = Claim(store, marker, planned)
    try:
        claim.take(notice)  # a signal held while the marker is put comes the moment it is: undone here too
        yield claim
    except BaseException:
        claim.undo()
        raise
    claim.release()
