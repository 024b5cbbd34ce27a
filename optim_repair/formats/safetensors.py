"""Parameter shapes and dtypes from a ``.safetensors`` header; tensor bytes are never read."""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from optim_repair.errors import InputError, os_error_reason, shown
from optim_repair.formats.inputs import open_regular
from optim_repair.records.dtypes import DTYPES, SAFETENSORS_NAMES, contiguous_strides, itemsize, numel
from optim_repair.records.inventory import TensorMeta, WeightMap

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


def _parsed_header(path: Path, source: str, opener: Callable[[], BinaryIO] | None) -> tuple[dict[str, Any], int]:
    """The header as parsed JSON, and how many bytes of tensor data follow it."""
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
    return header, data_size


def read_weights(path: Path, source: str, *, opener: Callable[[], BinaryIO] | None = None) -> WeightMap:
    """The tensors a safetensors file describes, from its JSON header alone (read from ``path``, or from what
    ``opener`` opens: an object in a store)."""
    header, data_size = _parsed_header(path, source, opener)
    metadata = header.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())):
        raise InputError("not a safetensors file (its __metadata__ is no map of strings)", path=source)
    tensors = []
    for name in list(header):
        info = header.pop(name)  # each entry is let go once described: the header is not held twice
        try:
            shape = tuple(int(size) for size in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
            dtype = SAFETENSORS_NAMES.get(info["dtype"], str(info["dtype"]).lower())
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"not a safetensors file (bad entry {shown(name)})", path=source) from exc
        sized = dtype not in DTYPES or end - start == numel(shape) * itemsize(dtype)
        if min(shape, default=0) < 0 or not 0 <= start <= end <= data_size or not sized:
            raise InputError(f"not a safetensors file (entry {shown(name)} does not fit its bytes)", path=source)
        meta = TensorMeta(dtype, shape, contiguous_strides(shape), name, 0, end - start)
        tensors.append((name, meta))
    return WeightMap(source, tuple(tensors))
