"""Run the test suite and a write-fix-resume check under other torch versions, and print a summary.

Each argument is the Python of an environment that has another torch and the test extras (CI runs only the
pinned torch; this script is for people who change how checkpoints are read or written). Make each one with
``pip install torch==X.Y.Z <the test extras>`` and ``pip install --no-deps -e .`` (for the ``optim-repair``
command the README's resume script calls); tests whose libraries do not install on that torch skip. torchao
is built for one torch, and transformers imports it when it is installed: give an older torch the torchao
built for it (``pip install --no-deps torchao==0.13.0`` for torch 2.8), or transformers fails to import too. Then:

    python scripts/torch_versions.py /work/venv-torch24/bin/python /work/venv-torch215/bin/python

The check, run by that Python: a small model and AdamW train with one head unused, so its parameters have no
state; ``dcp.save`` writes the checkpoint; ``optim-repair fix`` repairs it; stock ``dcp.load`` and
``set_optimizer_state_dict`` resume from the copy, and training goes on. It passes when the parameters equal an
uninterrupted run's bit for bit and the copy's ``TensorProperties`` pickle as many fields as the original's.

Then the same across torches, for every ordered pair of the Pythons given: saved under one torch, fixed by the
other's optim-repair (for its own torch) and resumed under it, which must reach the writer's uninterrupted run bit
for bit: a copy of torch 2.15's ``.metadata`` that an older torch reads, and one of torch 2.4's that a torch from
2.8 on loads (its AdamW groups lack ``decoupled_weight_decay``). ``--no-suite`` runs the checks alone.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.ModuleDict({"body": nn.Linear(4, 4), "head": nn.Linear(4, 2)})


def _train(net: Any, opt: Any, steps: int, use_head: bool) -> None:
    import torch

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = torch.tanh(net["body"](x))
        (net["head"](out) if use_head else out).pow(2).mean().backward()
        opt.step()


def _fields(path: Path) -> list[int]:
    """How many fields each ``TensorProperties`` of the ``.metadata`` at ``path`` pickles, as a list of the
    counts seen; read with a stand-in class, so that a torch reads a form newer than its own."""
    import pickle

    counts: set[int] = set()

    class Counting(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if name == "TensorProperties":
                return _Properties
            return super().find_class(module, name)

    class _Properties:
        def __setstate__(self, state: tuple[object, ...]) -> None:
            counts.add(len(state))

    with (path / ".metadata").open("rb") as stream:
        Counting(stream).load()
    return sorted(counts)


def save(path: Path) -> None:
    """Train with one head unused, ``dcp.save`` the model and AdamW to ``path``, then train on with the head and
    ``torch.save`` the parameters reached to ``path``'s sibling ``reference.pt``: what a resume must reach."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    net = _model(0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _train(net, opt, 3, use_head=False)
    dcp.save({"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}, checkpoint_id=path)
    _train(net, opt, 3, use_head=True)
    torch.save({name: p.detach().clone() for name, p in net.named_parameters()}, path.parent / "reference.pt")


def resume(path: Path) -> dict[str, object]:
    """Resume from the repaired copy at ``path`` with stock ``dcp.load`` and ``set_optimizer_state_dict``, train on,
    and compare with ``reference.pt`` beside it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    resumed = _model(7)
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, opt)}
    try:
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(resumed, state["model"])
        set_optimizer_state_dict(resumed, opt, state["optim"])
    except Exception as exc:  # what the stock loader says, reported
        return {"ok": False, "load": f"{type(exc).__name__}: {str(exc)[:300]}"}
    _train(resumed, opt, 3, use_head=True)
    reference = torch.load(path.parent / "reference.pt", weights_only=True)
    differing = sorted(name for name, p in resumed.named_parameters() if not torch.equal(p, reference[name]))
    return {"ok": not differing, "identical": not differing, "differing": differing}


def _fix(python: str, saved: Path, fixed: Path) -> subprocess.CompletedProcess[str]:
    """``optim-repair fix`` of ``python``'s environment, for its own torch (the default ``--for-torch``)."""
    command = [python, "-m", "optim_repair", "fix", str(saved), "--out", str(fixed)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=_environment())


def check() -> dict[str, object]:
    """The write-fix-resume check under the running Python's torch: the copy keeps the original's form."""
    with tempfile.TemporaryDirectory() as tmp:
        saved, fixed = Path(tmp) / "checkpoint", Path(tmp) / "fixed"
        save(saved)
        repair = _fix(sys.executable, saved, fixed)
        if repair.returncode != 0:
            return {"ok": False, "fix_exit": repair.returncode, "fix_stderr": repair.stderr.strip()[-500:]}
        resumed = resume(fixed)
        before, after = _fields(saved), _fields(fixed)
    return {**resumed, "ok": resumed["ok"] is True and before == after, "fields": before, "copy": after}


def across(writer: str, loader: str) -> dict[str, object]:
    """Saved under ``writer``'s torch, fixed by ``loader``'s optim-repair for its torch, resumed under ``loader``'s:
    the copy is in the form that torch reads (2.15's ``strides`` dropped for an older one; the param-group options
    a newer one asks for added), and the resume reaches the writer's uninterrupted run."""
    with tempfile.TemporaryDirectory() as tmp:
        saved, fixed = Path(tmp) / "checkpoint", Path(tmp) / "fixed"
        written = _phase(writer, "--save", saved)
        if written.returncode != 0:
            return {"ok": False, "save": written.stderr.strip()[-500:]}
        repair = _fix(loader, saved, fixed)
        if repair.returncode != 0:
            return {"ok": False, "fix_exit": repair.returncode, "fix_stderr": repair.stderr.strip()[-500:]}
        resumed = _phase(loader, "--resume", fixed)
        try:
            result: dict[str, object] = json.loads(resumed.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            result = {"ok": False, "error": resumed.stderr.strip()[-500:]}
        return {**result, "fields": _fields(saved), "copy": _fields(fixed)}


def _phase(python: str, flag: str, path: Path) -> subprocess.CompletedProcess[str]:
    command = [python, __file__, flag, str(path)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=_environment())


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


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


def run(python: str, pytest_args: list[str], *, suite: bool = True) -> Result:
    env = _environment()
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
    torch = version.stdout.strip() or f"? ({version.stderr.strip()[-200:]})"
    if not suite:
        return Result(python, torch, checked, "not run", 0, [])
    tests = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    failed = [line for line in tests.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    summary = _summary_line(tests.stdout if tests.stdout.strip() else tests.stderr)  # a conftest that fails to import
    return Result(python, torch, checked, summary, tests.returncode, failed)


def _release(python: str) -> str:
    found = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('torch'))"], capture_output=True, text=True
    )
    return found.stdout.strip() or "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("python", nargs="*", help="the Python of an environment with another torch")
    parser.add_argument("--check", action="store_true", help="run the write-fix-resume check here and print it")
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--resume", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pytest", default="", help="more pytest arguments, as one string")
    parser.add_argument("--no-suite", action="store_true", help="the checks alone, without the test suite")
    args = parser.parse_args()
    if args.check:
        print(json.dumps(check()))
        return 0
    if args.save:
        save(args.save)
        return 0
    if args.resume:
        print(json.dumps(resume(args.resume)))
        return 0
    results = []
    for python in args.python:
        result = run(python, args.pytest.split(), suite=not args.no_suite)
        results.append(result)
        print(f"torch {result.torch} at {result.python}")
        print(f"  write-fix-resume: {'pass' if result.resume.get('ok') else 'FAIL'} {json.dumps(result.resume)}")
        if not args.no_suite:
            print(f"  test suite: {result.suite} (exit {result.suite_exit})")
        for line in result.failed:
            print(f"    {line}")
        sys.stdout.flush()
    crossed = True
    for writer in args.python:
        for loader in args.python:
            if writer != loader:
                checked = across(writer, loader)
                crossed = crossed and checked.get("ok") is True
                verdict = "pass" if checked.get("ok") is True else "FAIL"
                print(f"saved by torch {_release(writer)}, fixed and resumed by torch {_release(loader)}: {verdict}")
                print(f"  {json.dumps(checked)}")
                sys.stdout.flush()
    return 0 if crossed and all(result.ok for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
