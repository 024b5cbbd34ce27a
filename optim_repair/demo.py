"""The whole story on an embedded example: a real run whose unused head never gets a gradient.

A tiny model is trained with AdamW while one head's output is discarded, saved the way UniRL
saves (``checkpoint-<step>/checkpoint.pt``), and then: torch's stock loader refuses it, inspect
finds the missing entries, fix writes verified copies, and training resumes from them through
torch's stock ``set_optimizer_state_dict`` (and optim-repair's lazy one) and is compared with a
run that never stopped.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optim_repair import api
from optim_repair.decisions.diagnose import Diagnosis
from optim_repair.errors import UsageError

STEPS_BEFORE = 3
STEPS_AFTER = 3


@dataclass(frozen=True)
class ResumeOutcome:
    """How training continued from one repaired copy through torch's stock loader."""

    fill: str
    loader: str
    loaded: bool
    identical: bool
    max_difference: float


@dataclass(frozen=True)
class DemoReport:
    checkpoint: Path
    stock_error: str
    diagnosis: Diagnosis
    fixes: tuple[api.FixResult, ...]
    outcomes: tuple[ResumeOutcome, ...]


def _model() -> Any:
    import torch

    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = torch.nn.Linear(8, 16)
            self.head = torch.nn.Linear(16, 4)
            self.aux_head = torch.nn.Linear(16, 4)

        def forward(self, x: Any, use_aux: bool) -> Any:
            hidden = torch.relu(self.trunk(x))
            out = self.head(hidden)
            aux = self.aux_head(hidden)  # computed, and discarded until use_aux
            return out + aux if use_aux else out

    torch.manual_seed(0)
    return TwoHeads()


def _train(model: Any, optimizer: Any, steps: int, *, use_aux: bool, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=generator)
        target = torch.randn(32, 4, generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x, use_aux), target)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()


def _optimizer(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_like_unirl(root: Path) -> Path:
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _model()
    optimizer = _optimizer(model)
    _train(model, optimizer, STEPS_BEFORE, use_aux=False, seed=1)
    directory = root / f"checkpoint-{STEPS_BEFORE}"
    directory.mkdir()
    torch.save(
        {
            "policy_state_dict": model.state_dict(),
            "optimizer_state_dict": get_optimizer_state_dict(model, optimizer),
            "optimizer_step_count": STEPS_BEFORE,
            "step": STEPS_BEFORE,
            "save_mode": "full",
        },
        directory / "checkpoint.pt",
    )
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": STEPS_BEFORE}))
    return directory


STOCK = "torch (stock)"
LAZY = "optim_repair"


def _load(checkpoint: Path, loader: str = STOCK) -> Any:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from optim_repair.torch_loader import set_optimizer_state_dict as lazy_set_optimizer_state_dict

    saved = torch.load(checkpoint / "checkpoint.pt", weights_only=True)
    model = _model()
    model.load_state_dict(saved["policy_state_dict"])
    optimizer = _optimizer(model)
    load = set_optimizer_state_dict if loader == STOCK else lazy_set_optimizer_state_dict
    load(model, optimizer, saved["optimizer_state_dict"], options=StateDictOptions(full_state_dict=True))
    return model, optimizer


def _stock_error(checkpoint: Path) -> str:
    try:
        _load(checkpoint)
    except (RuntimeError, KeyError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def _resume(fixed: Path, fill: str, loader: str, reference: dict[str, Any]) -> ResumeOutcome:
    model, optimizer = _load(fixed, loader)
    _train(model, optimizer, STEPS_AFTER, use_aux=True, seed=2)
    differences = [(p - reference[n]).abs().max().item() for n, p in model.state_dict().items()]
    identical = all(bool((p == reference[n]).all()) for n, p in model.state_dict().items())
    return ResumeOutcome(fill, loader, True, identical, max(differences))


def _uninterrupted() -> dict[str, Any]:
    model = _model()
    optimizer = _optimizer(model)
    _train(model, optimizer, STEPS_BEFORE, use_aux=False, seed=1)
    _train(model, optimizer, STEPS_AFTER, use_aux=True, seed=2)
    return dict(model.state_dict())


def run_demo(*, keep: bool = False, progress: Callable[[str], None] = lambda message: None) -> DemoReport:
    """Run the demo in a new temporary directory, removed afterwards unless ``keep``. Raises ``UsageError``
    without torch, which the demo trains with (inspect and fix need none)."""
    try:
        import torch  # noqa: F401  # the demo's first need, asked for before anything is made
    except ImportError:
        raise UsageError(
            "the demo trains a model with torch, which is not installed here: pip install torch "
            "(inspect and fix need no torch)"
        ) from None
    workdir = Path(tempfile.mkdtemp(prefix="optim-repair-demo-"))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch's, irrelevant here
            return _run_in(workdir, progress)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _run_in(workdir: Path, progress: Callable[[str], None]) -> DemoReport:
    progress(f"training a tiny model in {workdir} ({STEPS_BEFORE} AdamW steps, aux_head unused)")
    checkpoint = _save_like_unirl(workdir)
    stock_error = _stock_error(checkpoint)
    diagnosis = api.inspect(checkpoint)
    fixes = tuple(api.fix(checkpoint, workdir / f"{checkpoint.name}-{fill}", fill=fill) for fill in ("empty", "fresh"))
    progress(f"resuming each copy for {STEPS_AFTER} steps, and training a run that never stopped")
    reference = _uninterrupted()
    empty, fresh = fixes
    outcomes = (
        _resume(Path(empty.out), "empty", STOCK, reference),
        _resume(Path(empty.out), "empty", LAZY, reference),
        _resume(Path(fresh.out), "fresh", STOCK, reference),
    )
    return DemoReport(checkpoint, stock_error, diagnosis, fixes, outcomes)
