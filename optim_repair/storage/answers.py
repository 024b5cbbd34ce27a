"""A store's answers, judged before they are believed.

A request's answer is waited for within a deadline, a body read against its length and a pace, a ranged answer
against the range asked; a redirect is never followed, and a refusal is turned into the error a user is shown.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from optim_repair import signals
from optim_repair.errors import InputError, ObjectExists, OptimRepairError, OutputError, shown_name
from optim_repair.storage.names import origin, redacted

CHANGED = "changed while being read (is a run still saving it?)"
GRACE_SECONDS = 30.0
FLOOR_BYTES_PER_SECOND = 64 << 10
"""A body that, past the grace, has come slower than the floor on average is given up: botocore's own timeout is
per socket read, so a store that drips a byte a second would be waited for forever."""
WHOLE_ANSWER_BYTES = 2 << 20
"""The most an answer the client reads whole (a listing's page of a thousand keys, a HEAD) is taken to hold: it is
given the grace and the time this takes at the floor's pace (``within``)."""
_RECEIVE = 1 << 20
_Answer = TypeVar("_Answer")
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20})")
_watched = threading.local()
"""``deadline`` set in the thread of a request under ``within``."""


def receive(body: Any, length: int, sink: Callable[[bytes], None], where: str) -> int:
    """Pass ``body`` (a botocore streaming body) to ``sink`` as it arrives, one socket read at a time, refusing
    more than ``length`` bytes or, past ``GRACE_SECONDS``, a pace under ``FLOOR_BYTES_PER_SECOND``; return how
    many bytes came (fewer: the answer was cut off). Transport errors pass through, for the caller to name."""
    raw = getattr(body, "_raw_stream", body)
    read = getattr(raw, "read1", raw.read)  # one socket read at a time, so that a drip is seen as one
    started, received = time.monotonic(), 0
    with body:
        while chunk := read(min(_RECEIVE, length + 1 - received)):
            received += len(chunk)
            if received > length:
                raise InputError(f"answered with more than the {length:,} bytes asked for", path=where)
            elapsed = time.monotonic() - started
            if elapsed > GRACE_SECONDS and received < FLOOR_BYTES_PER_SECOND * elapsed:
                raise InputError(f"answers too slowly ({received:,} bytes in {elapsed:.0f} s)", path=where)
            sink(chunk)
            if received == length:
                break
    return received


def within(call: Callable[[], _Answer], where: str, host: str, *, writing: bool = False, sending: int = 0) -> _Answer:
    """What ``call`` (one request to ``host``, from its first byte sent to the last of the answer the client reads:
    a whole answer, or the status and headers of one whose body ``receive`` reads) returns or raises, given the
    grace and the time ``WHOLE_ANSWER_BYTES`` and the ``sending`` bytes of its body take at the floor's pace; past
    that, the store is given up (exit 4, or 5 ``writing``, naming ``where`` and ``host``): a status line and headers
    that drip a byte a second never trip a per-read timeout, and would be waited for forever. A call made inside
    another's deadline (a request whose whole answer is waited for) is under that one. The call runs in a thread of
    its own, left behind if it never ends: a daemon, which the process does not wait for, holding one connection of
    the client's pool."""
    if getattr(_watched, "deadline", False):
        return call()
    seconds = GRACE_SECONDS + (WHOLE_ANSWER_BYTES + sending) / FLOOR_BYTES_PER_SECOND
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        _watched.deadline = True
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # raised again in the caller's thread, whatever it was
            outcome.append((False, exc))
        finally:
            done.set()

    with signals.held():  # the thread inherits the mask: the ending signals reach the main thread alone
        threading.Thread(target=run, name="optim-repair-request", daemon=True).start()
    if not done.wait(seconds):
        kind = OutputError if writing else InputError
        raise kind(f"did not answer in time (no answer from {host} within {seconds:.0f} s)", path=where)
    answered, value = outcome[0]
    if not answered:
        raise value
    result: _Answer = value
    return result


def redirected(status: int, location: str | None, sent_to: str, where: str, writing: bool) -> OptimRepairError:
    """The error of a request to ``sent_to`` answered by a redirect (HTTP ``status``) to ``location``, which is
    never followed: a read's bytes would be judged from, and a write's body sent to, a server the user never named
    (exit 4, or 5 ``writing``, naming the host it pointed to)."""
    kind = OutputError if writing else InputError
    target = origin(location, sent_to) if location else "no address (no Location)"
    return kind(f"answered with a redirect (HTTP {status}) to {target}, which is not followed", path=where)


def cut(received: int, expected: int) -> str:
    return f"the store's answer was cut off after {received:,} of {expected:,} bytes"


def check_range(answer: dict[str, Any], asked: tuple[int, int, int] | None, where: str) -> int:
    """The object's size, from the Content-Range of a 206 answer (or a 200 giving the whole object, where that is
    the range ``asked``); anything else than the range ``asked`` (first and last byte, and the size; None: a range
    at the end), or a number of more digits than a size has, is refused before its body is read."""
    status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if (
        status == 200
        and asked is not None
        and asked[:2] == (0, asked[2] - 1)
        and answer.get("ContentLength") == asked[2]
    ):
        return asked[2]  # the range asked was the whole object, and a 200 may give it so
    given = str(answer.get("ContentRange", ""))
    matched = _CONTENT_RANGE.fullmatch(given)
    if status != 206 or matched is None:
        answer["Body"].close()
        reason = (
            f"answered a read by range with its whole body (HTTP {status}, not 206)"
            if status != 206
            else f"answered a read by range with a Content-Range of no range ({shown_name(given[:100])})"
        )
        raise InputError(reason, path=where)
    first, last, size = (int(value) for value in matched.groups())
    if (asked is not None and (first, last, size) != asked) or last < first or last >= size:
        answer["Body"].close()
        raise InputError(f"answered a read of another range than was asked ({matched[0]})", path=where)
    return size


_DENIED = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccountProblem"}


def failure(response: dict[str, Any], where: str, writing: bool) -> OptimRepairError:
    """The error of a request the store refused: denied is exit 4, naming bucket and key; a write that would
    replace an object (412, 409) is exit 5; a read of an object replaced since it was listed says so."""
    error, status = response.get("Error", {}), response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code, message = str(error.get("Code", status)), str(error.get("Message", "")).rstrip(".")
    if code in _DENIED or status == 403:
        return InputError(f"access denied ({code})", path=where)
    if code == "NoSuchBucket":
        return InputError("no such bucket", path=where)
    if code in ("NoSuchKey", "404", "NotFound"):
        return InputError("no such object (was it deleted meanwhile?)", path=where)
    if status in (409, 412) and writing:
        return ObjectExists("exists: another writer put an object there first", path=where)
    if status == 412:
        return InputError(CHANGED, path=where)
    if code == "NoSuchUpload":
        return InputError("no such upload (completed or aborted meanwhile)", path=where)
    kind = OutputError if writing else InputError
    return kind(f"the store refused the request ({code}: {redacted(message)})", path=where)
