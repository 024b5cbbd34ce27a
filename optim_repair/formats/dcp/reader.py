"""The inventory of a DCP checkpoint: its optimizers and model weights, from ``.metadata`` and bytes entries.

Shapes and dtypes come from the metadata alone; of the shards only the optimizers' bytes entries
(``param_groups`` and non-tensor state) are read. No tensor bytes, and torch is not imported.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from optim_repair.errors import InputError
from optim_repair.formats.dcp.layout import DcpOptimizer, find_optimizers, longest_name, model_weights
from optim_repair.formats.dcp.metadata import (
    METADATA_FILE,
    DcpBytes,
    DcpMetadata,
    DcpTensor,
    display_path,
    metadata_names,
    view_key,
)
from optim_repair.formats.dcp.metadata_reader import read_metadata, read_summary
from optim_repair.formats.dcp.storage import LocalShards, ShardFiles, check_ranges, read_bytes_entries
from optim_repair.formats.pickled import option_value, state_value
from optim_repair.records.inventory import (
    FileInventory,
    OptimizerInventory,
    ParamGroup,
    ParamKey,
    StateEntry,
    StateValue,
    TensorMeta,
    WeightMap,
    key_style,
)
from optim_repair.records.keys import dotted


def _state_value(meta: DcpMetadata, key: str, values: Mapping[str, Any]) -> StateValue:
    item = meta.items[key]
    return item.meta(key) if isinstance(item, DcpTensor) else state_value(values[key], tensors=False)


def _option_value(meta: DcpMetadata, key: str, values: Mapping[str, Any]) -> StateValue | tuple[StateValue, ...]:
    item = meta.items[key]
    return item.meta(key) if isinstance(item, DcpTensor) else option_value(values[key], tensors=False)


def _state_entries(
    meta: DcpMetadata, state: Sequence[tuple[ParamKey, str, str]], values: Mapping[str, Any]
) -> tuple[StateEntry, ...]:
    by_param: dict[ParamKey, list[tuple[str, StateValue]]] = {}
    for param, state_key, key in state:
        by_param.setdefault(param, []).append((state_key, _state_value(meta, key, values)))
    return tuple(StateEntry(param, tuple(items)) for param, items in by_param.items())


def _nested_layout(
    optimizer: DcpOptimizer, meta: DcpMetadata, values: Mapping[str, Any], source: str
) -> tuple[tuple[ParamGroup, ...], tuple[StateEntry, ...]]:
    params: dict[int, tuple[ParamKey, ...]] = {}
    options: dict[int, list[tuple[str, StateValue | tuple[StateValue, ...]]]] = {}
    state: list[tuple[ParamKey, str, str]] = []
    for slot in optimizer.slots:
        head, tail = slot.rest[0], dotted(slot.rest[1:])
        if slot.section == "state":
            state.append((head, tail, slot.key))
            continue
        if not isinstance(head, int):
            raise InputError(f"{slot.key} is not under a param_groups index", path=source)
        options.setdefault(head, [])
        if tail != "params":
            options[head].append((tail, _option_value(meta, slot.key, values)))
            continue
        names = values.get(slot.key)
        if not isinstance(names, list) or not all(
            isinstance(name, (str, int)) and not isinstance(name, bool) for name in names
        ):
            raise InputError(f"{slot.key} is not a list of parameter names", path=source)
        params[head] = tuple(names)
    missing = sorted(set(options) - set(params))
    if missing:
        raise InputError(f"{optimizer.location}.param_groups.{missing[0]} has no params list", path=source)
    groups = tuple(ParamGroup(params[index], tuple(options[index])) for index in sorted(options))
    return groups, _state_entries(meta, state, values)


def _comparable_option(value: StateValue | tuple[StateValue, ...]) -> object:
    if isinstance(value, TensorMeta):
        return ("tensor", value.dtype, value.shape)
    return value


def _flattened_layout(
    optimizer: DcpOptimizer, meta: DcpMetadata, values: Mapping[str, Any], known: Collection[str], source: str
) -> tuple[tuple[ParamGroup, ...], tuple[StateEntry, ...]]:
    per_name: dict[str, list[tuple[str, StateValue | tuple[StateValue, ...]]]] = {}
    for slot in optimizer.slots:
        if slot.section != "param_groups":
            continue
        name = longest_name(slot.flat, known)
        if name is None:
            # Not a model weight's name: an option key is a param-group dict key, which has no dot.
            name = slot.flat.rpartition(".")[0]
        if not name:
            raise InputError(f"{slot.key} names no parameter", path=source)
        option = dotted((slot.flat[len(name) + 1 :], *slot.rest))
        per_name.setdefault(name, []).append((option, _option_value(meta, slot.key, values)))
    grouped: dict[object, tuple[list[str], list[tuple[str, StateValue | tuple[StateValue, ...]]]]] = {}
    for name, opts in per_name.items():
        signature = tuple((option, _comparable_option(value)) for option, value in opts)
        grouped.setdefault(signature, ([], opts))[0].append(name)
    groups = tuple(ParamGroup(tuple(names), tuple(opts)) for names, opts in grouped.values())
    state: list[tuple[ParamKey, str, str]] = []
    for slot in optimizer.slots:
        if slot.section != "state":
            continue
        name = longest_name(slot.flat, per_name.keys())
        if name is None:
            raise InputError(f"{slot.key} is state of no parameter in the param_groups", path=source)
        state.append((name, dotted((slot.flat[len(name) + 1 :], *slot.rest)), slot.key))
    return groups, _state_entries(meta, state, values)


STRIDES_RELEASE = (2, 15)
"""The torch release that added ``strides`` to ``TensorProperties``: an older one cannot unpickle a ``.metadata``
that records them ("too many values to unpack (expected 5)")."""


def read_dcp(
    path: Path,
    rel: str,
    *,
    keep: dict[str, DcpMetadata] | None = None,
    shards: ShardFiles | None = None,
    names: Sequence[str] | None = None,
) -> FileInventory:
    """The optimizers (and model weights) of the DCP directory ``path``, from its metadata alone.

    ``rel`` is the directory relative to the user's argument ("" when it is the argument); ``keep``
    receives the metadata under ``rel``, read whole, for a writer to reuse instead of reading it again (without
    it, the metadata is summarized as it is read: ``read_summary``). Only the
    optimizers' bytes entries are read from the shards (the others are checked as archives, not unpickled);
    no tensor bytes, and torch is not imported. ``shards`` is where the shards are read: by default the files
    beside ``.metadata``; for a checkpoint in object storage, its objects (``path`` then holds the metadata alone).

    ``names`` are its metadata files (by default those ``path`` holds, ``metadata_names``). A checkpoint saved
    without collectives has one a rank, each that rank's own view (its entries, in its own shards): each view is
    read on its own, its optimizers addressed under its name (``("__1.metadata", "optim")``), and its metadata
    kept under ``rel/__1.metadata``.
    """
    names = tuple(names) if names is not None else metadata_names(os.listdir(path))
    if not names:
        raise InputError("holds no .metadata (torch's DCP writer writes it last)", path=rel or str(path))
    if names == (METADATA_FILE,):
        return _read_view(path, rel, METADATA_FILE, keep, shards or LocalShards(path))
    views = [_read_view(path, rel, name, keep, shards or LocalShards(path)) for name in names]
    released = [view.reads_from for view in views if view.reads_from is not None]
    return FileInventory(
        file=rel,
        format="dcp",
        optimizers=tuple(
            replace(optimizer, address=(name, *optimizer.address), location=f"{name}:{optimizer.location}")
            for name, view in zip(names, views, strict=True)
            for optimizer in view.optimizers
        ),
        weights=tuple(weights for view in views for weights in view.weights),
        reads_from=max(released) if released else None,
        views=names,
    )


def _read_view(
    path: Path, rel: str, name: str, keep: dict[str, DcpMetadata] | None, shards: ShardFiles
) -> FileInventory:
    """The optimizers and weights one metadata file of ``path`` describes."""
    if keep is None:
        meta = read_summary(path, rel, name)
    else:
        meta = keep[view_key(rel, name)] = read_metadata(path, rel, name=name)
    source = display_path(rel, name)
    optimizers = find_optimizers(meta, source)
    wanted = [
        slot.key for optimizer in optimizers for slot in optimizer.slots if isinstance(meta.items[slot.key], DcpBytes)
    ]
    try:
        check_ranges(shards, meta, rel)
    except InputError:
        if meta.summarized:  # the whole read names the entry it meets first, as every reader of it would
            check_ranges(shards, read_metadata(path, rel, name=name), rel)
        raise
    optimizer_keys = set(wanted)
    others = [key for key, item in meta.items.items() if isinstance(item, DcpBytes) and key not in optimizer_keys]
    values = read_bytes_entries(shards, meta, wanted, others, rel, name)
    weights = model_weights(meta, optimizers)
    known = {weight for tensors in weights.values() for weight in tensors}
    inventories = []
    for optimizer in optimizers:
        if optimizer.layout == "nested":
            groups, entries = _nested_layout(optimizer, meta, values, source)
        else:
            groups, entries = _flattened_layout(optimizer, meta, values, known, source)
        params = [param for group in groups for param in group.params]
        inventories.append(
            OptimizerInventory(
                file=rel,
                location=optimizer.location,
                address=optimizer.root,
                key_style=key_style(params),
                groups=groups,
                entries=entries,
                layout=optimizer.layout,
            )
        )
    where = rel or "." if name == METADATA_FILE else source
    weight_maps = tuple(
        WeightMap(f"{where}:{dotted(prefix) or '<top level>'}", tuple(tensors.items()))
        for prefix, tensors in weights.items()
    )
    strides = any(isinstance(item, DcpTensor) and item.strides is not None for item in meta.items.values())
    return FileInventory(
        file=rel, format="dcp", optimizers=tuple(inventories), weights=weight_maps,
        reads_from=STRIDES_RELEASE if strides else None,
    )  # fmt: skip
