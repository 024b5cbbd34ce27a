"""Measure optim-repair's speed and memory side by side with its yardsticks, on checkpoints built for it.

Builds a UniRL-style ``checkpoint.pt`` (model weights + name-keyed AdamW state, a few entries missing)
of about ``--gib`` GiB with ``--params`` parameters, the same state as a DCP directory, a mixture-of-experts
checkpoint of each count of small parameters in ``--moe-params`` (3% without state), a DCP checkpoint of
each count of chunks in ``--chunks`` (``tests.factories.chunked``: one per rank per tensor), and two steps of one
parameter whose 64 MiB moment differs everywhere (for ``diff``). Each command runs
``--repeat`` times in a fresh process, interleaved with its yardstick, on a warm page cache; the table
gives the median seconds, the peak RSS, and the ratio to the yardstick next to the goal:

    python scripts/benchmark.py --gib 2 --params 1440 --moe-params 30000,300000 --chunks 1000000,5000000

With ``--s3``, ``--gcs`` and ``--azure``, the torch file and the DCP directory are also put in a store on 127.0.0.1
(moto's server mode; fake-gcs-server and Azurite, as the tests start them), and inspect and fix there are measured
beside a download of the same objects with the store's own client, with a second table of the requests and bytes
each made
(``benchmark_stores.py``).

Absolute times drift on a shared machine; ratios measured side by side hold.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark_stores import print_traffic, remote_pairs

MISSING = 4
NAIVE = """
import sys, torch
checkpoint = torch.load(sys.argv[1], map_location="cpu", mmap=True, weights_only=True)
optimizer = checkpoint[sys.argv[3]]
for group in optimizer["param_groups"]:
    for name in group["params"]:
        optimizer["state"].setdefault(name, {})
torch.save(checkpoint, sys.argv[2])
"""
"""The script optim-repair replaces: load with mmap, add {} for every missing entry, save (no verification)."""
LOAD = """
import sys, torch
checkpoint = torch.load(sys.argv[1], map_location="cpu", mmap=True, weights_only=True)
optimizer = checkpoint[sys.argv[3]]
missing = {name for group in optimizer["param_groups"] for name in group["params"]} - set(optimizer["state"])
"""
"""What a user would script to find parameters without state: load with mmap, a set difference."""
READ_METADATA = """
import sys, time
from torch.distributed.checkpoint import FileSystemReader
start = time.perf_counter()
keys = set(FileSystemReader(sys.argv[1]).read_metadata().state_dict_metadata)
model = {key[len("model."):] for key in keys if key.startswith("model.")}
state = {key[len("optim.state."):].rsplit(".", 1)[0] for key in keys if key.startswith("optim.state.")}
missing = sorted(model - state)
print(f"elapsed={time.perf_counter() - start}", file=sys.stderr)
"""
"""What a user would script to find DCP parameters without state: torch reads the metadata, a set difference;
it times itself, so that torch's import is not counted."""
COMPARE = """
import sys, time, torch
start = time.perf_counter()
a, b = (torch.load(path, mmap=True, weights_only=True)["optimizer"]["state"][0]["exp_avg"] for path in sys.argv[1:])
differing = int(a.view(torch.int32).ne(b.view(torch.int32)).sum())
largest = float((a.double() - b.double()).abs().max())
print(f"elapsed={time.perf_counter() - start}", file=sys.stderr)
"""
"""What a user would script to say how two moments differ: torch loads both, counts the elements that differ
and takes the largest difference; it times itself, so that torch's import is not counted."""
MOMENTS = 16 << 20
"""Elements of each moment of the two steps ``diff`` compares where they differ everywhere (64 MiB, float32)."""


def build(root: Path, gib: float, params: int, moe_params: list[int]) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    per_param = int(gib * 2**30 / (3 * 4 * params))  # weight + exp_avg + exp_avg_sq, float32
    side = max(int(per_param**0.5), 1)
    weights, state = {}, {}
    for index in range(params):
        name = f"transformer_blocks.{index // 24}.attn.proj_{index % 24}.lora_A.weight"
        weights[name] = torch.randn(side, side)
        if index >= MISSING:
            state[name] = {"step": torch.tensor(10.0), "exp_avg": torch.randn(side, side),
                           "exp_avg_sq": torch.rand(side, side)}  # fmt: skip
    groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True, "params": list(weights)}]  # fmt: skip
    (root / "checkpoint-100").mkdir()
    torch.save({"policy_state_dict": weights, "optimizer_state_dict": {"state": state, "param_groups": groups},
                "step": 100}, root / "checkpoint-100" / "checkpoint.pt")  # fmt: skip
    dcp.save({"model": weights, "optim": {"state": state, "param_groups": groups}},
             checkpoint_id=root / "dcp-checkpoint-100")  # fmt: skip
    for count in moe_params:
        experts, moe_state = {}, {}
        for index in range(count):
            name = (
                f"layers.{index // 384}.mlp.experts.{index // 3 % 128}.{('gate', 'up', 'down')[index % 3]}_proj.weight"
            )
            experts[name] = torch.zeros(4, 4)
            if index % 33:  # about 3% of the experts got no tokens
                moe_state[name] = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(4, 4),
                                   "exp_avg_sq": torch.zeros(4, 4)}  # fmt: skip
        moe_groups = [{**groups[0], "params": list(experts)}]
        optimizer = {"state": moe_state, "param_groups": moe_groups}
        torch.save({"model": experts, "optimizer": optimizer}, root / f"moe-{count}.pt")
    generator = torch.Generator().manual_seed(0)
    for step in ("a", "b"):  # two steps of one parameter: its moment differs everywhere
        moment = {"step": torch.tensor(10.0), "exp_avg": torch.randn(MOMENTS, generator=generator)}
        optimizer = {"state": {0: moment}, "param_groups": [{**groups[0], "params": [0]}]}
        torch.save({"optimizer": optimizer}, root / f"moments-{step}.pt")


def params_for(chunks: int, ranks: int) -> int:
    """How many parameters make about ``chunks`` chunks on ``ranks`` ranks (``tests.factories.chunked``)."""
    from tests.factories.chunked import chunk_count

    params = max(chunks // (3 * ranks), 1)
    while chunk_count(ranks, params) < chunks:
        params += 1
    return params


def measure(command: list[str]) -> tuple[float, float, int]:
    """Wall seconds, peak RSS in MiB, and exit code of one command in a fresh process; a command that prints
    ``elapsed=SECONDS`` last on stderr is taken at its word (its imports not counted)."""
    with tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)
        elapsed = time.perf_counter() - start
        stderr.seek(0)
        lines = stderr.read().strip().splitlines()
    if lines and lines[-1].startswith("elapsed="):
        elapsed = float(lines[-1].removeprefix("elapsed="))
    return elapsed, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def shell(script: str) -> list[str]:
    return ["sh", "-c", script]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--params", type=int, default=1440)
    parser.add_argument(
        "--moe-params",
        default="30000",
        help="mixture-of-experts checkpoints of this many parameters, comma-separated (30000,300000)",
    )
    parser.add_argument(
        "--chunks",
        default="",
        help="DCP checkpoints of this many chunks too, comma-separated (1000000,5000000), one per rank per tensor",
    )
    parser.add_argument("--s3", action="store_true", help="also measure s3:// inspect and fix (a local S3 server)")
    parser.add_argument("--gcs", action="store_true", help="also measure gs:// inspect and fix (a local GCS emulator)")
    parser.add_argument("--azure", action="store_true", help="also measure az:// inspect and fix (Azurite)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--only", default="", help="measure only the rows whose command label contains this")
    parser.add_argument("--build-into", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--build-chunks", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_into and args.build_chunks:
        # Only the builder imports torch and the checkout's factories: a measured process forked from a
        # parent holding torch would count its pages in its peak RSS.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.factories.chunked import build_chunked

        ranks = 256 if args.build_chunks <= 2_000_000 else 512
        build_chunked(args.build_into, ranks, params_for(args.build_chunks, ranks))
        return 0
    moe_counts = [int(text) for text in args.moe_params.split(",") if text]
    if args.build_into:
        build(args.build_into, args.gib, args.params, moe_counts)
        return 0
    # Measured as installed: pip compiles a package's bytecode as it installs it (a checkout run with
    # PYTHONDONTWRITEBYTECODE would compile every module on every start instead).
    package = Path(__file__).resolve().parents[1] / "optim_repair"
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True)
    tool = [sys.executable, "-m", "optim_repair"]
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="optim-repair-bench-", dir=args.workdir) as tmp:
        root = Path(tmp)
        # Built in a child process, so that no measured process inherits the builder's memory.
        builder = [python, __file__, "--gib", str(args.gib), "--params", str(args.params)]
        subprocess.run([*builder, "--moe-params", args.moe_params, "--build-into", str(root)], check=True)
        torch_file = root / "checkpoint-100" / "checkpoint.pt"
        dcp_dir = root / "dcp-checkpoint-100"
        out = root / "out"
        # (label, command, yardstick label, yardstick command, goal: at most this ratio)
        pairs = [
            (
                "inspect (torch file)",
                [*tool, "inspect", torch_file],
                "import torch",
                [python, "-c", "import torch"],
                1.0,
            ),
            (
                "fix --no-sync (torch file)",
                [*tool, "fix", torch_file, "--out", out, "--no-sync"],
                "cp && cmp",
                shell(f"cp {torch_file} {out} && cmp {torch_file} {out}"),
                1.0,
            ),
            (
                "fix (torch file, synced)",
                [*tool, "fix", torch_file, "--out", out],
                "cp && sync && cmp",
                shell(f"cp {torch_file} {out} && sync {out} && cmp {torch_file} {out}"),
                1.1,
            ),
            (
                "inspect (torch file)",
                [*tool, "inspect", torch_file],
                "torch.load(mmap) + set difference",
                [python, "-c", LOAD, torch_file, out, "optimizer_state_dict"],
                0.1,
            ),
            (
                "fix --no-sync (torch file)",
                [*tool, "fix", torch_file, "--out", out, "--no-sync"],
                "naive torch script",
                [python, "-c", NAIVE, torch_file, out, "optimizer_state_dict"],
                0.35,
            ),
            (
                "fix --no-sync (DCP)",
                [*tool, "fix", dcp_dir, "--out", out, "--no-sync"],
                "cp -r && diff -r",
                shell(f"cp -r {dcp_dir} {out} && diff -r {dcp_dir} {out}"),
                1.5,
            ),
            (
                "fix --link --no-sync (DCP)",
                [*tool, "fix", dcp_dir, "--out", out, "--link", "--no-sync"],
                "inspect (DCP)",
                [*tool, "inspect", dcp_dir],
                3.0,
            ),
        ]
        twin = root / "twin.pt"
        shutil.copyfile(torch_file, twin)
        pairs += [
            (
                "diff (torch file, its copy)",
                [*tool, "diff", torch_file, twin],
                "cmp",
                ["cmp", torch_file, twin],
                1.2,
            ),
            (
                "diff (two 64 MiB moments that differ everywhere)",
                [*tool, "diff", root / "moments-a.pt", root / "moments-b.pt"],
                "torch.load + count + largest",
                [python, "-c", COMPARE, root / "moments-a.pt", root / "moments-b.pt"],
                None,
            ),
            (
                "diff (two 64 MiB moments that differ everywhere)",
                [*tool, "diff", root / "moments-a.pt", root / "moments-b.pt"],
                "cat (both files read)",
                shell(f"cat {root / 'moments-a.pt'} {root / 'moments-b.pt'} > /dev/null"),
                None,
            ),
            (
                "diff --metadata-only (torch file, its copy)",
                [*tool, "diff", torch_file, twin, "--metadata-only"],
                "inspect (torch file)",
                [*tool, "inspect", torch_file],
                2.0,
            ),
        ]
        for count in moe_counts:
            moe = root / f"moe-{count}.pt"
            pairs += [
                (
                    f"inspect (MoE, {count:,} params)",
                    [*tool, "inspect", moe],
                    "torch.load(mmap) + set difference",
                    [python, "-c", LOAD, moe, out, "optimizer"],
                    0.1,
                ),
                (
                    f"fix --no-sync (MoE, {count:,} params)",
                    [*tool, "fix", moe, "--out", out, "--no-sync"],
                    "torch.load(mmap) script",
                    [python, "-c", NAIVE, moe, out, "optimizer"],
                    0.35,
                ),
            ]
        for count in (int(text) for text in args.chunks.split(",") if text):
            chunked = root / f"chunks-{count}"
            subprocess.run([python, __file__, "--build-chunks", str(count), "--build-into", str(chunked)], check=True)
            pairs += [
                (
                    f"inspect (DCP, {count:,} chunks)",
                    [*tool, "inspect", chunked],
                    "read_metadata + set difference",
                    [python, "-c", READ_METADATA, chunked],
                    0.25,
                ),
                (
                    f"fix --link --no-sync (DCP, {count:,} chunks)",
                    [*tool, "fix", chunked, "--out", out, "--link", "--no-sync"],
                    "inspect (DCP)",
                    [*tool, "inspect", chunked],
                    2.0,
                ),
            ]
        # The scale rows again on the Python pickle scan (OPTIM_REPAIR_PURE_PYTHON=1), beside the same yardstick.
        pure = ["env", "OPTIM_REPAIR_PURE_PYTHON=1", *tool]
        scaled = [pair for pair in pairs if pair[0].startswith("inspect (") or "MoE" in pair[0] or "chunks)" in pair[0]]
        pairs += [
            (f"{label} [pure Python scan]", [*pure, *command[len(tool) :]], yard_label, yard_command, None)
            for label, command, yard_label, yard_command, _ in scaled
        ]
        stores = [store for store, wanted in (("s3", args.s3), ("gcs", args.gcs), ("azure", args.azure)) if wanted]
        remote = [row for store in stores for row in remote_pairs(store, torch_file, dcp_dir, tool)]
        pairs += [
            (label, command, yard_label, yard_command, None) for label, command, yard_label, yard_command, _ in remote
        ]
        size = torch_file.stat().st_size
        print(
            f"checkpoint: {size / 2**30:.2f} GiB, {args.params} params, {MISSING} missing; MoE: "
            f"{args.moe_params} params; chunks: {args.chunks or '-'}; medians of {args.repeat}; "
            f"python {sys.version.split()[0]}\n"
        )
        print("| command | s | peak RSS MiB | yardstick | s | ratio | goal |\n|---|---|---|---|---|---|---|")
        for label, command, yard_label, yard_command, goal in (p for p in pairs if args.only in p[0]):
            mine, theirs = [], []
            for _ in range(args.repeat):
                for runs, argv in ((mine, command), (theirs, yard_command)):
                    shutil.rmtree(out, ignore_errors=True)
                    out.unlink(missing_ok=True)
                    runs.append(measure([str(part) for part in argv]))
            seconds, yard = statistics.median(r[0] for r in mine), statistics.median(r[0] for r in theirs)
            ratio = seconds / yard
            verdict = "—" if goal is None else f"≤ {goal}x {'✓' if ratio <= goal else '✗'}"
            codes = {r[2] for r in mine} - {0, 1}
            flag = f" (exit {sorted(codes)})" if codes else ""
            print(
                f"| {label}{flag} | {seconds:.2f} | {max(r[1] for r in mine):.0f} | {yard_label} | {yard:.2f} "
                f"| {ratio:.2f}x | {verdict} |"
            )
        if remote:
            print_traffic(remote, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
