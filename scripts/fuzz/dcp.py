"""Mutations of a DCP checkpoint: its ``.metadata`` edited field by field or as a pickle, its bytes entries."""

from __future__ import annotations

import copy
import pickle
from typing import Any

from fuzz.corpus import MutationContext, import_torch
from fuzz.files import BYTE_MUTATORS, flip, zip_header, zip_pickle, zip_rewrite
from fuzz.pickles import mutate_pickle
from fuzz.trees import Dir, Fifo, Link

_ZSTD_BOMB: dict[int, bytes] = {}


def zstd_bomb(size: int) -> bytes | None:
    """A zstd stream of ``size`` zero bytes (a few dozen KiB), made once."""
    if size not in _ZSTD_BOMB:
        try:
            import zstandard
        except ImportError:
            return None
        compressor = zstandard.ZstdCompressor(level=1).compressobj()
        chunk, parts = bytes(1 << 20), []
        for _ in range(size >> 20):
            parts.append(compressor.compress(chunk))
        parts.append(compressor.flush())
        _ZSTD_BOMB[size] = b"".join(parts)
    return _ZSTD_BOMB[size]


def zstd(data: bytes) -> bytes | None:
    try:
        import zstandard
    except ImportError:
        return None
    return bytes(zstandard.ZstdCompressor().compress(data))


def _dcp_classes() -> Any:
    return import_torch().distributed.checkpoint.metadata


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


_REL_PATHS = ("../outside.distcp", "/dev/zero", "/etc/hostname", "nonexistent.distcp", "", ".", "..", ".metadata",
              "sub/../__0_0.distcp", "./__0_0.distcp", "__0_0.distcp\x00x", "a\\b", "__0_0.distcp/",
              "//__0_0.distcp", None, 7, b"__0_0.distcp", "link.distcp", "fifo.distcp", "devzero.distcp",
              "loop.distcp", "dir.distcp")  # fmt: skip
_TRANSFORMS: tuple[Any, ...] = (["stream.zstd/1"], ["stream.zstd/2"], ["stream.zstd"], ["bogus/1"], "stream.zstd/1",
                                [None], ["stream.zstd/1", "stream.zstd/1"], [], None, ["stream.zstd/1.5"],
                                [7])  # fmt: skip


def _special_member(ctx: MutationContext, directory: str, name: Any) -> None:
    """Make the file a mutated ``relative_path`` names, when it names one of the special members."""
    target = f"{directory}/{name}"
    if name == "link.distcp":
        ctx.tree[target] = Link(ctx.outside.by_suffix.get(".distcp", "/etc/hostname"))
    elif name == "fifo.distcp":
        ctx.tree[target] = Fifo()
    elif name == "devzero.distcp":
        ctx.tree[target] = Link("/dev/zero")
    elif name == "loop.distcp":
        ctx.tree[target] = Link("loop.distcp")
    elif name == "dir.distcp":
        ctx.tree[target] = Dir()


def _edit_storage(ctx: MutationContext, meta: Any, directory: str) -> str:
    rng = ctx.rng
    key = rng.choice(list(meta.storage_data))
    info = meta.storage_data[key]
    shard = ctx.tree.get(f"{directory}/{info.relative_path}")
    size = len(shard) if isinstance(shard, bytes) else 0
    name = rng.choice(("relative_path", "offset", "length", "transform_descriptors"))
    value: Any
    if name == "relative_path":
        value = rng.choice([*_REL_PATHS, ctx.outside.by_suffix.get(".distcp", "/etc/hostname")])
        _special_member(ctx, directory, value)
    elif name == "offset":
        value = rng.choice((-1, -(2**63), 2**31, 2**32, 2**63 - 1, 2**64, size, size - 1, size + 1,
                            rng.randrange(size + 1), None, "0", 1.5, True))  # fmt: skip
    elif name == "length":
        value = rng.choice((-1, 0, 1, 2**31, 2**40, 2**62, 2**63 - 1, size + 1, info.length + 1, None, "5", 2.0))
    else:
        value = copy.copy(rng.choice(_TRANSFORMS))
    _set(info, name, value)
    return f"storage_data[{key.fqn}].{name} = {value!r}"


def _edit_index(ctx: MutationContext, meta: Any, directory: str) -> str:
    rng = ctx.rng
    keys = list(meta.storage_data)
    key = rng.choice(keys)
    new = copy.copy(key)
    name = rng.choice(("fqn", "offset", "swap"))
    if name == "swap":
        other = rng.choice(keys)
        first, second = meta.storage_data[key], meta.storage_data[other]
        meta.storage_data[key], meta.storage_data[other] = second, first
        return f"storage_data[{key.fqn}] <-> storage_data[{other.fqn}]"
    value: Any = (
        rng.choice(("nonexistent", "", rng.choice(keys).fqn, 0, None))
        if name == "fqn"
        else rng.choice(((10**12,), (-1,), (), ("a",), (0,), (0, 0, 0, 0), None))
    )
    _set(new, name, value)
    meta.storage_data = {(new if k is key else k): v for k, v in meta.storage_data.items()}
    return f"storage_data key {key.fqn}.{name} = {value!r}"


def _edit_item(ctx: MutationContext, meta: Any, directory: str) -> str:
    classes, rng, torch = _dcp_classes(), ctx.rng, import_torch()

    items = meta.state_dict_metadata
    key = rng.choice(sorted(items))
    item = items[key]
    if isinstance(item, classes.BytesStorageMetadata):
        tensors = [v for v in items.values() if isinstance(v, classes.TensorStorageMetadata)]
        if tensors and rng.random() < 0.5:
            items[key] = copy.deepcopy(rng.choice(tensors))
            return f"bytes entry {key} -> a tensor entry"
        del items[key]
        return f"deleted entry {key}"
    name = rng.choice(("size", "chunks", "chunk", "dtype", "bytes"))
    value: Any
    if name == "size":
        value = rng.choice(([2**62, 2**62], [-1], [], [0], [10**12], [4], [1, 1, 1, 1, 1]))
        value = torch.Size(value) if rng.random() < 0.7 else tuple(value)
        _set(item, "size", value)
    elif name == "chunks":
        value = rng.choice(([], None, "x", item.chunks * 2))
        _set(item, "chunks", value)
    elif name == "chunk" and item.chunks:
        chunk = rng.choice(item.chunks)
        part = rng.choice(("offsets", "sizes"))
        value = rng.choice(((-1,), (2**62,), (), (0, 0, 0), ("a",), (1,) * 64, [1.5]))
        _set(chunk, part, value)
        name = f"chunk.{part}"
    elif name == "dtype":
        names = ("bool", "complex128", "uint64", "float8_e4m3fn", "qint8", "float64", "int8", "bits8")
        value = getattr(torch, rng.choice(names), None)
        _set(item.properties, "dtype", value)
    else:
        items[key] = classes.BytesStorageMetadata()
        value = "BytesStorageMetadata()"
    return f"state_dict_metadata[{key}].{name} = {value!r}"


def _edit_planner(ctx: MutationContext, meta: Any, directory: str) -> str:
    rng = ctx.rng
    planner = meta.planner_data
    action = rng.choice(("delete", "empty", "short", "none", "float", "swap", "huge", "type", "add", "whole"))
    if action == "whole":
        value: Any = rng.choice((None, {}, [], "x"))
        meta.planner_data = value
        return f"planner_data = {value!r}"
    key = rng.choice(sorted(planner))
    path = tuple(planner[key])
    if action == "delete":
        del planner[key]
    elif action == "empty":
        planner[key] = ()
    elif action == "short":
        planner[key] = path[:1]
    elif action == "none":
        planner[key] = None
    elif action == "float":
        planner[key] = (*path[:-1], 1.5)
    elif action == "swap":
        other = rng.choice(sorted(planner))
        planner[key], planner[other] = planner[other], planner[key]
    elif action == "huge":
        planner[key] = path + ("x",) * rng.choice((100, 10_000))
    elif action == "type":
        planner[key] = tuple(int(p) if isinstance(p, str) and p.isdigit() else str(p) for p in path)
    else:
        planner[f"{key}.extra"] = (*path, "extra")
    return f"planner_data[{key}] {action}"


def _edit_structure(ctx: MutationContext, meta: Any, directory: str) -> str:
    rng = ctx.rng
    action = rng.choice(("drop-item", "drop-storage", "no-items", "no-storage", "bad-key", "storage-meta"))
    if action == "drop-item":
        key = rng.choice(sorted(meta.state_dict_metadata))
        del meta.state_dict_metadata[key]
        return f"deleted state_dict_metadata[{key}]"
    if action == "drop-storage":
        key = rng.choice(list(meta.storage_data))
        del meta.storage_data[key]
        return f"deleted storage_data[{key.fqn}]"
    if action == "no-items":
        meta.state_dict_metadata = rng.choice((None, {}, []))
    elif action == "no-storage":
        meta.storage_data = rng.choice((None, {}, []))
    elif action == "bad-key":
        key = rng.choice(sorted(meta.state_dict_metadata))
        meta.state_dict_metadata[rng.choice((1, None, b"x", ("a",)))] = meta.state_dict_metadata.pop(key)
    elif meta.storage_meta is not None:
        _set(meta.storage_meta, "checkpoint_id", rng.choice(("/etc", None, 7, "../..")))
    return action


METADATA_EDITS = (_edit_storage, _edit_storage, _edit_index, _edit_item, _edit_planner, _edit_structure)


def _seed_metadata(ctx: MutationContext) -> tuple[str, Any] | None:
    """A DCP directory of the case and its seed's ``.metadata`` unpickled (a seed built here: plain pickle)."""
    dirs = ctx.dcp_dirs()
    if not dirs:
        return None
    directory = ctx.rng.choice(dirs)
    original = ctx.seed.tree[f"{directory}/.metadata"]
    assert isinstance(original, bytes)
    _dcp_classes()
    return directory, pickle.loads(original)  # only ever a seed this process built


def dcp_metadata_edit(ctx: MutationContext) -> bool:
    """Unpickle a DCP ``.metadata`` of a seed built here (plain pickle), edit fields, pickle it again."""
    found = _seed_metadata(ctx)
    if found is None:
        return False
    directory, meta = found
    for _ in range(ctx.rng.choice((1, 1, 1, 2, 3))):
        edit = ctx.rng.choice(METADATA_EDITS)
        try:
            ctx.notes.append(edit(ctx, meta, directory))
        except (TypeError, IndexError, KeyError, AttributeError, ValueError):  # an earlier edit took what it needs
            ctx.notes.append(f"{edit.__name__} skipped")
    ctx.tree[f"{directory}/.metadata"] = pickle.dumps(meta, protocol=ctx.rng.choice((2, 4, 4, 5)))
    return True


def dcp_rank_local(ctx: MutationContext) -> bool:
    """Make a DCP checkpoint one saved without collectives: its ``.metadata`` becomes rank 0's own view (and often a
    second rank's too, the same view again), perhaps after a metadata edit or a pickle mutation."""
    dirs = ctx.dcp_dirs()
    if not dirs:
        return False
    directory = ctx.rng.choice(dirs)
    if ctx.rng.random() < 0.5:
        (dcp_metadata_edit if ctx.rng.random() < 0.5 else dcp_metadata_pickle)(ctx)
    data = ctx.tree.pop(f"{directory}/.metadata")
    ranks = ctx.rng.choice(((0,), (0, 1), (1,), (0, 2)))
    for rank in ranks:
        ctx.tree[f"{directory}/__{rank}.metadata"] = data
    ctx.notes.append(f"{directory}: saved without collectives, views of ranks {ranks}")
    return True


def dcp_torch_215(ctx: MutationContext) -> bool:
    """Pickle a DCP ``.metadata`` of a seed as torch 2.15 writes it: each ``TensorProperties`` with a sixth field,
    the saved tensor's strides (now and then one wrong), which a fix for an older torch drops again."""
    found = _seed_metadata(ctx)
    if found is None:
        return False
    directory, meta = found
    classes = _dcp_classes()
    strides: dict[int, Any] = {}
    for item in meta.state_dict_metadata.values():
        if isinstance(item, classes.TensorStorageMetadata):
            item.properties = copy.copy(item.properties)
            running, made = 1, []
            for size in reversed(tuple(item.size)):
                made.insert(0, running)
                running *= max(size, 1)
            strides[id(item.properties)] = tuple(made) if ctx.rng.random() < 0.9 else None  # 2.15 writes None too
    if strides and ctx.rng.random() < 0.2:  # one tensor's strides wrong
        strides[ctx.rng.choice(sorted(strides))] = ctx.rng.choice(((1,), ("x",), (-1, 1)))
    saved = classes.TensorProperties.__getstate__

    def six(self: Any) -> tuple[Any, ...]:
        return (*saved(self), strides.get(id(self)))

    classes.TensorProperties.__getstate__ = six
    try:
        ctx.tree[f"{directory}/.metadata"] = pickle.dumps(meta, protocol=ctx.rng.choice((2, 4, 4, 5)))
    finally:
        classes.TensorProperties.__getstate__ = saved
    ctx.notes.append(f"{directory}/.metadata as torch 2.15 pickles it")
    return True


def dcp_metadata_pickle(ctx: MutationContext) -> bool:
    dirs = ctx.dcp_dirs()
    if not dirs:
        return False
    rel = f"{ctx.rng.choice(dirs)}/.metadata"
    ctx.tree[rel], note = mutate_pickle(ctx.rng, ctx.data(rel))
    ctx.notes.append(f"{rel}: {note}")
    return True


def dcp_bytes_entry(ctx: MutationContext) -> bool:
    """Mutate one bytes entry (a ``torch.save`` archive inside a shard); if it changes size, append it to the shard
    and point the metadata at it. Also: compress it with zstd (a valid transform), or replace it by a zstd bomb."""
    dirs = ctx.dcp_dirs()
    if not dirs:
        return False
    rng = ctx.rng
    directory = rng.choice(dirs)
    classes = _dcp_classes()
    original = ctx.seed.tree[f"{directory}/.metadata"]
    assert isinstance(original, bytes)
    meta = pickle.loads(original)
    entries = [
        (key, info)
        for key, info in meta.storage_data.items()
        if isinstance(meta.state_dict_metadata.get(key.fqn), classes.BytesStorageMetadata)
    ]
    if not entries:
        return False
    key, info = rng.choice(entries)
    shard_rel = f"{directory}/{info.relative_path}"
    shard = ctx.data(shard_rel)
    blob = shard[info.offset : info.offset + info.length]
    action = rng.choice(("pickle", "pickle", "rewrite", "header", "bytes", "zstd", "zstd-bytes", "zstd-bomb"))
    new: bytes | None
    transforms = None
    if action == "pickle":
        done = zip_pickle(rng, blob)
        new, note = done if done else (None, "")
    elif action == "rewrite":
        done = zip_rewrite(rng, blob)
        new, note = done if done else (None, "")
    elif action == "header":
        done = zip_header(rng, blob)
        new, note = done if done else (None, "")
    elif action == "bytes":
        new, note = rng.choice(list(BYTE_MUTATORS.values()))(rng, blob, blob)
    else:
        bomb = zstd_bomb(rng.choice((1 << 30, 2 << 30))) if action == "zstd-bomb" else None
        new = bomb if action == "zstd-bomb" else zstd(blob)
        if new is not None and action == "zstd-bytes":
            new = flip(rng, new, new)[0]
        transforms, note = ["stream.zstd/1"], action
    if new is None:
        return False
    if len(new) == len(blob) and transforms is None:
        ctx.tree[shard_rel] = shard[: info.offset] + new + shard[info.offset + info.length :]
    else:
        _set(info, "offset", len(shard))
        _set(info, "length", len(new))
        if transforms is not None:
            _set(info, "transform_descriptors", transforms)
        ctx.tree[shard_rel] = shard + new
        ctx.tree[f"{directory}/.metadata"] = pickle.dumps(meta)
    ctx.notes.append(f"bytes entry {key.fqn} in {shard_rel}: {note}")
    return True
