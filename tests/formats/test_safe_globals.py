"""The stand-ins for DTensor's classes (``optim_repair.formats.safe_globals``), on a real DTensor pickle."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from optim_repair.errors import InputError
from optim_repair.formats.pickle_opcodes import PICKLE
from optim_repair.formats.pickle_writing import dump_graph
from optim_repair.formats.pickled import is_dtensor, load_graph, tensor_meta

SHARD = b"ctorch.distributed.tensor.placement_types\nShard\n"


def _dtensor_pickle(tmp_path: Path) -> bytes:
    """The ``data.pkl`` of ``torch.save`` of rank 0's half of a (4, 3) tensor sharded on two ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        local = torch.arange(6.0).reshape(2, 3)
        value = DTensor.from_local(local, DeviceMesh("cpu", [0, 1]), [Shard(0)], run_check=False)
        torch.save({"exp_avg": value, "step": torch.tensor(3.0)}, tmp_path / "rank0.pt")
    finally:
        dist.destroy_process_group()
    with zipfile.ZipFile(tmp_path / "rank0.pt") as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


def test_a_dtensor_is_described_by_its_local_shard_and_pickles_back_stably(tmp_path: Path) -> None:
    graph = load_graph(_dtensor_pickle(tmp_path), "rank0.pt")
    meta = tensor_meta(graph.root["exp_avg"])
    assert meta is not None and (meta.dtype, meta.shape, meta.stride) == ("float32", (2, 3), (3, 1))
    assert is_dtensor(graph.root["exp_avg"]) and not is_dtensor(graph.root["step"])
    dumped = dump_graph(graph.root)
    assert dump_graph(load_graph(dumped, "copy", ours=True).root) == dumped


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (SHARD + b"K\x00\x85R.", "refuses to call torch.distributed.tensor.placement_types.Shard"),
        (SHARD + b")\x81Nb.", "twice or to None"),
        (SHARD + b")\x81}b}b.", "twice or to None"),
        (SHARD + b"}b.", "not a readable torch pickle"),
        (SHARD + b")}X\x01\x00\x00\x00aK\x01s\x92.", "keyword arguments"),
    ],
    ids=["called", "none-state", "second-state", "state-of-the-class", "keywords"],
)
def test_what_no_torch_pickle_does_with_these_classes_is_refused(body: bytes, reason: str) -> None:
    with pytest.raises(InputError, match=reason):  # read as a DCP bytes entry is, of every opcode of pickle
        load_graph(pickle.PROTO + b"\x04" + body, "hostile.pt", allowed=PICKLE)
