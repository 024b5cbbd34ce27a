"""Reading a DeepSpeed universal checkpoint per parameter: each parameter's files, parsed without tensor bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePosixPath
from typing import Any

from optim_repair.errors import InputError
from optim_repair.formats.pickled import tensor_meta
from optim_repair.formats.torchfile import TorchFile
from optim_repair.records.inventory import (
    FileInventory,
    OptimizerInventory,
    ParamGroup,
    StateEntry,
    TensorMeta,
    WeightMap,
)

STATE_FILE = "zero/optimizer_state.pt"
"""What marks a directory as a universal checkpoint: the param groups ``ds_to_universal`` writes."""
MODEL_STATES = "mp_rank_00_model_states.pt"
MASTER = "fp32"
"""The per-parameter file of the master weight; every other one is optimizer state."""

Parse = Callable[[str], TorchFile]
"""Parses the torch file at a path relative to the checkpoint argument."""


def universal_roots(rels: Iterable[str]) -> tuple[str, ...]:
    """The universal checkpoints among the files ``rels`` (paths relative to the argument): each directory that
    holds ``zero/optimizer_state.pt`` (``""``: the argument itself)."""
    roots = (rel[: -len(STATE_FILE)].rstrip("/") for rel in rels if rel == STATE_FILE or rel.endswith(f"/{STATE_FILE}"))
    return tuple(sorted(set(roots)))


def member_of(rel: str, roots: Sequence[str]) -> str | None:
    """The universal checkpoint whose ``zero/`` directory holds the file ``rel``, or None."""
    for root in roots:
        if rel.startswith(f"{root}/zero/" if root else "zero/"):
            return root
    return None


def _tensor(value: Any, where: str) -> TensorMeta:
    """The tensor a per-parameter file holds: a dict's ``param``, or the file's root (``step.pt``)."""
    if isinstance(value, dict):
        value = value.get("param")
    meta = tensor_meta(value)
    if meta is None:
        raise InputError("holds no tensor (a universal checkpoint's file holds {'param': tensor} or one)", path=where)
    return meta


def _frozen(parse: Parse, root: str, listed: Iterable[str]) -> frozenset[str]:
    """The parameters ``mp_rank_00_model_states.pt`` beside ``zero/`` lists as frozen (``frozen_param_shapes``)."""
    rel = f"{root}/{MODEL_STATES}" if root else MODEL_STATES
    if rel not in listed:
        return frozenset()
    states = parse(rel).graph.root
    shapes = states.get("frozen_param_shapes") if isinstance(states, dict) else None
    return frozenset(name for name in shapes if isinstance(name, str)) if isinstance(shapes, dict) else frozenset()


def read_universal(
    parse: Parse, root: str, rels: Sequence[str], listed: Iterable[str], named: Callable[[str], str]
) -> FileInventory:
    """The universal checkpoint ``root``: its parameters' files among ``rels``, each parsed by ``parse`` (no tensor
    bytes are read), as one optimizer of name-keyed entries; the master weights give the parameters' shapes.
    ``listed``: every file of the checkpoint argument; ``named`` names a file for messages."""
    zero = f"{root}/zero" if root else "zero"
    files: dict[str, list[tuple[str, str]]] = {}
    for rel in rels:
        inside = PurePosixPath(rel[len(zero) + 1 :])
        if len(inside.parts) == 2 and inside.suffix == ".pt":
            files.setdefault(inside.parts[0], []).append((inside.stem, rel))
    frozen = _frozen(parse, root, listed)
    entries, masters, params = [], [], []
    for param in sorted(files):
        values = []
        for key, rel in sorted(files[param]):
            meta = _tensor(parse(rel).graph.root, named(rel))
            if key == MASTER:
                masters.append((param, meta))
            else:
                values.append((key, meta))
        if values or param not in frozen:
            params.append(param)
        if values:
            entries.append(StateEntry(param, tuple(values)))
    optimizer = OptimizerInventory(
        file=zero,
        location="",
        address=(),
        key_style="name",
        groups=(ParamGroup(tuple(params)),),
        entries=tuple(entries),
    )
    weights = (WeightMap(f"{zero}/*/{MASTER}.pt", tuple(masters)),) if masters else ()
    return FileInventory(file=zero, format="deepspeed-universal", optimizers=(optimizer,), weights=weights)
