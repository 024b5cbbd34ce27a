"""``run``: cases of one seed, each materialized, run in the supervised worker and classified."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from fuzz.cases import make_case
from fuzz.corpus import build_corpus, load_corpus, make_outside
from fuzz.findings import Finding, Group, Summary, classify, output_left, save_reproducer, tally, write_index
from fuzz.supervisor import Supervisor
from fuzz.trees import differences, materialize, snapshot

SLOW_TIMEOUT_S = 2.0
"""The timeout for a mutator once it has used up its ``--hang-budget``."""


def run(
    cases: int,
    seed: int = 0,
    out: Path | str = "fuzz-findings",
    *,
    start: int = 0,
    fix_every: int = 10,
    timeout: float = 10.0,
    rss_mib: int = 1024,
    fsize_mib: int = 256,
    corpus: Path | str | None = None,
    keep: int = 10,
    hang_budget: int = 3,
    progress: bool = False,
    verbose: bool = False,
) -> Summary:
    """Run cases ``start .. start+cases-1`` of the run ``seed`` in a supervised worker; save findings under ``out``.

    ``corpus``: a directory of seeds, built there when it has none yet (default: a temporary one).
    ``keep``: reproducers saved per distinct finding (each finding's cases are all listed in findings.json).
    ``hang_budget``: after this many hangs or deaths of one mutator, its cases get a timeout of 2 s.
    """
    out = Path(out)
    if (out / "findings.json").exists():
        shutil.rmtree(out)  # a previous run's findings, not anything else
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(seed)
    setup = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="optim-repair-fuzz-") as tmp:
        workdir = Path(tmp)
        corpus_dir = Path(corpus) if corpus is not None else workdir / "corpus"
        if not (corpus_dir / "manifest.json").exists():
            build_corpus(corpus_dir)
        seeds = load_corpus(corpus_dir)
        outside = make_outside(seeds, workdir / "outside")
        outside_before = snapshot(outside.root)
        supervisor = Supervisor(workdir, rss_mib, fsize_mib)
        import optim_repair

        package_dir = os.path.dirname(os.path.realpath(optim_repair.__file__))
        case_dir = workdir / "case"
        deaths: Counter[str] = Counter()
        supervisor.start()
        began = last_report = time.monotonic()
        summary.setup_seconds = began - setup
        try:
            for index in range(start, start + cases):
                case = make_case(seeds, outside, seed, index, fix_every)
                shutil.rmtree(case_dir, ignore_errors=True)
                in_dir, out_dir = case_dir / "in", case_dir / "out"
                materialize(case.tree, in_dir)
                out_dir.mkdir()
                before = snapshot(in_dir)
                out_name = Path(case.seed.arg).name
                request = {
                    "index": index,
                    "path": str(in_dir / case.seed.arg),
                    "in_dir": str(in_dir),
                    "out_dir": str(out_dir),
                    "out": str(out_dir / out_name),
                    "fix": case.fix,
                    "fill": case.fill,
                    "link": case.link,
                    "dereference": case.dereference,
                    "operations": case.operations,
                }
                limit = timeout if deaths[case.mutator] < hang_budget else min(timeout, SLOW_TIMEOUT_S)
                raw = supervisor.run(request, limit)
                if raw.death is not None:
                    deaths[case.mutator] += 1
                changed = differences(before, snapshot(in_dir))
                outside_changed = differences(outside_before, snapshot(outside.root))
                left = output_left(case, raw, out_dir, out_name)
                findings = classify(case, raw, changed, left, rss_mib, package_dir, os.path.realpath(workdir))
                if outside_changed:
                    findings.append(Finding("outside-changed", "inspect/fix", "; ".join(outside_changed)[:1000]))
                    outside = make_outside(seeds, workdir / "outside")
                    outside_before = snapshot(outside.root)
                tally(summary, case, raw, findings)
                for finding in findings:
                    group = summary.groups.setdefault(
                        finding.signature, Group(finding.kind, finding.signature, finding.detail)
                    )
                    group.count += 1
                    group.cases.append(index)
                    if len(group.saved) < keep:
                        saved = save_reproducer(out, finding, case, raw, seed, corpus_dir.resolve(), outside)
                        group.saved.append(str(saved))
                if verbose:
                    record = {"case": index, "seed": case.seed.name, "mutator": case.mutator, "notes": case.notes,
                              "death": raw.death, "response": raw.response,
                              "findings": [dataclasses.asdict(f) for f in findings]}  # fmt: skip
                    print(json.dumps(record, indent=2, default=str))
                if index % 200 == 0:
                    supervisor.trim_log()
                if progress and time.monotonic() - last_report > 5:
                    last_report = time.monotonic()
                    elapsed = last_report - began
                    print(f"[fuzz] {summary.cases}/{cases} cases, {summary.findings} with findings "
                          f"({len(summary.groups)} distinct), {summary.cases / elapsed:.1f}/s",
                          file=sys.stderr, flush=True)  # fmt: skip
        except KeyboardInterrupt:
            summary.interrupted = True
        finally:
            summary.seconds = time.monotonic() - began
            summary.worker_starts = supervisor.starts
            supervisor.stop()
            shutil.rmtree(case_dir, ignore_errors=True)
    write_index(out, summary)
    return summary
