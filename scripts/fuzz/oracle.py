"""A second opinion on every successful ``fix``: torch's own loaders read the original and the copy.

For each file the repair read, ``torch.load(weights_only=True)`` (a DCP checkpoint: DCP's own reader, with
no template) must accept the original (else optim-repair repaired what torch refuses), unless torch refuses
only a tensor record of a DCP shard, whose bytes optim-repair never reads (an opcode its weights-only unpickler
lacks, as a pickle of protocol 3 or more holds, is no exception: optim-repair refuses such a file too). The copy
must load, and, when no model operation renamed or dropped anything, every value of the original must be in the
copy, bit for bit (the copy may only add entries). Returns the problems found, each a (kind, detail) pair.
"""

from __future__ import annotations

import contextlib
import os
import re
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

        class RankReader(FileSystemReader):
            """Reads one rank's own metadata, as ``dcp.load`` on that rank falls back to it."""

            def __init__(self, rank: int | None) -> None:
                super().__init__(path)
                self.own = rank

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return super().read_metadata() if self.own is None else super().read_metadata(rank=self.own)

        # saved without collectives: each rank's own view, loaded as that rank loads it
        ranks = sorted(int(name[2:-9]) for name in os.listdir(path) if re.fullmatch(r"__[0-9]+\.metadata", name))
        views: dict[int | None, dict[str, Any]] = {}
        for rank in [None] if (path / ".metadata").exists() or not ranks else ranks:
            views[rank] = {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                planner = _EmptyStateDictLoadPlanner()
                _load_state_dict(views[rank], RankReader(rank), planner=planner, no_dist=True)
        return views.get(None, views)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


@contextlib.contextmanager
def _reads_strides() -> Iterator[None]:
    """This torch's ``TensorProperties`` takes torch 2.15's six fields too (the strides dropped): an original the
    fuzzer pickled as 2.15 does is read as 2.15 reads it; a copy is always read by this torch as it is."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    own = TensorProperties.__setstate__

    def either(self: Any, state: tuple[Any, ...]) -> None:
        own(self, state[:5] if isinstance(state, tuple) and len(state) == 6 else state)

    TensorProperties.__setstate__ = either  # type: ignore[method-assign]
    try:
        yield
    finally:
        TensorProperties.__setstate__ = own  # type: ignore[method-assign]


def _untransformed(stream: Any, info: Any) -> bytes:
    """An entry's bytes as torch's reader hands them on: through its stream transforms (``stream.zstd``), in the
    order torch applies them."""
    descriptors = getattr(info, "transform_descriptors", None) or ()
    if descriptors:
        from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

        for extension in ExtensionRegistry().from_descriptor_list(descriptors):
            if isinstance(extension, StreamTransformExtension):
                stream = extension.transform_from(stream)
    data: bytes = stream.read(-1)
    return data


def _only_tensor_records_refused(path: Path) -> bool:
    """Whether torch reads a DCP checkpoint's ``.metadata`` and every bytes entry (through its transforms, as
    ``dcp.load`` does): then what it refused is in a tensor record of a shard, whose bytes optim-repair by design
    never reads (inspect reads metadata only)."""
    import io

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    ranks = [int(name[2:-9]) for name in os.listdir(path) if re.fullmatch(r"__[0-9]+\.metadata", name)]
    try:
        for rank in [None] if (path / ".metadata").exists() or not ranks else ranks:
            reader = FileSystemReader(path)
            metadata = reader.read_metadata() if rank is None else reader.read_metadata(rank=rank)
            for index, info in metadata.storage_data.items():
                if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                    with open(path / info.relative_path, "rb") as stream:
                        stream.seek(info.offset)
                        raw = _untransformed(io.BytesIO(stream.read(info.length)), info)
                        torch.load(io.BytesIO(raw), weights_only=True)
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
            with _reads_strides():
                before = _load(source)
        except refusals as exc:
            with _reads_strides():
                tolerated = source.is_dir() and _only_tensor_records_refused(source)
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
