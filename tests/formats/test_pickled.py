"""The safe unpickler and the graph re-pickler (``optim_repair.formats.pickled``), on real torch pickles."""

from __future__ import annotations

import io
import os
import pickle
import shlex
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from optim_repair.errors import InputError, RepairRefused, UnsafeInputError
from optim_repair.formats.addresses import walk
from optim_repair.formats.pickle_limits import MAX_DEPTH
from optim_repair.formats.pickle_opcodes import PICKLE
from optim_repair.formats.pickle_writing import dump_graph, new_tensor, storage_for
from optim_repair.formats.pickled import (
    GlobalRef,
    Reduced,
    StorageRef,
    check_depth,
    is_tensor,
    load_graph,
    tensor_meta,
)
from tests.factories.hostile import ShellOnLoad


def saved_pickle(obj: Any, tmp_path: Path) -> bytes:
    """The ``data.pkl`` torch.save writes for ``obj``."""
    path = tmp_path / "obj.pt"
    torch.save(obj, path)
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        return archive.read(name)


def torch_pickle_load(data: bytes, storages: dict[str, torch.Tensor]) -> Any:
    """Unpickle ``data`` the way torch does, serving storages from ``storages`` (by key)."""

    class Loader(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            _, _, key, _, _ = pid[:5]
            return torch.storage.TypedStorage(
                wrap_storage=storages[key].untyped_storage(), dtype=storages[key].dtype, _internal=True
            )

    return Loader(io.BytesIO(data)).load()


def test_tensor_meta_records_layout_not_data(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    obj = {
        "t": base.t(),
        "view": base[1:, 1:],
        "bf16": torch.ones(2, 3, dtype=torch.bfloat16),
        "c": torch.zeros(2, dtype=torch.complex64),
        "void": torch.zeros(0, 4),
    }
    graph = load_graph(saved_pickle(obj, tmp_path), "obj.pt")
    metas = {key: tensor_meta(value) for key, value in graph.root.items()}
    t, view = metas["t"], metas["view"]
    assert t is not None and view is not None
    assert (t.dtype, t.shape, t.stride, t.storage_offset) == ("float32", (4, 3), (1, 4), 0)
    assert (view.shape, view.stride, view.storage_offset) == ((2, 3), (4, 1), 5)
    assert t.storage == view.storage, "two views of one storage must name one storage"
    assert t.storage_nbytes == 48
    assert metas["bf16"] is not None and metas["bf16"].dtype == "bfloat16" and metas["bf16"].nbytes == 12
    assert metas["c"] is not None and metas["c"].dtype == "complex64" and metas["c"].nbytes == 16
    assert metas["void"] is not None and metas["void"].shape == (0, 4) and metas["void"].nbytes == 0
    assert len(graph.storages) == 4


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2])
def test_dtypes_saved_through_untyped_storage_are_readable(tmp_path: Path, dtype: torch.dtype) -> None:
    # torch pickles these with torch.storage.UntypedStorage and _rebuild_tensor_v3 (weights_only allows both)
    graph = load_graph(saved_pickle({"t": torch.zeros(3, dtype=dtype)}, tmp_path), "obj.pt")
    meta = tensor_meta(graph.root["t"])
    assert meta is not None
    assert meta.dtype == str(dtype).removeprefix("torch.")
    assert meta.shape == (3,)
    assert meta.nbytes == 3 * dtype.itemsize


def test_parameters_and_plain_values_survive(tmp_path: Path) -> None:
    obj = {
        "p": torch.nn.Parameter(torch.ones(2)),
        "betas": (0.9, 0.999),
        "n": None,
        "s": {1, 2},
        "b": b"\x00\xff",
        "cx": 1 + 2j,
        "ba": bytearray(b"ab"),
    }
    graph = load_graph(saved_pickle(obj, tmp_path), "obj.pt")
    root = graph.root
    assert is_tensor(root["p"]) and tensor_meta(root["p"]) is not None
    assert root["betas"] == (0.9, 0.999) and isinstance(root["betas"], tuple)
    assert root["n"] is None and root["s"] == {1, 2} and root["b"] == b"\x00\xff"
    assert root["cx"] == 1 + 2j and root["ba"] == bytearray(b"ab")


def test_repickled_graph_loads_in_torch_as_the_original(tmp_path: Path) -> None:
    base = torch.arange(6, dtype=torch.float32)
    obj = {
        "a": base.view(2, 3).t(),
        "b": base[2:],
        "c": [1, (2, 3.5)],
        "d": torch.tensor(1.0),
        "od": __import__("collections").OrderedDict(x=1),
        "bytes": b"\x01",
        "p": torch.nn.Parameter(torch.ones(1)),
    }
    data = saved_pickle(obj, tmp_path)
    graph = load_graph(data, "obj.pt")
    again = dump_graph(graph.root)
    storages = {"0": base, "1": obj["d"], "2": obj["p"].detach()}
    first, second = torch_pickle_load(data, storages), torch_pickle_load(again, storages)
    assert list(first) == list(second)
    for key in first:
        if isinstance(first[key], torch.Tensor):
            a, b = first[key], second[key]
            assert (a.dtype, a.shape, a.stride(), a.storage_offset(), type(a)) == (
                b.dtype,
                b.shape,
                b.stride(),
                b.storage_offset(),
                type(b),
            )
            assert torch.equal(a, b)
        else:
            assert first[key] == second[key] and type(first[key]) is type(second[key])
    assert second["a"].untyped_storage().data_ptr() == second["b"].untyped_storage().data_ptr()
    # and it is itself a safe, stable graph: a second round trip gives the same bytes
    regraph = load_graph(again, "again")
    assert dump_graph(regraph.root) == again


def test_shared_objects_stay_shared_through_the_round_trip(tmp_path: Path) -> None:
    shared: list[int] = [1, 2]
    data = pickle.dumps({"x": shared, "y": shared}, protocol=2)
    graph = load_graph(data, "p")
    assert graph.root["x"] is graph.root["y"]
    again = pickle.loads(dump_graph(graph.root))
    assert again["x"] is again["y"]


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_unsafe_global_is_refused_naming_it_and_never_run(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "marker"
    data = pickle.dumps({"x": ShellOnLoad(f"touch {shlex.quote(str(marker))}")}, protocol=protocol)
    with pytest.raises(UnsafeInputError, match=rf"^bad\.pt: refuses to load global {os.name}\.system$"):
        load_graph(data, "bad.pt", allowed=PICKLE)  # of every opcode of pickle, as a DCP bytes entry is read
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("builtins", "eval"),
        ("__builtin__", "eval"),
        ("torch", "load"),
        ("torch.nn", "Module"),
        ("os", "system"),
        ("subprocess", "Popen"),
        ("collections", "Counter"),
        ("torch._utils", "_rebuild_device_tensor_from_numpy"),
    ],
)
def test_globals_outside_the_allowlist_are_refused(module: str, name: str) -> None:
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")R."
    with pytest.raises(UnsafeInputError, match="refuses to load global"):
        load_graph(data, "x.pt")


def test_python2_names_are_mapped_before_the_allowlist() -> None:
    graph = load_graph(b"\x80\x02c__builtin__\nset\n]\x85R.", "p")
    assert graph.root == set()
    with pytest.raises(UnsafeInputError, match=r"builtins\.getattr"):
        load_graph(b"\x80\x02c__builtin__\ngetattr\n.", "p")


def test_codecs_encode_only_latin1() -> None:
    ok = b"\x80\x02c_codecs\nencode\nX\x02\x00\x00\x00\xc3\xbfX\x06\x00\x00\x00latin1\x86R."
    assert load_graph(ok, "p").root == b"\xff"
    bad = b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86R."
    with pytest.raises(UnsafeInputError, match="rot13"):
        load_graph(bad, "p")


def test_build_cannot_turn_an_allowed_global_into_another() -> None:
    # GLOBAL torch.Size, then BUILD {"module": "os", "name": "system"}, then call it with "id"
    data = (
        b"\x80\x02ctorch\nSize\n}(X\x06\x00\x00\x00moduleX\x02\x00\x00\x00osX\x04\x00\x00\x00name"
        b"X\x06\x00\x00\x00systemubX\x02\x00\x00\x00id\x85R."
    )
    with pytest.raises(InputError, match=r"sets the state of global torch\.Size"):
        load_graph(data, "p")


@pytest.mark.parametrize(
    "data",
    [b"", b"\x80", b"\x80\x02}q\x00(X", b"not a pickle at all", os.urandom(64), b"\x80\x02N\x85Q."],
    ids=["empty", "proto-only", "truncated", "text", "random", "bad-persistent-id"],
)
def test_damaged_pickles_are_input_errors_naming_the_file(data: bytes) -> None:
    with pytest.raises(InputError, match=r"^f\.pt: "):
        load_graph(data, "f.pt")


def test_huge_bytearray_request_is_an_input_error() -> None:
    data = b"\x80\x02c__builtin__\nbytearray\n\x8a\x0b" + (2**80).to_bytes(11, "little") + b"\x85R."
    with pytest.raises(InputError):
        load_graph(data, "p")


def test_damaged_tensor_record_is_not_described_as_a_tensor() -> None:
    storage = StorageRef(("storage", GlobalRef("torch", "FloatStorage"), "0", "cpu", 4), "float32", "0", "cpu", 4)
    damaged = Reduced(GlobalRef("torch._utils", "_rebuild_tensor_v2"), (storage, 0, (4,), False, False, None))
    assert tensor_meta(damaged) is None
    assert is_tensor(damaged)


def test_new_tensor_is_what_torch_would_pickle(tmp_path: Path) -> None:
    ref = storage_for("7", "bfloat16", 6, legacy=False)
    tensor = new_tensor(ref, (2, 3))
    meta = tensor_meta(tensor)
    assert meta is not None
    assert (meta.dtype, meta.shape, meta.stride, meta.storage, meta.nbytes) == ("bfloat16", (2, 3), (3, 1), "7", 12)
    data = dump_graph({"t": tensor})
    loaded = torch_pickle_load(data, {"7": torch.full((6,), 2.0, dtype=torch.bfloat16)})
    assert loaded["t"].dtype == torch.bfloat16 and loaded["t"].shape == (2, 3) and loaded["t"].stride() == (3, 1)
    with pytest.raises(RepairRefused, match="cannot create a storage of dtype uint16"):
        storage_for("8", "uint16", 1, legacy=False)


def test_walk_visits_every_container_once_with_its_path() -> None:
    shared = {"state": {}, "param_groups": []}
    root = {"a": [shared, (1, {"b": 2})], "c": shared}
    paths = [path for path, _ in walk(root)]
    assert paths == [(), ("a",), ("a", 0), ("a", 0, "state"), ("a", 0, "param_groups"), ("a", 1), ("a", 1, 1)]


def test_a_legacy_storage_view_that_torch_cannot_unpack_is_refused() -> None:
    """torch's legacy loader unpacks a storage's view as (key, offset, size); a view of another shape makes it raise
    ("not enough values to unpack"), so the file is refused here too (fuzz seed 2, case 6530)."""
    ref = storage_for("0", "float32", 4, legacy=True)
    assert ref.pid[5] is None  # what torch writes: no view
    for view in (None, ("v", 0, 4)):
        storage = StorageRef((*ref.pid[:5], view), "float32", "0", "cpu", 4)
        assert load_graph(dump_graph({"t": new_tensor(storage, (4,))}), "p", legacy=True).storages
    bad = StorageRef((*ref.pid[:5], ("v",)), "float32", "0", "cpu", 4)
    with pytest.raises(InputError, match=r"its view is no \(key, offset, size\)"):
        load_graph(dump_graph({"t": new_tensor(bad, (4,))}), "p", legacy=True)


def _chain(levels: int, inner: Any = None) -> Any:
    """``levels`` lists, each holding the next, the innermost holding ``inner``."""
    node = inner
    for _ in range(levels):
        node = [node]
    return node


def test_check_depth_counts_shared_containers_on_every_path_and_cycles_once() -> None:
    check_depth(_chain(MAX_DEPTH), "x.pkl")
    with pytest.raises(InputError, match=f"x.pkl: its containers nest more than {MAX_DEPTH} deep"):
        check_depth(_chain(MAX_DEPTH + 1), "x.pkl")
    shared = _chain(60)
    check_depth({"a": _chain(39, shared), "b": shared, "c": (shared, ())}, "x.pkl")  # 1 + 39 + 60 levels
    with pytest.raises(InputError, match="more than"):
        check_depth({"a": [shared], "b": _chain(41, shared)}, "x.pkl")  # shared met first one level down
    with pytest.raises(InputError, match="more than"):
        check_depth(Reduced(GlobalRef("m", "f"), (_chain(MAX_DEPTH),)), "x.pkl")  # the call, then its arguments
    looped: list[Any] = [_chain(MAX_DEPTH - 1)]
    looped.append(looped)  # a reference back to a container being walked adds nothing
    check_depth(looped, "x.pkl")
    check_depth([()] * MAX_DEPTH, "x.pkl")
    check_depth(_chain(MAX_DEPTH, ()), "x.pkl")  # the empty tuple holds nothing: it adds no level
