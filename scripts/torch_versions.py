"""Run the test suite and a write-fix-resume check under other torch versions, and print a summary.

Each argument is the Python of an environment that has another torch and the test extras (CI runs only the
pinned torch; this script is for people who change how checkpoints are read or written). Make each one with
``pip install torch==X.Y.Z <the test extras>`` and ``pip install --no-deps -e .`` (for the ``optim-repair``
command the README's resume script calls); tests whose libraries do not install on that torch skip. torchao
is built for one torch, and transformers imports it when it is installed: give an older torch the torchao
built for it (``pip install --no-deps torchao==0.13.0`` for torch 2.8), or transformers fails to import too. Then:

    python scripts/torch_versions.py /work/venv-torch24/bin/python /work/venv-torch215/bin/python

The check, run by that Python: a small model and AdamW train with one head unused, so its parameters have no
state; ``dcp.save`` writes the checkpoint; ``optim-repair fix --fill fresh`` repairs it; stock ``dcp.load`` and
``set_optimizer_state_dict`` resume from the copy, and training goes on. It passes when the parameters equal an
uninterrupted run's bit for bit and the copy's ``TensorProperties`` pickle as many fields as the original's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check() -> dict[str, object]:
    """The write-fix-resume check under the running Python's torch."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.ModuleDict({"body": nn.Linear(4, 4), "head": nn.Linear(4, 2)})

    def train(net: nn.Module, opt: torch.optim.Optimizer, steps: int, use_head: bool) -> None:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            out = torch.tanh(net["body"](x))
            (net["head"](out) if use_head else out).pow(2).mean().backward()
            opt.step()

    def fields(path: Path) -> set[int]:
        counts: set[int] = set()
        original = dcp_metadata.TensorProperties.__setstate__

        def record(self: object, state: tuple[object, ...]) -> None:
            counts.add(len(state))
            original(self, state)

        dcp_metadata.TensorProperties.__setstate__ = record
        try:
            with (path / ".metadata").open("rb") as stream:
                pickle.load(stream)
        finally:
            dcp_metadata.TensorProperties.__setstate__ = original
        return counts

    net = model(0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train(net, opt, 3, use_head=False)
    with tempfile.TemporaryDirectory() as tmp:
        saved, fixed = Path(tmp) / "checkpoint", Path(tmp) / "fixed"
        dcp.save({"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}, checkpoint_id=saved)
        command = [sys.executable, "-m", "optim_repair", "fix", str(saved), "--out", str(fixed), "--fill", "fresh"]
        repair = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if repair.returncode != 0:
            return {"ok": False, "fix_exit": repair.returncode, "fix_stderr": repair.stderr.strip()[-500:]}
        train(net, opt, 3, use_head=True)
        reference = {name: p.detach().clone() for name, p in net.named_parameters()}
        resumed = model(7)
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_opt)}
        dcp.load(state, checkpoint_id=fixed)
        set_model_state_dict(resumed, state["model"])
        set_optimizer_state_dict(resumed, resumed_opt, state["optim"])
        train(resumed, resumed_opt, 3, use_head=True)
        identical = all(torch.equal(p, reference[name]) for name, p in resumed.named_parameters())
        before, after = fields(saved), fields(fixed)
    return {
        "ok": identical and before == after,
        "identical": identical,
        "fields": sorted(before),
        "copy": sorted(after),
    }


def _summary_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


@dataclass
class Result:
    python: str
    torch: str
    resume: dict[str, object]
    suite: str
    suite_exit: int
    failed: list[str]

    @property
    def ok(self) -> bool:
        return self.suite_exit == 0 and self.resume.get("ok") is True


def run(python: str, pytest_args: list[str]) -> Result:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    version = subprocess.run(
        [python, "-c", "import importlib.metadata as m, torch; print(m.version('torch'), f'({torch.__version__})')"],
        capture_output=True,
        text=True,
        env=env,
    )
    resume = subprocess.run([python, __file__, "--check"], capture_output=True, text=True, env=env, cwd=ROOT)
    try:
        checked = json.loads(resume.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        checked = {"ok": False, "error": resume.stderr.strip()[-500:]}
    suite = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    failed = [line for line in suite.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    torch = version.stdout.strip() or f"? ({version.stderr.strip()[-200:]})"
    summary = _summary_line(suite.stdout if suite.stdout.strip() else suite.stderr)  # a conftest that fails to import
    return Result(python, torch, checked, summary, suite.returncode, failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("python", nargs="*", help="the Python of an environment with another torch")
    parser.add_argument("--check", action="store_true", help="run the write-fix-resume check here and print it")
    parser.add_argument("--pytest", default="", help="more pytest arguments, as one string")
    args = parser.parse_args()
    if args.check:
        print(json.dumps(check()))
        return 0
    results = []
    for python in args.python:
        result = run(python, args.pytest.split())
        results.append(result)
        print(f"torch {result.torch} at {result.python}")
        print(f"  write-fix-resume: {'pass' if result.resume.get('ok') else 'FAIL'} {json.dumps(result.resume)}")
        print(f"  test suite: {result.suite} (exit {result.suite_exit})")
        for line in result.failed:
            print(f"    {line}")
        sys.stdout.flush()
    return 0 if all(result.ok for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
