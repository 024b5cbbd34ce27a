"""The command line: ``python scripts/fuzz --cases 20000 --seed 0 --out /tmp/fuzz-findings``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import fuzz
from fuzz.findings import format_summary
from fuzz.runner import run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(fuzz.__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("fuzz-findings"))
    parser.add_argument("--start", type=int, default=0, help="the first case index")
    parser.add_argument("--only", type=int, default=None, help="run just this case index, and print what happened")
    parser.add_argument("--fix-every", type=int, default=10, help="also fix every N'th case (0: never)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a case may take")
    parser.add_argument("--rss-mib", type=int, default=1024, help="the worker's memory limit (resident)")
    parser.add_argument("--fsize-mib", type=int, default=256, help="the largest file the worker may write")
    parser.add_argument("--corpus", type=Path, default=None, help="keep (or reuse) the seed checkpoints here")
    parser.add_argument("--keep", type=int, default=10, help="reproducers saved per distinct finding")
    parser.add_argument("--hang-budget", type=int, default=3)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument(
        "--s3",
        action="store_true",
        help="the differential trial instead: each case read from a local S3 server and from disk",
    )
    args = parser.parse_args(argv)
    if args.s3:
        from fuzz.remote import run_remote

        found = run_remote(args.cases, args.seed, args.out, start=args.start, corpus=args.corpus)
        print(f"[fuzz --s3] {args.cases} cases, {found} disagreeing; saved under {args.out}")
        return 1 if found else 0
    start, cases = (args.only, 1) if args.only is not None else (args.start, args.cases)
    summary = run(
        cases,
        args.seed,
        args.out,
        start=start,
        fix_every=args.fix_every,
        timeout=args.timeout,
        rss_mib=args.rss_mib,
        fsize_mib=args.fsize_mib,
        corpus=args.corpus,
        keep=args.keep,
        hang_budget=args.hang_budget,
        progress=not args.quiet,
        verbose=args.only is not None,
    )
    print(format_summary(summary, args.out))
    if summary.interrupted:
        return 130
    return 1 if summary.findings else 0
