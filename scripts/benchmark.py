"""Measure optim-repair's speed and memory on a large synthetic checkpoint, against its baselines.

Builds a UniRL-style ``checkpoint.pt`` (model weights + name-keyed AdamW state, a few entries
missing) of about ``--gib`` GiB with ``--params`` parameters, and the same state as a DCP
directory, then times each command in a fresh process and records its peak RSS:

    python scripts/benchmark.py --gib 2 --params 1440

Page cache is warm after the first run of each input; numbers are wall-clock seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MISSING = 4


def build(root: Path, gib: float, params: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    per_param = int(gib * 2**30 / (3 * 4 * params))  # weight + exp_avg + exp_avg_sq, float32
    side = max(int(per_param**0.5), 1)
    weights, state = {}, {}
    for index in range(params):
        name = f"transformer_blocks.{index // 24}.attn.proj_{index % 24}.lora_A.weight"
        weights[name] = torch.randn(side, side)
        if index >= MISSING:
            state[name] = {
                "step": torch.tensor(10.0),
                "exp_avg": torch.randn(side, side),
                "exp_avg_sq": torch.rand(side, side),
            }
    groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True, "params": list(weights)}]
    directory = root / "checkpoint-100"
    directory.mkdir()
    torch.save({"policy_state_dict": weights, "optimizer_state_dict": {"state": state, "param_groups": groups},
                "step": 100}, directory / "checkpoint.pt")
    dcp_dir = root / "dcp-checkpoint-100"
    dcp.save({"model": weights, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=dcp_dir)


def measure(command: list[str]) -> tuple[float, float, int]:
    """Wall seconds, peak RSS in MiB, and exit code of one command in a fresh process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    return elapsed, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--params", type=int, default=1440)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--build-into", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_into:
        build(args.build_into, args.gib, args.params)
        return 0
    tool = [sys.executable, "-m", "optim_repair"]
    with tempfile.TemporaryDirectory(prefix="optim-repair-bench-", dir=args.workdir) as tmp:
        root = Path(tmp)
        # Built in a child process, so that no measured process inherits the builder's memory.
        builder = [sys.executable, __file__, "--gib", str(args.gib), "--params", str(args.params)]
        subprocess.run([*builder, "--build-into", str(root)], check=True)
        checkpoint, dcp_dir = root / "checkpoint-100", root / "dcp-checkpoint-100"
        size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
        rows = [
            ("python -c 'import torch'", [sys.executable, "-c", "import torch"]),
            ("cp -r (torch file)", ["cp", "-r", str(checkpoint), str(root / "copied")]),
            ("inspect (torch file)", [*tool, "inspect", str(checkpoint)]),
            ("fix --fill empty (torch file)", [*tool, "fix", str(checkpoint), "--out", str(root / "fixed-empty")]),
            ("fix --fill fresh (torch file)",
             [*tool, "fix", str(checkpoint), "--out", str(root / "fixed-fresh"), "--fill", "fresh"]),
            ("cp -r (DCP)", ["cp", "-r", str(dcp_dir), str(root / "dcp-copied")]),
            ("inspect (DCP)", [*tool, "inspect", str(dcp_dir)]),
            ("fix (DCP)", [*tool, "fix", str(dcp_dir), "--out", str(root / "dcp-fixed")]),
        ]
        print(f"checkpoint: {size / 2**30:.2f} GiB, {args.params} params, {MISSING} missing; "
              f"python {sys.version.split()[0]}\n")
        print("| command | seconds | peak RSS (MiB) | exit |\n|---|---|---|---|")
        for label, command in rows:
            elapsed, rss, code = measure(command)
            print(f"| {label} | {elapsed:.2f} | {rss:.0f} | {code} |")
        shutil.rmtree(root / "copied", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
