"""The differential trial of object storage: each case read from a local S3-compatible server and from disk.

``python scripts/fuzz --s3 --cases 1000 --seed 0 --out /tmp/fuzz-s3``: every case's files (a store holds no
links, FIFOs or empty directories, so only its regular files) are uploaded to moto's server on 127.0.0.1 and
inspected as ``s3://`` and as the same files on disk. The two answers must be the same document, or the same
error with the same exit code, once the URL is read as the path. A disagreement is a finding, saved with its
case; a torch file not in zip format, which a store does not read yet, is not compared.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from fuzz.cases import make_case
from fuzz.corpus import build_corpus, load_corpus, make_outside
from fuzz.trees import materialize

_NOT_COMPARED = "not read in object storage yet"
_WORDS = (
    ("cannot read (no such object)", "cannot read (No such file or directory)"),
    ("cannot read (no such object)", "is a directory, not a regular file"),  # a store holds no directories
    (": no such object (was it deleted meanwhile?)", ": no such file or directory"),
)
"""What a store says where a file system says otherwise: the same answer in the other's words."""


def _same(local: tuple[str, int | None], remote: tuple[str, int | None], url: str, path: str) -> bool:
    """Whether the remote outcome is the local one: the URL read as the path, the store's words as a disk's."""
    text = remote[0].replace(json.dumps(url)[1:-1], json.dumps(path)[1:-1]).replace(url.rstrip("/"), path)
    readings = {text, *(text.replace(store, disk) for store, disk in _WORDS)}
    return local[1] == remote[1] and local[0] in readings


def _outcome(inspect: Any, target: str) -> tuple[str, int | None]:
    from optim_repair.errors import OptimRepairError
    from optim_repair.render import inspect_document

    try:
        document = inspect_document(inspect(target))
    except OptimRepairError as exc:
        return f"{type(exc).__name__}: {exc}", int(exc.exit_code)
    except Exception:  # a crash: the finding names it
        return f"crash: {traceback.format_exc(limit=-3)}", None
    document.pop("remote", None)
    return json.dumps(document, sort_keys=True), 0


def _unlike(diff: Any, path: str, url: str) -> tuple[str, int | None] | None:
    """What ``diff`` of the files on the disk and in the store finds, where they are not the same; else None
    (and None where ``diff`` refuses the files on the disk too: it reads every byte, and refuses more than
    inspect, which reads no tensor)."""
    from optim_repair.errors import OptimRepairError

    try:
        diff(path, path)
    except OptimRepairError:
        return None
    except Exception:  # a crash: the finding names it
        return f"diff crash: {traceback.format_exc(limit=-3)}", None
    try:
        difference = diff(path, url)
    except OptimRepairError as exc:
        return f"diff: {type(exc).__name__}: {exc}", int(exc.exit_code)
    except Exception:  # a crash: the finding names it
        return f"diff crash: {traceback.format_exc(limit=-3)}", None
    return None if difference.same else (f"diff: {[leaf.name for leaf in difference.leaves][:8]}", 1)


def run_remote(cases: int, seed: int, out: Path, *, start: int = 0, corpus: Path | None = None) -> int:
    """Run ``cases`` cases from ``start``; save each disagreement under ``out``; return how many there were."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from optim_repair import api
    from tests.factories import s3server

    with tempfile.TemporaryDirectory(prefix="optim-repair-fuzz-s3-") as tmp:
        work = Path(tmp)
        corpus_dir = corpus or work / "corpus"
        if not (corpus_dir / "manifest.json").exists():
            build_corpus(corpus_dir)
        seeds = load_corpus(corpus_dir)
        outside = make_outside(seeds, work / "outside")
        server = s3server.start(work / "requests.log")
        saved = {name: os.environ.get(name) for name in (*s3server.CREDENTIALS, "AWS_ENDPOINT_URL")}
        os.environ.update(s3server.CREDENTIALS, AWS_ENDPOINT_URL=server.endpoint)
        found = 0
        try:
            bucket = s3server.new_bucket(server)
            for index in range(start, start + cases):
                case = make_case(seeds, outside, seed, index, fix_every=0)
                files = {rel: node for rel, node in case.tree.items() if isinstance(node, bytes)}
                local = work / f"case-{index}"
                materialize(files, local)
                s3server.upload(server, local, bucket, f"case-{index}/")
                is_dir = (local / case.seed.arg).is_dir()
                url = f"s3://{bucket}/case-{index}/{case.seed.arg}" + ("/" if is_dir else "")
                path = str(local / case.seed.arg)
                here, there = _outcome(api.inspect, path), _outcome(api.inspect, url)
                if here[1] == there[1] == 0 and _NOT_COMPARED not in there[0]:
                    there = _unlike(api.diff, path, url) or there  # the store's bytes are the disk's, leaf by leaf
                if _NOT_COMPARED not in there[0] and not _same(here, there, url, path):
                    found += 1
                    keep = out / f"case-{index}"
                    shutil.copytree(local, keep / "input", dirs_exist_ok=True)
                    detail = {"seed": seed, "case": index, "mutator": case.mutator, "notes": case.notes,
                              "local": here, "remote": there}  # fmt: skip
                    (keep / "case.json").write_text(json.dumps(detail, indent=2))
                    print(f"[fuzz --s3] case {index} ({case.mutator}): local {here[0][:150]!r} | s3 {there[0][:150]!r}")
                shutil.rmtree(local)
                if (index - start + 1) % 100 == 0:
                    print(f"[fuzz --s3] {index - start + 1}/{cases} cases, {found} disagreeing", flush=True)
        finally:
            s3server.stop(server)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return found
