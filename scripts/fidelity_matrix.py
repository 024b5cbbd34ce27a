"""Run the resume-fidelity matrix on the installed torch and write docs/fidelity.md.

For every lazily-initializing optimizer: train a tiny model whose second head gets no gradient,
save it the way trainers do, repair it with optim-repair (or not), resume through each loader,
train on with every parameter receiving gradients, and compare every parameter with a run that
never stopped (``torch.equal``). Nothing in docs/fidelity.md is typed by hand.

    python scripts/fidelity_matrix.py            # rewrite docs/fidelity.md
    python scripts/fidelity_matrix.py --check    # exit 1 if docs/fidelity.md is out of date
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import optim_repair
from optim_repair.errors import OptimRepairError

DOC = Path(__file__).resolve().parent.parent / "docs" / "fidelity.md"
STEPS_BEFORE = 3
STEPS_AFTER = 3

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "AdamW(amsgrad)": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "RMSprop(centered, momentum)": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, centered=True),
    "SGD(momentum)": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "SGD(momentum, dampening)": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.5),
    "SGD(nesterov)": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=1),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
}
if hasattr(torch.optim, "Muon"):  # new in torch 2.9
    OPTIMIZERS["Muon (matrices only)"] = lambda p: torch.optim.Muon([q for q in p if q.ndim == 2], lr=1e-2)

LOADERS = ("stock full_state_dict=True", "stock full_state_dict=False", "optim_repair", "optimizer.load_state_dict")
FILLS = ("none (sparse)", "fix --fill empty", "fix --fill fresh")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 2)
        self.unused = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_all: bool) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(x))
        out = self.head(hidden)
        return out + self.unused(hidden) if use_all else out


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _train(model: Net, optimizer: torch.optim.Optimizer, steps: int, *, use_all: bool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator)
        y = torch.randn(16, 2, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x, use_all), y).backward()
        optimizer.step()


@dataclass(frozen=True)
class Cell:
    loads: bool
    identical: bool
    note: str = ""

    def render(self) -> str:
        if self.note and not self.loads:
            return f"— {self.note}"
        if not self.loads:
            return "✗ fails to load"
        return "✓ bit-identical" if self.identical else "✗ diverges"


def _load(loader: str, model: Net, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    if loader == "optimizer.load_state_dict":
        optimizer.load_state_dict(state)
        return
    full = StateDictOptions(full_state_dict=loader.endswith("True") or loader == "optim_repair")
    load = optim_repair.set_optimizer_state_dict if loader == "optim_repair" else set_optimizer_state_dict
    load(model, optimizer, state, options=full)


def _cell(name: str, loader: str, fill: str, workdir: Path, reference: dict[str, torch.Tensor]) -> Cell:
    make = OPTIMIZERS[name]
    model = _model()
    optimizer = make(model.parameters())
    _train(model, optimizer, STEPS_BEFORE, use_all=False, seed=1)
    index_keyed = loader == "optimizer.load_state_dict"
    optim_state = optimizer.state_dict() if index_keyed else get_optimizer_state_dict(model, optimizer)
    original = workdir / "checkpoint.pt"
    torch.save({"policy_state_dict": model.state_dict(), "optimizer_state_dict": optim_state}, original)
    path = original
    if fill != FILLS[0]:
        path = workdir / "fixed.pt"
        try:
            optimizer_repair_fill = "empty" if fill.endswith("empty") else "fresh"
            optim_repair.fix(original, path, fill=optimizer_repair_fill, force=True)  # type: ignore[arg-type]
        except OptimRepairError:
            return Cell(False, False, "refused: index keys name no parameter shapes")
    saved = torch.load(path, weights_only=True)
    resumed = _model()
    resumed.load_state_dict(saved["policy_state_dict"])
    resumed_optimizer = make(resumed.parameters())
    try:
        _load(loader, resumed, resumed_optimizer, saved["optimizer_state_dict"])
    except (RuntimeError, KeyError, AssertionError, ValueError):
        return Cell(False, False)
    _train(resumed, resumed_optimizer, STEPS_AFTER, use_all=True, seed=2)
    identical = all(torch.equal(p, reference[n]) for n, p in resumed.state_dict().items())
    return Cell(True, identical)


def _reference(name: str) -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = OPTIMIZERS[name](model.parameters())
    _train(model, optimizer, STEPS_BEFORE, use_all=False, seed=1)
    _train(model, optimizer, STEPS_AFTER, use_all=True, seed=2)
    return dict(model.state_dict())


def run_matrix() -> Iterator[tuple[str, str, str, Cell]]:
    """Every (optimizer, loader, fill) cell, measured."""
    with tempfile.TemporaryDirectory(prefix="optim-repair-fidelity-") as tmp:
        for name in OPTIMIZERS:
            reference = _reference(name)
            for loader in LOADERS:
                for fill in FILLS:
                    yield name, loader, fill, _cell(name, loader, fill, Path(tmp), reference)


def render_markdown(cells: list[tuple[str, str, str, Cell]]) -> str:
    lines = [
        "# Resume fidelity: which loader and fill continue training bit-identically",
        "",
        f"Generated by `scripts/fidelity_matrix.py` on torch {torch.__version__} (CPU): do not edit by hand.",
        "",
        f"Each cell trains a tiny model for {STEPS_BEFORE} steps while one head gets no gradient (so the "
        "optimizer has no state for it), saves the optimizer (`get_optimizer_state_dict`, or "
        "`optimizer.state_dict()` for the `optimizer.load_state_dict` column), optionally repairs the file with "
        f"`optim_repair.fix`, resumes through the loader, trains {STEPS_AFTER} more steps with every parameter "
        "receiving gradients, and compares every parameter with a run that never stopped (`torch.equal`).",
        "",
        "- **stock full_state_dict=True/False**: `torch.distributed.checkpoint.state_dict.set_optimizer_state_dict` "
        "with `StateDictOptions(full_state_dict=...)`.",
        "- **optim_repair**: `optim_repair.set_optimizer_state_dict` (same signature; `full_state_dict=True`).",
        "- **fix --fill empty** adds `{}`; **fix --fill fresh** adds the exact state of a first step.",
        "",
    ]
    for fill in FILLS:
        lines += [f"## {fill}", "", "| optimizer | " + " | ".join(LOADERS) + " |", "|---|" + "---|" * len(LOADERS)]
        for name in OPTIMIZERS:
            row = [cell.render() for n, loader, f, cell in cells if n == name and f == fill]
            lines.append(f"| {name} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/fidelity.md is out of date")
    args = parser.parse_args()
    text = render_markdown(list(run_matrix()))
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is out of date: run python scripts/fidelity_matrix.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
