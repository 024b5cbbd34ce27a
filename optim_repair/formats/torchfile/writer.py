"""Writing a torch file with a plan applied: its pickle extended or pickled anew, every storage it still names copied.

A plan that only adds entries to a zip-format file's dicts appends them to the original pickle (``appendix``).
Otherwise the writer builds the edited optimizers anew (``changes``) and pickles the new root; the graph reading
parsed is never changed, so that the verifier can compare the copy with the original as it was read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from optim_repair.errors import InputError
from optim_repair.formats.addresses import resolve
from optim_repair.formats.pickle_writing import dump_graph
from optim_repair.formats.pickled import load_graph
from optim_repair.formats.torchfile.added import NewStorages
from optim_repair.formats.torchfile.appendix import appended_pickle
from optim_repair.formats.torchfile.changes import changed_optimizer, put, with_entry
from optim_repair.formats.torchfile.files import TorchFile, open_torch_file
from optim_repair.formats.torchfile.legacy import LegacyTorchFile
from optim_repair.formats.torchfile.planning import plan_torch_file
from optim_repair.formats.torchfile.rewrite import NewStorage, write_legacy, write_zip
from optim_repair.formats.torchfile.splice import write_spliced
from optim_repair.formats.torchfile.zipformat import ZipTorchFile, kept_records
from optim_repair.formats.unpickling import ZIP_ERRORS
from optim_repair.records.repair_plan import Addition, ParamChange


def edited_root(
    torch_file: TorchFile, additions: Sequence[Addition], changes: Sequence[ParamChange]
) -> tuple[Any, list[NewStorage]]:
    """The graph's root with ``changes``, then ``additions`` applied, and the storages the additions create."""
    root = torch_file.graph.root
    storages = NewStorages(torch_file)
    addresses = dict.fromkeys([*(change.address for change in changes), *(a.address for a in additions)])
    for address in sorted(addresses, key=len):
        original = resolve(torch_file.graph.root, address)
        optimizer = changed_optimizer(original, [change for change in changes if change.address == address])
        for addition in (addition for addition in additions if addition.address == address):
            with_entry(optimizer, addition, storages.values(addition, original))
        root = put(root, address, optimizer)
    return root, storages.created


def new_pickle(
    torch_file: TorchFile, source: str, additions: Sequence[Addition], changes: Sequence[ParamChange]
) -> tuple[bytes, list[NewStorage], frozenset[str]]:
    """The copy's pickle, the storages it adds, and those it names no more: the original's bytes with the entries
    appended where the plan only adds them (``appendix``), else the edited graph pickled anew."""
    appended = appended_pickle(torch_file, additions) if isinstance(torch_file, ZipTorchFile) and not changes else None
    if appended is not None:
        return (*appended, frozenset())
    root, created = edited_root(torch_file, additions, changes)
    data = dump_graph(root)
    replacing = any(addition.replaces for addition in additions) or any(c.new is None for c in changes)
    legacy = isinstance(torch_file, LegacyTorchFile)
    # the storages only a replaced or dropped entry held are not copied: the new pickle names them no more
    named = (
        set(load_graph(data, source, ours=True, legacy=legacy).storages)
        if replacing
        else set(torch_file.graph.storages)
    )
    return data, created, frozenset(torch_file.graph.storages) - named


def write_torch_file(
    src: Path,
    source: str,
    additions: Sequence[Addition],
    dest: Path,
    *,
    changes: Sequence[ParamChange] = (),
    parsed: TorchFile | None = None,
    on_bytes: Callable[[int], None] = lambda nbytes: None,
) -> None:
    """Write ``src`` with ``changes`` (renames, drops), then ``additions`` applied to ``dest`` (created if need
    be): every other byte of meaning unchanged. Syncing it to the disk is the caller's.

    ``parsed`` is ``src`` as reading parsed it; it is left as it was. The plan is checked first
    (``planning.plan_torch_file``), so that a refusal comes before any byte is written.
    """
    torch_file = parsed or open_torch_file(src, source)
    plan_torch_file(torch_file, source, additions, changes)
    data, created, dropped = new_pickle(torch_file, source, additions, changes)
    # Opened without O_TRUNC: truncating a file and writing it anew makes ext4 flush it all at close.
    # An OSError (a full disk, ...) is the writer's to report: it names --out, not the temporary file.
    target = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        if os.fstat(target).st_size:
            os.ftruncate(target, 0)
        if isinstance(torch_file, LegacyTorchFile):
            write_legacy(torch_file, data, created, target, on_bytes)
        elif not dropped and kept_records(torch_file) is not None:
            write_spliced(torch_file, data, created, target, on_bytes)
        else:
            write_zip(torch_file, data, created, target, on_bytes, dropped=dropped)
    except ZIP_ERRORS as exc:
        raise InputError(f"damaged zip archive ({exc})", path=source) from exc
    finally:
        os.close(target)
