"""Time the pickle scan alone, the Python one beside the compiled one, on a large real pickle.

Builds, with ``torch.save``, a file of ``--params`` small tensors and an AdamW-like state dict for them (a step
and two moments each, name-keyed, and one param group listing every name), takes its ``data.pkl`` and scans it
``--repeat`` times with each, interleaved; prints the best seconds of each and their ratio:

    python scripts/scan_benchmark.py --params 100000

Absolute times drift on a shared machine; the ratio, measured side by side, holds.
"""

from __future__ import annotations

import argparse
import io
import time
import zipfile
from collections.abc import Callable

import torch

from optim_repair.formats import pickle_limits


def data_pkl(params: int) -> bytes:
    """The ``data.pkl`` of a ``torch.save`` of ``params`` tensors and their AdamW state."""
    names = [f"layers.{i // 8}.block{i % 8}.weight" for i in range(params)]
    model = {name: torch.zeros(4) for name in names}
    state = {
        name: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)} for name in names
    }
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "params": names}
    buffer = io.BytesIO()
    torch.save({"model": model, "optimizer": {"state": state, "param_groups": [group]}}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        (name,) = (name for name in archive.namelist() if name.endswith("/data.pkl"))
        return archive.read(name)


def seconds(scan: Callable[[bytes, int], tuple[int, bool]], data: bytes) -> float:
    start = time.perf_counter()
    assert scan(data, 0) == (len(data), False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    data = data_pkl(args.params)
    python, compiled = [], []
    for _ in range(args.repeat):
        python.append(seconds(pickle_limits.scan_python, data))
        compiled.append(seconds(pickle_limits.scan_compiled, data))
    print(f"data.pkl: {len(data) / 2**20:.1f} MiB, {args.params} parameters with AdamW state")
    slow, fast = min(python), min(compiled)
    print(f"pure-python: {slow:.4f} s   compiled: {fast:.4f} s   ratio: {slow / fast:.1f}x")


if __name__ == "__main__":
    main()
