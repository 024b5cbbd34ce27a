"""A fix that only adds entries appends them to the original pickle (``appendix``), and its proof (``appendix_proof``).

The writer must keep every byte of the original pickle but its ``STOP``; torch must load the result (weights-only,
mmap too) with the entries after the old ones; and the proof must refuse an appendix that does anything the plan
does not, however small.
"""

from __future__ import annotations

import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from optim_repair.errors import VerificationError
from optim_repair.formats.pickle_writing import dump_graph
from optim_repair.formats.pickled import load_graph
from optim_repair.formats.torchfile import open_torch_file, write_torch_file
from optim_repair.formats.torchfile.verifier import verify_torch_file
from optim_repair.records.repair_plan import Addition
from tests.factories import defects, trainers
from tests.factories.built import Built
from tests.factories.support import binfloat, empty_additions, load, resolve, rewrite_pickle

OPT = trainers.OPT_SITE


def _pickle(path: Path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        return archive.read(name)


def test_the_original_pickle_is_kept_byte_for_byte_and_torch_reads_the_entries_after_the_old_ones(
    tricky_copy: tuple[Built, Path, list[Addition]],
) -> None:
    built, out, planned = tricky_copy
    original, copy = _pickle(built.path), _pickle(out)
    assert copy.startswith(original[:-1]) and copy.endswith(pickle.STOP) and len(copy) > len(original)
    before = resolve(load(built.path), OPT)["state"]
    for loaded in (load(out), torch.load(out, weights_only=True, mmap=True)):
        state = resolve(loaded, OPT)["state"]
        assert list(state) == [*before, *(addition.param for addition in planned)]
        assert all(state[addition.param] == {} for addition in planned)
        assert all(list(state[key]) == list(before[key]) for key in before)


def test_its_proof_counts_the_tensors_a_graph_comparison_counts(
    tricky_copy: tuple[Built, Path, list[Addition]], tmp_path: Path
) -> None:
    built, out, planned = tricky_copy
    repickled = tmp_path / "repickled.pt"
    shutil.copyfile(out, repickled)
    rewrite_pickle(repickled, lambda data: dump_graph(load_graph(data, "copy").root))
    assert not _pickle(repickled).startswith(_pickle(built.path)[:-1]), "a pickle written anew"
    by_appendix = verify_torch_file(built.path, out, "tricky", planned)
    by_graph = verify_torch_file(built.path, repickled, "tricky", planned)
    assert by_appendix.tensors == by_graph.tensors > 0 and by_appendix.bytes == by_graph.bytes


_NONE = pickle.NONE
_KEY = pickle.BINUNICODE + len(b"extra").to_bytes(4, "little") + b"extra"


@pytest.mark.parametrize(
    ("tail", "match"),
    [
        (_KEY + _NONE + pickle.SETITEM, r"sets keys \[.*'extra'\] in the root"),  # the root given a key
        (_NONE, "leaves other than the root on its stack"),
        (pickle.BINGET + b"\x01" + pickle.MARK + _KEY + _NONE + pickle.SETITEMS, "cannot be read back"),
    ],
    ids=["a-key-set-in-the-root", "a-value-left-on-the-stack", "another-memo-entry-edited"],
)
def test_an_appendix_that_does_anything_unplanned_is_refused(
    tricky_copy: tuple[Built, Path, list[Addition]], tmp_path: Path, tail: bytes, match: str
) -> None:
    built, out, planned = tricky_copy
    rewrite_pickle(out, lambda data: data[:-1] + tail + pickle.STOP)
    with pytest.raises(VerificationError, match=match):
        verify_torch_file(built.path, out, "tricky", planned)


def test_a_kept_byte_changed_is_found_by_the_graph_comparison(tricky_copy: tuple[Built, Path, list[Addition]]) -> None:
    built, out, planned = tricky_copy
    value = float(resolve(load(built.path), OPT)["param_groups"][0]["lr"])
    rewrite_pickle(out, lambda data: data.replace(binfloat(value), binfloat(value * 2), 1))
    with pytest.raises(VerificationError, match="became"):
        verify_torch_file(built.path, out, "tricky", planned)


def test_a_pickle_followed_by_more_bytes_is_written_anew(root: Path, tmp_path: Path) -> None:
    """torch reads a pickle up to its first STOP: entries appended after bytes that follow it would go unread."""
    built = defects.tricky_tensors(root)
    rewrite_pickle(built.path, lambda data: data + b"trailing")
    out = tmp_path / "copy.pt"
    planned = empty_additions(built)
    write_torch_file(built.path, "tricky", planned, out)
    assert not _pickle(out).startswith(_pickle(built.path)[:-1])
    assert verify_torch_file(built.path, out, "tricky", planned).tensors > 0
    state = resolve(load(out), OPT)["state"]
    assert all(addition.param in state for addition in planned)


@pytest.mark.parametrize("factory", ["hf_trainer", "accelerate", "multi_optimizer", "lightning"])
def test_each_layout_is_appended_where_its_way_is_dicts_and_written_anew_where_not(
    factory: str, root: Path, tmp_path: Path
) -> None:
    built = getattr(trainers, factory)(root)
    for site, missing in built.missing.items():
        path = built.path / site.file if site.file else built.path
        planned = [a for a in empty_additions(built) if a.file == site.file]
        out = tmp_path / f"copy-{factory}.pt"
        write_torch_file(path, "t", planned, out)
        verify_torch_file(path, out, "t", planned)
        through_a_list = any(isinstance(step, int) for step in site.address)  # Lightning's optimizer_states[0]
        assert _pickle(out).startswith(_pickle(path)[:-1]) is not through_a_list
        assert open_torch_file(out, "t").graph.root is not None
        state = resolve(load(out), site.address)["state"]
        assert all(param in state for param in missing)
