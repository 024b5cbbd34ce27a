"""What inspect needs from a torch file: its optimizers and model weights, found by structure.

No tensor bytes are read but one-element tensors (``step``) and, only for a phantom-step
candidate, the first ``PHANTOM_PROBE_BYTES`` of each moment.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from optim_repair.errors import InputError, shown
from optim_repair.formats.addresses import describe_address, walk
from optim_repair.formats.pickled import is_tensor, option_value, state_value, tensor_meta
from optim_repair.formats.torchfile.files import Opener, TorchFile, open_torch_file
from optim_repair.records import keys
from optim_repair.records.dtypes import decode_element, itemsize
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
from optim_repair.storage.disk import open_regular

PHANTOM_PROBE_BYTES = 4096
"""How many leading bytes of a moment inspect reads, only when every ``step`` of an optimizer is 1."""


class _SmallReads:
    """The few bytes inspect reads: one-element tensors, and moment heads for phantom-step."""

    def __init__(self, torch_file: TorchFile, stream: BinaryIO) -> None:
        self._file = torch_file
        self._stream = stream

    def read(self, meta: TensorMeta, limit: int) -> bytes:
        """The tensor's first bytes, at most ``limit``; only ever called for a tensor inside its storage."""
        offset, _ = self._file.storage_range(meta.storage)
        self._stream.seek(offset + meta.storage_offset * itemsize(meta.dtype))
        return self._stream.read(min(meta.nbytes, limit))

    def scalar(self, meta: TensorMeta) -> TensorMeta:
        if meta.numel != 1 or meta.nbytes > 16 or not meta.in_bounds:
            return meta
        return replace(meta, value=decode_element(meta.dtype, self.read(meta, meta.nbytes)))

    def zero_head(self, meta: TensorMeta) -> TensorMeta:
        if not meta.in_bounds:
            return meta
        if meta.numel == 0:
            return replace(meta, zero_head=True)
        return replace(meta, zero_head=not any(self.read(meta, PHANTOM_PROBE_BYTES)))


def _is_optimizer(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    state, groups = node.get("state"), node.get("param_groups")
    return (
        isinstance(state, dict)
        and isinstance(groups, list)
        and all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups)
    )


def _is_flattened_optimizer(node: Any) -> bool:
    """``get_optimizer_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=True))``:
    every key is ``state.<fqn>.<key>`` or ``param_groups.<fqn>.<hyperparameter>``, and some are the latter."""
    return (
        isinstance(node, dict)
        and bool(node)
        and all(isinstance(key, str) and key.startswith(keys.FLAT_PREFIXES) and key.count(".") >= 2 for key in node)
        and any(keys.section_of(key) == keys.PARAM_GROUPS for key in node)
    )


def _unflattened(node: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state dict in the nested form: entries from the ``state.`` keys (split at the
    longest parameter name the ``param_groups.`` keys give), and one group per set of equal
    hyperparameters, in the order the parameters first appear (as torch's groups are, when they differ)."""
    options: dict[str, dict[str, Any]] = {}
    for key, value in node.items():
        section, name, option = keys.split_flat(key)
        if section == keys.PARAM_GROUPS:
            options.setdefault(name, {})[option] = value
    state: dict[str, dict[str, Any]] = {}
    for key, value in node.items():
        if keys.section_of(key) == keys.STATE:
            flat = key[len(keys.FLAT_PREFIXES[0]) :]
            name, option = flat.rsplit(".", 1)
            while name not in options and "." in name:  # a parameter in no group: an orphan, named as it can be
                name = name.rsplit(".", 1)[0]
            if name not in options:
                name = flat.rsplit(".", 1)[0]
            state.setdefault(name, {})[flat[len(name) + 1 :]] = value
    groups: list[dict[str, Any]] = []
    for name, hyperparameters in options.items():
        group = next((g for g in groups if _same_options(g, hyperparameters)), None)
        if group is None:
            group = {**hyperparameters, "params": []}
            groups.append(group)
        group["params"].append(name)
    return {keys.STATE: state, keys.PARAM_GROUPS: groups}


def _same_options(group: dict[str, Any], options: dict[str, Any]) -> bool:
    return group.keys() - {"params"} == options.keys() and all(
        option_value(group[key]) == option_value(value) for key, value in options.items()
    )


def _state_entry(param: ParamKey, value: Any, reads: _SmallReads) -> StateEntry:
    if not isinstance(value, dict):
        return StateEntry(param, None, "tensor" if is_tensor(value) else type(value).__name__)
    items: list[tuple[str, StateValue]] = []
    for key, item in value.items():
        converted = state_value(item)
        if isinstance(converted, TensorMeta):
            converted = reads.scalar(converted)
        items.append((key if isinstance(key, str) else shown(key), converted))
    return StateEntry(param, tuple(items))


def _check_keys(node: dict[Any, Any], source: str, location: str) -> None:
    """Parameter keys are names or indices; anything else (a list, a float NaN, bytes) is damage."""
    for key in [*(param for group in node["param_groups"] for param in group["params"]), *node["state"]]:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise InputError(
                f"the optimizer at {location or 'the top level'} has the parameter key {shown(key)}, "
                "neither a name nor an index",
                path=source,
            )


def _probe_phantom(entries: list[StateEntry], reads: _SmallReads) -> list[StateEntry]:
    """Probe the moment heads of the entries whose ``step`` is 1: phantom-step candidates.

    At most ``PHANTOM_PROBE_BYTES`` of each moment are read, so the cost stays bounded by the
    number of entries, never by the size of the tensors.
    """
    probed = []
    for entry in entries:
        step = entry.get("step")
        if entry.values and isinstance(step, TensorMeta) and step.value == 1:
            values = tuple(
                (key, reads.zero_head(value) if isinstance(value, TensorMeta) and key != "step" else value)
                for key, value in entry.values
            )
            entry = replace(entry, values=values)
        probed.append(entry)
    return probed


def _optimizer_inventory(
    found: dict[Any, Any], file: str, address: tuple[Any, ...], reads: _SmallReads, source: str
) -> OptimizerInventory:
    flattened = _is_flattened_optimizer(found)
    node = _unflattened(found) if flattened else found
    _check_keys(node, source, describe_address(address))
    groups = tuple(
        ParamGroup(
            params=tuple(group["params"]),
            options=tuple(
                (key if isinstance(key, str) else shown(key), option_value(value))
                for key, value in group.items()
                if key != "params"
            ),
        )
        for group in node["param_groups"]
    )
    entries = _probe_phantom([_state_entry(param, value, reads) for param, value in node["state"].items()], reads)
    keys = [param for group in groups for param in group.params] + [entry.param for entry in entries]
    return OptimizerInventory(
        file=file,
        location=describe_address(address),
        address=address,
        key_style=key_style(keys),
        groups=groups,
        entries=tuple(entries),
        layout="flattened" if flattened else "nested",
    )


def _weight_map(node: dict[Any, Any], source: str) -> WeightMap | None:
    if not node or not all(isinstance(key, str) for key in node):
        return None
    tensors = []
    for key, value in node.items():
        meta = tensor_meta(value)
        if meta is None or not meta.in_bounds:  # a damaged record is no source of shapes
            return None
        tensors.append((key, meta))
    return WeightMap(source, tuple(tensors), in_model_order=True)


def find_optimizers(root: Any) -> list[tuple[tuple[Any, ...], dict[Any, Any]]]:
    """Every optimizer state dict in a graph, recognised by structure, outermost only."""
    found: list[tuple[tuple[Any, ...], dict[Any, Any]]] = []
    for address, node in walk(root):
        if any(address[: len(outer)] == outer for outer, _ in found):
            continue
        if _is_optimizer(node) or _is_flattened_optimizer(node):
            found.append((address, node))
    return found


def read_inventory(
    path: Path, file: str, source: str, *, keep: dict[str, TorchFile] | None = None, opener: Opener | None = None
) -> FileInventory:
    """Everything inspect needs from one torch file, reading no tensor bytes but ``step`` values.

    With ``keep``, the parsed file is kept there under ``file`` when it holds an optimizer, for a
    writer to reuse instead of parsing it again. ``opener`` opens it (by default ``path``, as a regular file).
    """
    opener = opener or partial(open_regular, path, source)
    torch_file = open_torch_file(path, source, opener=opener)
    found = find_optimizers(torch_file.graph.root)
    with opener() as stream:
        reads = _SmallReads(torch_file, stream)
        optimizers = tuple(_optimizer_inventory(node, file, address, reads, source) for address, node in found)
    weights = []
    for address, node in walk(torch_file.graph.root):
        if isinstance(node, dict) and not any(address[: len(outer)] == outer for outer, _ in found):
            weight_map = _weight_map(node, f"{source}:{describe_address(address)}" if address else source)
            if weight_map is not None:
                weights.append(weight_map)
    if keep is not None and optimizers:
        keep[file] = torch_file
    return FileInventory(file=file, format=torch_file.kind, optimizers=optimizers, weights=tuple(weights))
