"""Frontier-scale DCP checkpoints: one chunk per rank per tensor, as FSDP2 writes them on ``ranks`` ranks.

Built with torch's own metadata classes, as ``dcp.save`` on that many ranks would leave them: every tensor
sharded on dim 0 (rank ``r`` holds row ``r``), each chunk ``torch.save``d into its rank's shard file, the
nested optimizer layout of ``get_optimizer_state_dict`` (``optim.state.<fqn>.<key>``, ``optim.param_groups.0.*``
as bytes entries), and every ``missing_every``-th parameter without state (an expert that got no tokens).
Writing millions of chunks through ``dcp.save`` itself would take hours on one machine; ``dcp.load`` reads
what this writes (``tests/formats/dcp/test_chunked.py``).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

WIDTH = 4
OPTIONS = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
           "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
           "decoupled_weight_decay": True}  # fmt: skip


def _saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def chunk_count(ranks: int, params: int, missing_every: int = 33) -> int:
    """How many chunks ``build_chunked`` writes: weights and two moments per rank, one ``step`` per state."""
    stateful = params - len(range(0, params, missing_every))
    return ranks * (params + 2 * stateful) + stateful


def fqn(index: int) -> str:
    return f"layers.{index // 64}.mlp.experts.{index % 64}.weight"


def build_chunked(path: Path, ranks: int, params: int, missing_every: int = 33) -> list[str]:
    """Write the checkpoint to ``path``; return the names of the parameters without state."""
    path.mkdir(parents=True)
    chunk = _saved(torch.zeros(1, WIDTH))
    step = _saved(torch.tensor(5.0))
    properties = TensorProperties(dtype=torch.float32)
    files = [f"__{rank}_0.distcp" for rank in range(ranks)]
    ends = [0] * ranks
    state: dict[str, object] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    planner: dict[str, tuple[object, ...]] = {}
    head = bytearray()  # rank 0's file after its chunks: the steps and the bytes entries

    def sharded(key: str, where: tuple[object, ...]) -> None:
        # New objects for every chunk, as the ranks' plans gathered by dcp.save are: none shared in the pickle.
        chunks = [ChunkStorageMetadata(torch.Size([rank, 0]), torch.Size([1, WIDTH])) for rank in range(ranks)]
        state[key] = TensorStorageMetadata(properties, torch.Size([ranks, WIDTH]), chunks)
        planner[key] = where
        for rank in range(ranks):
            # Each rank's write results name the key by a string of their own, as dcp.save's gathered ones do.
            index = MetadataIndex(key.encode().decode(), torch.Size([rank, 0]), rank)
            storage[index] = _StorageInfo(files[rank], ends[rank], len(chunk))
            ends[rank] += len(chunk)

    placed: list[tuple[MetadataIndex, int, int]] = []  # in rank 0's head: where, once its chunks are counted

    def whole(key: str, where: tuple[object, ...], data: bytes, meta: object) -> None:
        state[key] = meta
        planner[key] = where
        index = MetadataIndex(key, torch.Size([])) if isinstance(meta, TensorStorageMetadata) else MetadataIndex(key)
        placed.append((index, len(head), len(data)))
        head.extend(data)

    missing = []
    for index in range(params):
        sharded(f"model.{fqn(index)}", ("model", fqn(index)))
    scalar = TensorStorageMetadata(properties, torch.Size([]), [ChunkStorageMetadata(torch.Size([]), torch.Size([]))])
    for index in range(params):
        name = fqn(index)
        if index % missing_every == 0:
            missing.append(name)
            continue
        whole(f"optim.state.{name}.step", ("optim", "state", name, "step"), step, scalar)
        for key in ("exp_avg", "exp_avg_sq"):
            sharded(f"optim.state.{name}.{key}", ("optim", "state", name, key))
    for option, value in {**OPTIONS, "params": [fqn(index) for index in range(params)]}.items():
        key = f"optim.param_groups.0.{option}"
        whole(key, ("optim", "param_groups", 0, option), _saved(value), BytesStorageMetadata())
    per_rank = [ends[rank] // len(chunk) for rank in range(ranks)]
    for index, start, length in placed:
        storage[index] = _StorageInfo(files[0], ends[0] + start, length)
    for rank in range(ranks):
        with open(path / files[rank], "wb") as stream:
            stream.write(chunk * per_rank[rank])
            if rank == 0:
                stream.write(head)
    with open(path / ".metadata", "wb") as stream:
        pickle.dump(Metadata(state, planner, storage), stream)
    return missing
