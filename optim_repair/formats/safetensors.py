"""Parameter shapes and dtypes from a ``.safetensors`` header; tensor bytes are never read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from optim_repair.errors import InputError
from optim_repair.inventory import TensorMeta, WeightMap, contiguous_strides

_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_MAX_HEADER = 100 * 1024 * 1024


def read_weights(path: Path, source: str) -> WeightMap:
    """The tensors a safetensors file describes, from its JSON header alone."""
    try:
        with path.open("rb") as stream:
            head = stream.read(8)
            if len(head) != 8:
                raise InputError(f"{source}: not a safetensors file (too short)")
            length = struct.unpack("<Q", head)[0]
            if length > _MAX_HEADER:
                raise InputError(f"{source}: not a safetensors file (header of {length} bytes)")
            header = json.loads(stream.read(length))
    except OSError as exc:
        raise InputError(f"{source}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError(f"{source}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise InputError(f"{source}: not a safetensors file (bad header)")
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(size) for size in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
            dtype = _DTYPES.get(info["dtype"], str(info["dtype"]).lower())
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{source}: not a safetensors file (bad entry {name!r})") from None
        meta = TensorMeta(dtype, shape, contiguous_strides(shape), name, 0, end - start, 8 + length + start)
        tensors.append((name, meta))
    return WeightMap(source, tuple(tensors))
