"""``diff`` on pairs real libraries wrote: two steps of one AdamW run (the laggards and the advancing named), an
original and its repaired copy (only the additions differ), a DCP checkpoint and torch's ``dcp_to_torch_save`` of
it (the same), a torch file with one bit of a moment flipped (found and counted), and a side in a real S3 server."""

from __future__ import annotations

import io
import math
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from optim_repair import api
from optim_repair.errors import InputError
from optim_repair.formats.torchfile import open_torch_file
from optim_repair.records.dtypes import numel
from tests.factories import chunked, s3server, trainers
from tests.factories import dcp as dk
from tests.factories.s3server import PREFIX

EXPERT_EVERY = 3
"""The expert gets a gradient on steps 0, 3, 6, ...: none between the saves at steps 4 and 6 but step 3's."""


def _run(root: Path, saves: tuple[int, ...]) -> list[Path]:
    """One real AdamW run (a body trained every step, an expert now and then, a head never), saved as UniRL saves
    it (``get_optimizer_state_dict``, ``torch.save``) after each step in ``saves``."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "expert": nn.Linear(4, 4), "head": nn.Linear(4, 2)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    paths = []
    for step in range(1, max(saves) + 1):
        optimizer.zero_grad(set_to_none=True)
        hidden = torch.tanh(model["body"](x))
        if (step - 1) % EXPERT_EVERY == 0:
            hidden = model["expert"](hidden)
        hidden.pow(2).mean().backward()
        optimizer.step()
        if step in saves:
            path = root / f"step-{step}" / "checkpoint.pt"
            path.parent.mkdir(parents=True)
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
            torch.save(state, path)
            paths.append(path)
    return paths


def test_two_steps_of_a_run_name_the_parameters_that_advanced_and_those_that_did_not(tmp_path: Path) -> None:
    first, second = _run(tmp_path, (5, 6))
    difference = api.diff(first, second)
    assert not difference.same
    (optimizer,) = difference.optimizers
    assert {step.param for step in optimizer.moved("advanced")} == {"body.weight", "body.bias"}
    assert {(step.param, step.a, step.b) for step in optimizer.moved("same")} == {
        ("expert.weight", 2.0, 2.0), ("expert.bias", 2.0, 2.0), ("head.weight", 0, 0), ("head.bias", 0, 0)
    }  # fmt: skip
    assert not (optimizer.appeared or optimizer.vanished or optimizer.options or optimizer.only_in_a)
    differing = {leaf.name: leaf for leaf in difference.leaves}
    assert set(differing) == {
        "model.body.weight",
        "model.body.bias",
        "optimizer.state.body.weight.step",
        "optimizer.state.body.bias.step",
        "optimizer.state.body.weight.exp_avg",
        "optimizer.state.body.weight.exp_avg_sq",
        "optimizer.state.body.bias.exp_avg",
        "optimizer.state.body.bias.exp_avg_sq",
    }  # fmt: skip: a parameter without a gradient is passed over, its moments and weights as they were
    step = differing["optimizer.state.body.weight.step"]
    assert (step.what, step.elements, step.numel, step.largest) == ("bytes", 1, 1, 1.0)
    assert difference.tally.bytes_compared > 0


def test_a_checkpoint_and_a_copy_of_it_hold_the_same(tmp_path: Path) -> None:
    (first,) = _run(tmp_path, (2,))
    copy = tmp_path / "copy.pt"
    shutil.copyfile(first, copy)
    difference = api.diff(first, copy)
    assert difference.same and not difference.leaves
    assert difference.tally.identical == difference.tally.tensors + difference.tally.values


def test_an_original_and_its_repaired_copy_differ_only_by_the_added_entries(tmp_path: Path) -> None:
    built = trainers.unirl_torch(tmp_path / "in")
    api.fix(built.path, tmp_path / "out", fill="fresh", sync=False)
    difference = api.diff(built.path, tmp_path / "out")
    (optimizer,) = difference.optimizers
    ((_, missing),) = built.missing.items()
    assert set(optimizer.appeared) == {str(name) for name in missing}
    assert {leaf.what for leaf in difference.leaves} == {"only in B"}
    assert {leaf.name.split(".state.")[1].rsplit(".", 1)[0] for leaf in difference.leaves} == set(missing)
    assert not (optimizer.vanished or optimizer.options or optimizer.only_in_a or optimizer.only_in_b)


def test_a_dcp_checkpoint_and_torchs_conversion_of_it_hold_the_same(tmp_path: Path) -> None:
    built = dk.unirl_dcp(tmp_path / "in")
    converted = tmp_path / "converted.pt"
    dcp_to_torch_save(built.path, converted)
    for a, b in ((built.path, converted), (converted, built.path)):
        difference = api.diff(a, b)
        assert difference.same, difference.leaves
        (optimizer,) = difference.optimizers
        assert optimizer.steps and {step.movement for step in optimizer.steps} == {"same"}
        assert difference.tally.tensors > 0 and difference.tally.bytes_compared > 0


def test_two_ranks_chunks_compare_with_the_whole_tensors_of_the_conversion(tmp_path: Path) -> None:
    built = dk.sharded_dcp(tmp_path / "in")
    converted = tmp_path / "converted.pt"
    dcp_to_torch_save(built.path, converted)
    difference = api.diff(built.path, converted)
    assert difference.same, difference.leaves


def _flip_first_moment_bit(path: Path, name: str) -> None:
    """Flip the lowest bit of the first element of the state tensor ``name`` (``exp_avg``), in place."""
    parsed = open_torch_file(path, path.name)
    entry = parsed.graph.root["optimizer"]["state"][name]["exp_avg"]
    storage = entry.args[0]
    offset, _ = parsed.storage_range(storage.key)
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def test_one_flipped_bit_in_a_moment_is_found_and_counted(tmp_path: Path) -> None:
    (first,) = _run(tmp_path, (2,))
    flipped = tmp_path / "flipped.pt"
    shutil.copyfile(first, flipped)
    _flip_first_moment_bit(flipped, "body.weight")
    difference = api.diff(first, flipped)
    (leaf,) = difference.leaves
    assert (leaf.name, leaf.what, leaf.elements, leaf.numel) == ("optimizer.state.body.weight.exp_avg", "bytes", 1, 16)
    original = struct.unpack("<f", first.read_bytes()[_offset(first) : _offset(first) + 4])[0]
    changed = struct.unpack("<f", flipped.read_bytes()[_offset(first) : _offset(first) + 4])[0]
    assert leaf.largest == pytest.approx(abs(original - changed), rel=1e-6)
    assert api.diff(first, flipped, metadata_only=True).same  # no tensor bytes read


def _offset(path: Path) -> int:
    parsed = open_torch_file(path, path.name)
    storage = parsed.graph.root["optimizer"]["state"]["body.weight"]["exp_avg"].args[0]
    return parsed.storage_range(storage.key)[0]


def test_a_truncated_side_is_an_input_error_naming_it(tmp_path: Path) -> None:
    (first,) = _run(tmp_path, (2,))
    cut = tmp_path / "cut.pt"
    cut.write_bytes(first.read_bytes()[:-200])
    with pytest.raises(InputError):
        api.diff(first, cut)


def test_a_side_in_a_store_compares_as_it_does_on_a_disk(
    server: s3server.Server, environment: None, tmp_path: Path
) -> None:
    built = dk.sharded_dcp(tmp_path / "in")
    bucket = s3server.new_bucket(server)
    s3server.upload(server, built.path, bucket, PREFIX)
    converted = tmp_path / "converted.pt"
    dcp_to_torch_save(built.path, converted)
    assert api.diff(f"s3://{bucket}/{PREFIX}", converted).same
    api.fix(built.path, tmp_path / "out", sync=False)
    difference = api.diff(f"s3://{bucket}/{PREFIX}", tmp_path / "out")
    (optimizer,) = difference.optimizers
    ((_, missing),) = built.missing.items()
    assert set(optimizer.appeared) == set(missing) and {leaf.what for leaf in difference.leaves} == {"only in B"}


def test_a_tensor_listed_with_one_chunk_twice_compares_as_itself(tmp_path: Path) -> None:
    """Found by the fuzzer: a step whose metadata lists its one chunk twice was said to differ from itself."""
    built = dk.unirl_dcp(tmp_path / "in")
    metadata = built.path / ".metadata"
    with metadata.open("rb") as stream:
        meta = pickle.load(stream)  # the test's own file, written by dcp.save just now
    key = next(key for key in meta.state_dict_metadata if key.endswith(".step"))
    item = meta.state_dict_metadata[key]
    item.chunks = [item.chunks[0], item.chunks[0]]
    with metadata.open("wb") as stream:
        pickle.dump(meta, stream)
    copy = tmp_path / "copy"
    shutil.copytree(built.path, copy)
    assert api.diff(built.path, copy).same


def test_a_pickle_that_reaches_one_list_by_many_paths_is_refused_before_it_is_listed(tmp_path: Path) -> None:
    """A thousand references to a list of a thousand values pickle in a few kilobytes and would list a million
    leaves (a thousand levels of it, more than memory holds): refused, as inspect's scan refuses work out of
    proportion to a pickle's size."""
    (first,) = _run(tmp_path, (2,))
    state = torch.load(first, weights_only=True)
    shared = list(range(1000))
    state["shared"] = [shared] * 1000
    path = tmp_path / "shared.pt"
    torch.save(state, path)
    assert path.stat().st_size < first.stat().st_size + 64 * 1024
    with pytest.raises(InputError, match="values to compare"):
        api.diff(first, path)


def _saved_state(path: Path, **moments: torch.Tensor) -> Path:
    """A real AdamW's state after one step, saved as UniRL saves it, its entry's tensors replaced by ``moments``."""
    weight = nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.ones(4)
    optimizer.step()
    state = optimizer.state_dict()
    state["state"][0].update(moments)
    torch.save({"optimizer": state}, path)
    return path


def test_a_tensor_expanded_to_a_hundred_million_elements_is_compared_by_its_one_stored_element(
    tmp_path: Path,
) -> None:
    """``torch.zeros(1).expand(10**8)`` is saved with stride 0 in a few kilobytes: its one stored element is
    compared, standing for every element the tensor holds (one read a logical element passed 1 GiB)."""
    count = 10**8
    a = _saved_state(tmp_path / "a.pt", exp_avg=torch.zeros(1).expand(count))
    b = _saved_state(tmp_path / "b.pt", exp_avg=torch.full((1,), 0.5).expand(count))
    assert b.stat().st_size < 8192
    difference = api.diff(a, b)
    (leaf,) = difference.leaves
    assert (leaf.name, leaf.what, leaf.elements, leaf.numel, leaf.largest) == (
        "optimizer.state.0.exp_avg", "bytes", count, count, 0.5
    )  # fmt: skip
    assert difference.tally.bytes_compared < 1024
    assert api.diff(a, _saved_state(tmp_path / "c.pt", exp_avg=torch.zeros(1).expand(count))).same


def test_two_steps_whose_moments_differ_everywhere_count_as_torch_counts(tmp_path: Path) -> None:
    """Every element differs (any two steps of a run): the count and the largest difference are torch's own."""
    generator = torch.Generator().manual_seed(0)
    moments = {dtype: [torch.randn(300_000, generator=generator).to(dtype) for _ in range(2)]
               for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}  # fmt: skip
    moments[torch.float32][1][::7] = moments[torch.float32][0][::7]  # every seventh element the same
    moments[torch.float64][1][5] = math.nan
    names = {torch.float32: "exp_avg", torch.float64: "exp_avg_sq", torch.bfloat16: "a", torch.float16: "b"}
    a = _saved_state(tmp_path / "a.pt", **{names[dtype]: pair[0] for dtype, pair in moments.items()})
    b = _saved_state(tmp_path / "b.pt", **{names[dtype]: pair[1] for dtype, pair in moments.items()})
    leaves = {leaf.name: leaf for leaf in api.diff(a, b).leaves}
    for dtype, (x, y) in moments.items():
        leaf = leaves[f"optimizer.state.0.{names[dtype]}"]
        differs = x.view(torch.uint8).view(-1, x.element_size()).ne(y.view(torch.uint8).view(-1, x.element_size()))
        finite = (x.double() - y.double()).abs()[differs.any(dim=1) & (x.isfinite() & y.isfinite())]
        assert leaf.elements == int(differs.any(dim=1).sum()) and leaf.numel == x.numel()
        assert leaf.largest == float(finite.max())
        assert leaf.non_finite is (dtype == torch.float64)


def _saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rows_in_chunks(path: Path, rows: int, changed: int | None = None, *, nested: bool = False) -> Path:
    """A DCP checkpoint of one AdamW parameter ``w`` of ``rows`` rows whose moments are each stored in ``rows``
    chunks of a row, as ``rows`` ranks would save them (into one shard file), ``exp_avg``'s row ``changed`` a
    quarter higher (``nested``: chunk ``r`` holds the rows from ``r`` on, as no writer leaves them): torch's own
    metadata classes, as ``tests/factories/chunked.py`` writes them."""
    path.mkdir(parents=True)
    properties = TensorProperties(dtype=torch.float32)
    state: dict[str, object] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    planner: dict[str, tuple[object, ...]] = {}
    shard = bytearray()

    def stored(index: MetadataIndex, data: bytes) -> None:
        storage[index] = _StorageInfo("__0_0.distcp", len(shard), len(data))
        shard.extend(data)

    for key in ("exp_avg", "exp_avg_sq"):
        fqn = f"optim.state.w.{key}"
        boxes = [([row, 0], [rows - row if nested else 1, chunked.WIDTH]) for row in range(rows)]
        chunks = [ChunkStorageMetadata(torch.Size(start), torch.Size(size)) for start, size in boxes]
        state[fqn] = TensorStorageMetadata(properties, torch.Size([rows, chunked.WIDTH]), chunks)
        planner[fqn] = ("optim", "state", "w", key)
        for row, (start, size) in enumerate(boxes):
            value = torch.arange(numel(size), dtype=torch.float32).add(row).reshape(size) / 8
            if key == "exp_avg" and row == changed:
                value += 0.25
            stored(MetadataIndex(fqn, torch.Size(start)), _saved(value))
    scalar = [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
    state["optim.state.w.step"] = TensorStorageMetadata(properties, torch.Size([]), scalar)
    planner["optim.state.w.step"] = ("optim", "state", "w", "step")
    stored(MetadataIndex("optim.state.w.step", torch.Size([])), _saved(torch.tensor(5.0)))
    for option, value in {**chunked.OPTIONS, "params": ["w"]}.items():
        key = f"optim.param_groups.0.{option}"
        state[key], planner[key] = BytesStorageMetadata(), ("optim", "param_groups", 0, option)
        stored(MetadataIndex(key), _saved(value))
    (path / "__0_0.distcp").write_bytes(bytes(shard))
    with open(path / ".metadata", "wb") as stream:
        pickle.dump(Metadata(state, planner, storage), stream)
    return path


def test_a_tensor_in_two_thousand_chunks_meets_each_chunk_of_the_other_side_once(tmp_path: Path) -> None:
    """Each side's chunks are swept in the order they start, so a chunk meets only the chunks it overlaps
    (every chunk of A met with every chunk of B took 28 s at a thousand chunks, the square of the count)."""
    rows = 2000
    a = _rows_in_chunks(tmp_path / "a", rows)
    assert api.diff(a, shutil.copytree(a, tmp_path / "copy")).same
    difference = api.diff(a, _rows_in_chunks(tmp_path / "b", rows, changed=1234))
    (leaf,) = difference.leaves
    assert (leaf.name, leaf.what, leaf.elements, leaf.numel, leaf.largest) == (
        "optim.state.w.exp_avg", "bytes", chunked.WIDTH, rows * chunked.WIDTH, 0.25
    )  # fmt: skip
    converted = tmp_path / "converted.pt"
    dcp_to_torch_save(a, converted)
    assert api.diff(a, converted).same


def test_chunks_that_overlap_one_another_on_both_sides_are_refused_before_they_meet_more_than_they_hold(
    tmp_path: Path,
) -> None:
    """Three hundred chunks each holding the rows from its own on, on both sides, would meet in 36 million elements
    (the cube of the count) where both sides hold 361,200: an input error, said once they meet in more."""
    a = _rows_in_chunks(tmp_path / "a", 300, nested=True)
    with pytest.raises(InputError, match="overlap one another on both sides"):
        api.diff(a, shutil.copytree(a, tmp_path / "copy"))
