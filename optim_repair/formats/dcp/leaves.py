"""A DCP checkpoint's leaves: each tensor by its chunks in the shards, each bytes entry by what it pickled.

A tensor's chunks are ``torch.save`` archives in the shards, whose layout is read only when their bytes are
compared. A bytes entry is unpickled safely and listed value by value, under its path, as the torch file
``dcp_to_torch_save`` makes holds it; one whose pickle names other code (a scheduler's, a dataloader's, which
``dcp.load`` unpickles unsafely) or holds tensors of its own is compared as its stored bytes.
"""

from __future__ import annotations

from optim_repair.errors import InputError, UnsafeInputError, shown
from optim_repair.formats.dcp.metadata import DcpMetadata, DcpStorage, DcpTensor, display_path
from optim_repair.formats.dcp.storage import ShardFiles, read_ranges, read_saved_object, untransform
from optim_repair.formats.leaves import graph_leaves
from optim_repair.records.dtypes import contiguous_strides
from optim_repair.records.leaves import Leaf, LeafPath, Piece, RawLeaf, TensorLeaf, path_part


def _stored(meta: DcpMetadata, key: str, offsets: tuple[int, ...] | None, rel: str) -> DcpStorage:
    info = meta.storage.get((key, offsets))
    if info is None:
        raise InputError(f"{shown(key)} is listed but stored nowhere", path=rel or ".")
    return info


def _tensor(item: DcpTensor, key: str, meta: DcpMetadata, rel: str, path: LeafPath) -> dict[LeafPath, Leaf]:
    stored = [(chunk, _stored(meta, key, chunk.offsets, rel)) for chunk in item.chunks]
    if item.compact:  # its own encoding: no elements to compare, only what it stored
        return {
            (*path, f"[chunk at {','.join(map(str, chunk.offsets))}]"): RawLeaf(
                display_path(rel, info.relative_path), info.offset, info.length
            )
            for chunk, info in stored
        }
    pieces = tuple(
        Piece(
            chunk.offsets,
            chunk.sizes,
            display_path(rel, info.relative_path),
            info.offset,
            contiguous_strides(chunk.sizes),
            0,
            archive=info.length,
            transforms=info.transforms,
        )
        for chunk, info in stored
    )
    return {path: TensorLeaf(item.dtype, item.size, item.strides, pieces)}


def dcp_leaves(meta: DcpMetadata, shards: ShardFiles, rel: str, source: str) -> dict[LeafPath, Leaf]:
    """The leaves of the DCP checkpoint ``rel`` (its metadata read whole: ``read_metadata``), its shards read by
    ``shards``, each leaf's file the shard holding it."""
    leaves: dict[LeafPath, Leaf] = {}
    wanted = {}
    for key, item in meta.items.items():
        path = tuple(path_part(part) for part in meta.path_of(key))
        if isinstance(item, DcpTensor):
            leaves.update(_tensor(item, key, meta, rel, path))
        else:
            wanted[key] = _stored(meta, key, None, rel)
    for key, data in read_ranges(shards, wanted, rel):
        info = wanted[key]
        path = tuple(path_part(part) for part in meta.path_of(key))
        where = f"{display_path(rel, info.relative_path)}:{key}"
        try:
            graph = read_saved_object(untransform(data, info.transforms, where), where)
        except UnsafeInputError:
            graph = None
        if graph is None or graph.storages:
            leaves[path] = RawLeaf(display_path(rel, info.relative_path), info.offset, info.length)
        else:
            leaves.update(graph_leaves(graph.root, where, None, len(data), path))
    return leaves
