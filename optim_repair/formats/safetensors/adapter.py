"""The safetensors format's adapter: parameter shapes and dtypes of model weights, from the header alone.

A safetensors file holds no optimizer: it is read for the weights it describes (the shapes ``--model`` and the
files beside a checkpoint give) and copied as it is. Tensor bytes are never read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from optim_repair.errors import InputError, shown
from optim_repair.formats.safetensors.header import parsed_header
from optim_repair.records.dtypes import DTYPES, SAFETENSORS_NAMES, contiguous_strides, itemsize, numel
from optim_repair.records.inventory import TensorMeta, WeightMap

SHARDING_INFO = "DCP_SHARDING_INFO"
"""The ``__metadata__`` key in which DCP's ``HuggingFaceStorageWriter`` says where each shard lies."""


def read_weights(path: Path, source: str, *, opener: Callable[[], BinaryIO] | None = None) -> WeightMap:
    """The tensors a safetensors file describes, from its JSON header alone (read from ``path``, or from what
    ``opener`` opens: an object in a store)."""
    return placed_weights(path, source, opener=opener)[0]


def placed_weights(
    path: Path, source: str, *, opener: Callable[[], BinaryIO] | None = None
) -> tuple[WeightMap, dict[str, int]]:
    """``read_weights``, and where in the file each tensor's bytes begin."""
    header, data_size, data_start = parsed_header(path, source, opener)
    starts: dict[str, int] = {}
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
        starts[name] = data_start + start
    return WeightMap(source, tuple(tensors), _shard_offsets(metadata, dict(tensors), source)), starts


def _shard_offsets(
    metadata: dict[str, str], tensors: dict[str, TensorMeta], source: str
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Where each tensor's shard begins in its whole tensor, as DCP's ``HuggingFaceStorageWriter`` records it in
    ``DCP_SHARDING_INFO`` (``{name: {"saved_offsets": [...]}}``, one entry per tensor of the file); () for a file
    of whole tensors."""
    text = metadata.get(SHARDING_INFO)
    if text is None:
        return ()
    try:
        info = json.loads(text)
        offsets = {name: tuple(int(offset) for offset in info[name]["saved_offsets"]) for name in tensors}
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise InputError(
            f"not a safetensors file (its {SHARDING_INFO} gives no offsets of each tensor)", path=source
        ) from exc
    for name, meta in tensors.items():
        if len(offsets[name]) != len(meta.shape) or min(offsets[name], default=0) < 0:
            raise InputError(f"not a safetensors file (its {SHARDING_INFO} misplaces {shown(name)})", path=source)
    return tuple(offsets.items())


def joined_shards(weights: Sequence[WeightMap], source: str) -> tuple[WeightMap, ...]:
    """``weights`` with the shards of one model saved by rank (``WeightMap.offsets``) joined into one map of whole
    tensors named ``source``: each tensor reaches as far, in each dimension, as its furthest shard."""
    sharded = [weight for weight in weights if weight.offsets]
    if not sharded:
        return tuple(weights)
    whole: dict[str, TensorMeta] = {}
    for weight in sharded:
        offsets = dict(weight.offsets)
        for name, meta in weight.tensors:
            reach = tuple(start + size for start, size in zip(offsets[name], meta.shape, strict=True))
            if name in whole:
                reach = tuple(max(a, b) for a, b in zip(reach, whole[name].shape, strict=True))
            whole[name] = TensorMeta(
                meta.dtype, reach, contiguous_strides(reach), name, 0, numel(reach) * itemsize(meta.dtype)
            )
    joined = WeightMap(source, tuple(whole.items()))
    return (*(weight for weight in weights if not weight.offsets), joined)
