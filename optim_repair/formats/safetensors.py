"""Parameter shapes and dtypes from a ``.safetensors`` header; tensor bytes are never read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from optim_repair.errors import InputError, os_error_reason, shown
from optim_repair.formats.inputs import open_regular, size_of
from optim_repair.records.dtypes import DTYPES, SAFETENSORS_NAMES, contiguous_strides, itemsize, numel
from optim_repair.records.inventory import TensorMeta, WeightMap

SAFETENSORS_SUFFIX = ".safetensors"
_MAX_HEADER = 100 * 1024 * 1024


def read_weights(path: Path, source: str) -> WeightMap:
    """The tensors a safetensors file describes, from its JSON header alone."""
    try:
        with open_regular(path, source) as stream:
            head = stream.read(8)
            if len(head) != 8:
                raise InputError("not a safetensors file (too short)", path=source)
            length = struct.unpack("<Q", head)[0]
            if length > _MAX_HEADER:
                raise InputError(f"not a safetensors file (header of {length} bytes)", path=source)
            header = json.loads(stream.read(length))
            data_size = size_of(stream) - 8 - length
    except OSError as exc:
        raise InputError(f"cannot read ({os_error_reason(exc)})", path=source) from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise InputError("not a safetensors file (bad header)", path=source) from exc
    if not isinstance(header, dict):
        raise InputError("not a safetensors file (bad header)", path=source)
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
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
