"""A mutation fuzzer for optim-repair's readers and writer: real checkpoints, mutated, run in a supervised worker.

Builds real seed checkpoints once (``fuzz.seeds``: zip and legacy torch files, name- and
index-keyed optimizers, DCP directories, whole checkpoint directories), then derives each case's
mutated input from ``(seed, case index)`` alone: byte flips, truncation, splicing, pickle opcode edits
(extreme lengths and memo indices, deep nesting, memo "billion laughs"), zip header and member edits,
DCP ``.metadata`` edits, and links, FIFOs and loops in place of files. A long-lived worker, forked
from a forkserver that has torch and optim_repair loaded, runs ``optim_repair.inspect`` on each case
(and every ``--fix-every``'th case ``optim_repair.fix``, three in ten of them with model operations,
some with ``dereference``) under resource limits and an audit hook that records every file touched
outside the case's input and output directories; after every successful fix, torch's own loaders read
the original and the copy (``fuzz.oracle``):

    python scripts/fuzz --cases 20000 --seed 0 --out /tmp/fuzz-findings

A case ends ``ok``, ``error-<exit code>`` (an ``OptimRepairError`` with a one-line message), or in
findings: any other exception, a multi-line message, a signal, a hang, a memory blowup, a file outside
the input read or written, the input changed, output left behind by a failed fix, a fix of what torch
refuses, a copy torch refuses, a copy whose values torch reads differently, an inspection of a DCP
``.metadata`` (read summarized) that reading it whole contradicts. Each finding is
saved under ``--out`` (the mutated input and a ``case.json``); ``--only INDEX`` replays one case,
``--corpus DIR`` keeps the seeds so that cases replay bit for bit in a later run. Exit status 0 without
findings, 1 with. ``run()`` is the same, importable, for a fast slice in a test.
"""

from fuzz.findings import format_summary
from fuzz.runner import run

__all__ = ["format_summary", "run"]
