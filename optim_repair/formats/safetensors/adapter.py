"""The safetensors format's adapter: parameter shapes and dtypes of model weights, from the header alone.

A safetensors file holds no optimizer: it is read for the weights it describes (the shapes ``--model`` and the
files beside a checkpoint give) and copied as it is. Tensor bytes are never read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from optim_repair.errors import InputError, shown
from optim_repair.formats.safetensors.header import parsed_header
from optim_repair.records.dtypes import DTYPES, SAFETENSORS_NAMES, contiguous_strides, itemsize, numel
from optim_repair.records.inventory import TensorMeta, WeightMap


def read_weights(path: Path, source: str, *, opener: Callable[[], BinaryIO] | None = None) -> WeightMap:
    """The tensors a safetensors file describes, from its JSON header alone (read from ``path``, or from what
    ``opener`` opens: an object in a store)."""
    header, data_size = parsed_header(path, source, opener)
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
