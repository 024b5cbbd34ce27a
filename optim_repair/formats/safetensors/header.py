"""A ``.safetensors`` file's header, read bounded: its length checked, its values counted before it is parsed."""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from optim_repair.errors import InputError, os_error_reason
from optim_repair.storage.disk import open_regular

SAFETENSORS_SUFFIX = ".safetensors"
_MAX_HEADER = 100 * 1024 * 1024
"""The most a header may hold, as the ``safetensors`` library itself allows."""
MAX_TENSORS = 1 << 18
"""The most tensors one file may describe: twice what the largest released models hold in all their shards."""
_VALUES_PER_TENSOR = 16
"""How many JSON values (members and elements) one tensor's entry may take: ``dtype``, ``shape`` (its
dimensions), ``data_offsets`` (two), with room to spare."""


def _header_text(stream: BinaryIO, length: int, source: str) -> str:
    """The header, decoded, once its objects and values are counted: what parsing it would make is bounded
    by ``MAX_TENSORS`` whatever the header's size. Its bytes are dropped once decoded."""
    raw = stream.read(length)
    objects, values = raw.count(b"{"), raw.count(b",") + raw.count(b"[")  # strings may hold some: over-counted
    if objects > MAX_TENSORS + 2 or values > _VALUES_PER_TENSOR * MAX_TENSORS:
        raise InputError(f"its safetensors header describes more than {MAX_TENSORS} tensors", path=source)
    return raw.decode("utf-8")


def parsed_header(path: Path, source: str, opener: Callable[[], BinaryIO] | None) -> tuple[dict[str, Any], int, int]:
    """The header as parsed JSON, how many bytes of tensor data follow it, and where they begin."""
    try:
        with (opener or partial(open_regular, path, source))() as stream:
            head = stream.read(8)
            if len(head) != 8:
                raise InputError("not a safetensors file (too short)", path=source)
            length = struct.unpack("<Q", head)[0]
            if length > _MAX_HEADER:
                raise InputError(f"not a safetensors file (header of {length} bytes)", path=source)
            header = json.loads(_header_text(stream, length, source))
            data_size = stream.seek(0, io.SEEK_END) - 8 - length
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=source) from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise InputError("not a safetensors file (bad header)", path=source) from exc
    if not isinstance(header, dict):
        raise InputError("not a safetensors file (bad header)", path=source)
    return header, data_size, 8 + length
