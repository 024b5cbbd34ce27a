"""Mutators over a case's tree, by name and weight, and the case derived from (seed, index) alone."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz.corpus import MutationContext, Outside
from fuzz.dcp import dcp_bytes_entry, dcp_metadata_edit, dcp_metadata_pickle, dcp_rank_local, dcp_torch_215
from fuzz.files import (
    BYTE_MUTATORS,
    LEGACY_MAGIC,
    legacy_numel,
    legacy_pickle,
    safetensors_edit,
    zip_header,
    zip_pickle,
    zip_rewrite,
)
from fuzz.trees import Dir, Fifo, Link, Node, Seed, Tree


def _byte_mutator(name: str) -> Callable[[MutationContext], bool]:
    def mutate(ctx: MutationContext) -> bool:
        rels = ctx.files()
        if not rels:
            return False
        rel = ctx.pick(rels)
        donors = [node for seed in ctx.corpus for node in seed.tree.values() if isinstance(node, bytes) and node]
        ctx.tree[rel], note = BYTE_MUTATORS[name](ctx.rng, ctx.data(rel), ctx.rng.choice(donors))
        ctx.notes.append(f"{rel}: {note}")
        return True

    return mutate


def _is_zip(rel: str, data: bytes) -> bool:
    return data[:4] == b"PK\x03\x04" and not rel.endswith(".distcp")


def _file_mutator(
    predicate: Callable[[str, bytes], bool], mutate: Callable[[random.Random, bytes], tuple[bytes, str] | None]
) -> Callable[[MutationContext], bool]:
    def apply(ctx: MutationContext) -> bool:
        rels = ctx.files(predicate)
        if not rels:
            return False
        rel = ctx.pick(rels)
        done = mutate(ctx.rng, ctx.data(rel))
        if done is None:
            return False
        ctx.tree[rel] = done[0]
        ctx.notes.append(f"{rel}: {done[1]}")
        return True

    return apply


def _structural(variant: str) -> Callable[[MutationContext], bool]:
    """Replace a file inside a checkpoint directory (never the argument itself) by a link, a FIFO or a directory."""

    def apply(ctx: MutationContext) -> bool:
        if ctx.seed.kind not in ("dcp", "directory"):
            return False
        rels = [rel for rel in ctx.files() if rel != ctx.seed.arg]
        if variant == "link-dir-outside":
            ctx.tree[f"{ctx.seed.arg}/linked_dir"] = Link(ctx.outside.directory)
            ctx.notes.append(f"{ctx.seed.arg}/linked_dir -> {ctx.outside.directory}")
            return True
        if not rels:
            return False
        rel = ctx.pick(rels)
        node: Node
        if variant == "link-outside":
            node = Link(ctx.outside_for(rel))
        elif variant == "link-devzero":
            node = Link("/dev/zero")
        elif variant == "fifo":
            node = Fifo()
        elif variant == "link-loop":
            name = rel.rpartition("/")[2]
            if ctx.rng.random() < 0.5:
                node = Link(name)
            else:
                node = Link(f"{name}.loop")
                ctx.tree[f"{rel}.loop"] = Link(name)
        elif variant == "link-dangling":
            node = Link("does-not-exist" + Path(rel).suffix)
        else:
            node = Dir()
        ctx.tree[rel] = node
        ctx.notes.append(f"{rel} -> {node}")
        return True

    return apply


def neighbour(ctx: MutationContext) -> bool:
    """Beside a file argument, a ``.safetensors`` file (read for shapes) that is special or damaged."""
    if ctx.seed.kind not in ("zip", "legacy"):
        return False
    rel = ctx.rng.choice(("model.safetensors", "a.safetensors"))
    variant = ctx.rng.choice(("fifo", "devzero", "outside", "loop", "dir", "damaged"))
    node: Node
    if variant == "fifo":
        node = Fifo()
    elif variant == "devzero":
        node = Link("/dev/zero")
    elif variant == "outside":
        node = Link(ctx.outside.by_suffix.get(".safetensors", "/etc/hostname"))
    elif variant == "loop":
        node = Link(rel)
    elif variant == "dir":
        node = Dir()
    else:
        source = ctx.outside.by_suffix.get(".safetensors")
        done = safetensors_edit(ctx.rng, Path(source).read_bytes()) if source else None
        if done is None:
            return False
        node = done[0]
    ctx.tree[rel] = node
    ctx.notes.append(f"neighbour {rel}: {variant}")
    return True


def root_special(ctx: MutationContext) -> bool:
    """The argument itself is a FIFO, a link loop, a dangling link or a directory."""
    if ctx.seed.kind not in ("zip", "legacy"):
        return False
    variant = ctx.rng.choice(("fifo", "loop", "dangling", "dir"))
    arg = ctx.seed.arg
    nodes: dict[str, Node] = {"fifo": Fifo(), "loop": Link(arg), "dangling": Link("gone.pt"), "dir": Dir()}
    node = nodes[variant]
    ctx.tree[arg] = node
    ctx.notes.append(f"argument {arg}: {variant}")
    return True


def _is_legacy(rel: str, data: bytes) -> bool:
    return data.startswith(LEGACY_MAGIC)


STRUCTURAL = ("link-outside", "link-devzero", "fifo", "link-loop", "link-dangling", "dir-for-file", "link-dir-outside")


@dataclass(frozen=True)
class Mutator:
    apply: Callable[[MutationContext], bool]
    weight: float
    kinds: tuple[str, ...] = ("zip", "legacy", "dcp", "directory")


MUTATORS: dict[str, Mutator] = {
    **{name: Mutator(_byte_mutator(name), 2.0) for name in BYTE_MUTATORS},
    "zip-header": Mutator(_file_mutator(_is_zip, zip_header), 3.0, ("zip", "directory")),
    "zip-rewrite": Mutator(_file_mutator(_is_zip, zip_rewrite), 3.0, ("zip", "directory")),
    "zip-pickle": Mutator(_file_mutator(_is_zip, zip_pickle), 8.0, ("zip", "directory")),
    "legacy-pickle": Mutator(_file_mutator(_is_legacy, legacy_pickle), 10.0, ("legacy",)),
    "legacy-numel": Mutator(_file_mutator(_is_legacy, legacy_numel), 2.0, ("legacy",)),
    "safetensors": Mutator(
        _file_mutator(lambda rel, data: rel.endswith(".safetensors"), safetensors_edit), 1.5, ("directory",)
    ),
    "dcp-metadata-pickle": Mutator(dcp_metadata_pickle, 6.0, ("dcp", "directory")),
    "dcp-metadata-edit": Mutator(dcp_metadata_edit, 8.0, ("dcp", "directory")),
    "dcp-bytes-entry": Mutator(dcp_bytes_entry, 5.0, ("dcp", "directory")),
    "dcp-rank-local": Mutator(dcp_rank_local, 2.0, ("dcp", "directory")),
    "dcp-torch-215": Mutator(dcp_torch_215, 2.0, ("dcp", "directory")),
    **{variant: Mutator(_structural(variant), 0.5, ("dcp", "directory")) for variant in STRUCTURAL},
    "neighbour": Mutator(neighbour, 0.7, ("zip", "legacy")),
    "root-special": Mutator(root_special, 0.3, ("zip", "legacy")),
}
"""Every mutator by name, with its relative weight and the seed kinds it applies to."""
HAVOC = 0.1
"""The chance of a byte mutation after a case's mutator."""


@dataclass
class Case:
    """One fuzz case: everything here follows from (seed, index) and the corpus."""

    index: int
    seed: Seed
    tree: Tree
    mutator: str
    notes: list[str]
    fix: bool
    fill: str | None
    link: bool
    dereference: bool
    """Whether links are followed (``--dereference``), in ``inspect`` and ``fix``."""
    operations: dict[str, Any]
    """The model changes ``fix`` is asked for (``optim_repair.model_changes`` keywords), often none."""


OPERATIONS: tuple[dict[str, Any], ...] = (
    {"rename": [(r"^(.*)$", r"renamed.\1")]},
    {"rename": [(r"\.weight$", ".w")]},
    {"drop": [r"head"]},
    {"drop": [r"."]},
    {"drop_not_in_model": True},
    {"add_from_model": True},
    {"add_from_model": True, "to_group": 0},
    {"rename": [(r"^(.*)$", r"x.\1")], "drop": [r"bias"]},
)
"""What ``fix`` with model operations is tried with: renames, drops and additions, alone and together."""


def make_case(corpus: Sequence[Seed], outside: Outside, seed: int, index: int, fix_every: int) -> Case:
    """The case ``index`` of the run with ``seed``: a seed checkpoint, mutated."""
    rng = random.Random(f"optim-repair-fuzz/{seed}/{index}")
    kind = rng.choice(sorted({s.kind for s in corpus}))
    chosen = rng.choice([s for s in corpus if s.kind == kind])
    names = [name for name, mutator in MUTATORS.items() if chosen.kind in mutator.kinds]
    weights = [MUTATORS[name].weight for name in names]
    ctx = MutationContext(rng, chosen, dict(chosen.tree), corpus, outside)
    label = "flip"
    for _ in range(8):
        name = rng.choices(names, weights=weights)[0]
        try:
            if MUTATORS[name].apply(ctx):
                label = name
                break
        except Exception as exc:  # a bug of this fuzzer: note it, try another mutator
            ctx.notes.append(f"fuzzer error in {name}: {type(exc).__name__}: {exc}")
        ctx.tree = dict(chosen.tree)
    else:
        MUTATORS["flip"].apply(ctx)
    if rng.random() < HAVOC:
        MUTATORS[rng.choice(list(BYTE_MUTATORS))].apply(ctx)
        ctx.notes.append("(havoc)")
    fix = fix_every > 0 and index % fix_every == 0
    fill = rng.choice((None, "empty", "fresh"))
    link = rng.random() < 0.3
    dereference = rng.random() < 0.2
    operations = rng.choice(OPERATIONS) if rng.random() < 0.3 else {}
    return Case(index, chosen, ctx.tree, label, ctx.notes, fix, fill, link, dereference, operations)
