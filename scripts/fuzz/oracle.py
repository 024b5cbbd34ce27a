"""A second opinion on every successful ``fix``: torch's own loaders read the original and the copy.

For each file the repair read, ``torch.load(weights_only=True)`` (a DCP checkpoint: DCP's own reader, with
no template) must accept the original (else optim-repair repaired what torch refuses), unless torch refuses
only a tensor record of a DCP shard, whose bytes optim-repair never reads, or only an opcode its weights-only
unpickler lacks (a pickle of protocol 3 or more, which ``torch.save(pickle_protocol=...)`` writes and
``weights_only=False`` reads; the copy is pickled with protocol 2). The copy must load, and,
when no model operation renamed or dropped anything, every value of the original must be in the copy, bit
for bit (the copy may only add entries). Returns the problems found, each a (kind, detail) pair.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Problem = tuple[str, str]


def _refusals() -> tuple[type[BaseException], ...]:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    return Exception, CheckpointException


def _load(path: Path) -> Any:
    import torch

    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state: dict[str, Any] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _load_state_dict(state, FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        return state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def _only_tensor_records_refused(path: Path) -> bool:
    """Whether torch reads a DCP checkpoint's ``.metadata`` and every bytes entry: then what it refused is in a
    tensor record of a shard, whose bytes optim-repair by design never reads (inspect reads metadata only)."""
    import io

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        metadata = FileSystemReader(path).read_metadata()
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                with open(path / info.relative_path, "rb") as stream:
                    stream.seek(info.offset)
                    torch.load(io.BytesIO(stream.read(info.length)), weights_only=True)
    except Exception:
        return False
    return True


def _bits(tensor: Any) -> tuple[Any, ...]:
    """A tensor as what a resume sees: dtype, shape, stride and every byte (NaN payloads and -0.0 kept)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    data = bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""
    return str(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()), data


def _differences(original: Any, copy: Any, where: str, seen: set[tuple[int, int]] | None = None) -> Iterator[str]:
    """Where ``copy`` lacks or changes a value of ``original`` (a dict of the copy may hold more keys). Each pair of
    containers is compared once (``seen``): a pickle whose lists share their items (a billion laughs) is a small
    graph, however large a tree it unfolds to."""
    import torch

    seen = set() if seen is None else seen
    if isinstance(original, (dict, list, tuple)):
        if (id(original), id(copy)) in seen:
            return
        seen.add((id(original), id(copy)))
    if isinstance(original, torch.Tensor):
        if not isinstance(copy, torch.Tensor):
            yield f"{where}: a tensor became {type(copy).__name__}"
        elif _bits(original) != _bits(copy):
            yield f"{where}: the tensor changed"
    elif isinstance(original, dict):
        if not isinstance(copy, dict):
            yield f"{where}: a dict became {type(copy).__name__}"
            return
        for key, value in original.items():
            if key not in copy:
                yield f"{where}: {key!r} is gone"
            else:
                yield from _differences(value, copy[key], f"{where}.{key}", seen)
    elif isinstance(original, (list, tuple)):
        if type(original) is not type(copy) or len(original) != len(copy):
            yield f"{where}: a {type(original).__name__} of {len(original)} changed"
            return
        for index, (a, b) in enumerate(zip(original, copy, strict=True)):
            yield from _differences(a, b, f"{where}[{index}]", seen)
    elif type(original) is not type(copy) or (original != copy and original == original):  # NaN equals NaN
        yield f"{where}: {original!r} became {copy!r}"


def _reason(exc: BaseException) -> str:
    """The innermost error's line: DCP wraps each rank's failure, with its traceback, in its own exception."""
    lines = [line for line in str(exc).splitlines() if "Error" in line or "Exception" in line]
    return (lines[-1].strip() if lines else f"{type(exc).__name__}: {exc}")[:500]


def check(original: Path, copy: Path, files: list[str], *, compare: bool) -> list[Problem]:
    """The problems torch's loaders find with a fix of ``original`` into ``copy`` (``files``: the files, or DCP
    directories, relative to them that the repair read; ``""`` for the argument itself)."""
    problems: list[Problem] = []
    refusals = _refusals()
    for rel in files:
        source, target = (original / rel, copy / rel) if rel else (original, copy)
        try:
            before = _load(source)
        except refusals as exc:
            tolerated = "Unsupported operand" in str(exc) or (source.is_dir() and _only_tensor_records_refused(source))
            if not tolerated:
                problems.append(("torch-refuses-original", f"{rel or source.name}: {_reason(exc)}"))
            continue
        try:
            after = _load(target)
        except refusals as exc:
            problems.append(("torch-refuses-copy", f"{rel or target.name}: {_reason(exc)}"))
            continue
        if compare:
            changed = list(_differences(before, after, rel or "<root>"))
            if changed:
                problems.append(("torch-copy-differs", "; ".join(changed[:3])[:500]))
    return problems
