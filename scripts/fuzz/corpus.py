"""The seed corpus: real checkpoints built once, the files outside every input, what a mutator works on."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.trees import Seed, Tree, materialize, read_tree

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def import_torch() -> Any:
    """torch, and the DCP classes a ``.metadata`` pickle names, imported without torch's NumPy warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import torch.distributed.checkpoint.filesystem
        import torch.distributed.checkpoint.metadata

    return torch


def build_corpus(corpus: Path) -> None:
    """Write every seed under ``corpus/seeds/<name>/`` and a ``manifest.json``, with real torch."""
    torch = import_torch()
    from fuzz.seeds import SEEDS

    manifest = []
    scratch = corpus / "scratch"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, kind, build in SEEDS:
            random.seed(0)
            torch.manual_seed(0)
            try:
                built = build(scratch / name)
            except Exception as exc:  # a factory this torch cannot run (sharded DCP needs a fake process group)
                print(f"[fuzz] skipped seed {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            target = corpus / "seeds" / name / built.name
            target.parent.mkdir(parents=True)
            if built.is_dir():
                shutil.copytree(built, target, symlinks=True)
            else:
                shutil.copyfile(built, target)
            manifest.append({"name": name, "kind": kind, "arg": built.name})
    shutil.rmtree(scratch, ignore_errors=True)
    (corpus / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def load_corpus(corpus: Path) -> list[Seed]:
    """The seeds of a corpus ``build_corpus`` wrote, in memory."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    return [Seed(s["name"], s["kind"], s["arg"], read_tree(corpus / "seeds" / s["name"])) for s in manifest]


def corpus_digest(seeds: Sequence[Seed]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for seed in seeds:
        for rel in sorted(seed.tree):
            node = seed.tree[rel]
            digest.update(f"{seed.name}/{rel}\0".encode())
            digest.update(node if isinstance(node, bytes) else repr(node).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Outside:
    """Files outside every case's input, that mutations link to: reading them is a finding."""

    root: Path
    by_suffix: Mapping[str, str]
    """A suffix (``.pt``, ``.metadata``, ...) -> the absolute path of a real file of that kind."""
    directory: str
    """A real DCP checkpoint directory outside the input."""


def make_outside(seeds: Sequence[Seed], root: Path) -> Outside:
    root.mkdir(parents=True, exist_ok=True)
    by_suffix: dict[str, str] = {}
    for seed in seeds:
        for rel, node in seed.tree.items():
            suffix = ".metadata" if rel.endswith("/.metadata") else Path(rel).suffix
            if isinstance(node, bytes) and suffix and suffix not in by_suffix:
                path = root / f"victim{suffix}"
                path.write_bytes(node)
                by_suffix[suffix] = str(path)
    dcp = next(seed for seed in seeds if seed.kind == "dcp")
    materialize({rel: node for rel, node in dcp.tree.items()}, root / "dcp")
    return Outside(root, by_suffix, str(root / "dcp" / dcp.arg))


@dataclass
class MutationContext:
    """What a mutator works on: the case's tree (a copy of the seed's), its random source, and what it can use."""

    rng: random.Random
    seed: Seed
    tree: Tree
    corpus: Sequence[Seed]
    outside: Outside
    notes: list[str] = field(default_factory=list)

    def files(self, predicate: Callable[[str, bytes], bool] = lambda rel, data: True) -> list[str]:
        return sorted(rel for rel, node in self.tree.items() if isinstance(node, bytes) and predicate(rel, node))

    def pick(self, rels: Sequence[str]) -> str:
        weights = [4 if rel.endswith((*TORCH_SUFFIXES, ".metadata", ".distcp", ".safetensors")) else 1 for rel in rels]
        return self.rng.choices(rels, weights=weights)[0]

    def data(self, rel: str) -> bytes:
        node = self.tree[rel]
        assert isinstance(node, bytes)
        return node

    def dcp_dirs(self) -> list[str]:
        return sorted(rel.rpartition("/")[0] for rel in self.files(lambda rel, data: rel.endswith("/.metadata")))

    def outside_for(self, rel: str) -> str:
        suffix = ".metadata" if rel.endswith(".metadata") else Path(rel).suffix
        return self.outside.by_suffix.get(suffix, self.outside.by_suffix.get(".pt", "/etc/hostname"))
