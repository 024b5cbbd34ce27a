"""FSDP checkpoints written and resumed by two real ranks: ``torch.multiprocessing`` and gloo on CPU.

A ``Net`` trains ``PRE_STEPS`` steps in which ``head`` gets no gradient, so AdamW has no state for it, and is
saved; the same run then trains ``POST_STEPS`` steps with every parameter, and its parameters are kept as the
uninterrupted reference. ``save`` writes, in one spawn:

* ``fsdp1/``: FSDP1 (``FullyShardedDataParallel``, FULL_STATE_DICT, its default ``use_orig_params=False``, on
  CPU with ``device_id``): rank 0 saves ``FSDP.optim_state_dict`` as ``optimizer.pt`` and the model as
  ``model.pt``, both with ``torch.save``.
* ``verl/``: verl's FSDP2 per-rank files: ``fully_shard``, then each rank ``torch.save``s ``model.state_dict()``
  as ``model_world_size_2_rank_R.pt`` and ``optimizer.state_dict()`` as ``optim_world_size_2_rank_R.pt``: DTensor
  state under index keys.
* ``sharded/``: each rank's ``get_optimizer_state_dict`` (sharded DTensor state under names), saved per rank.
* ``dcp/``: the same state through ``get_state_dict`` and ``dcp.save`` on both ranks, its plans gathered by DCP.

``resume`` loads each checkpoint as its trainer does, in one spawn: FSDP1 through ``FSDP.optim_state_dict_to_load``,
verl through ``model.load_state_dict`` and ``optimizer.load_state_dict`` per rank, then trains ``POST_STEPS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.optim import AdamW, Optimizer

PRE_STEPS = 3
POST_STEPS = 3
WORLD = 2
HEAD = ("head.weight", "head.bias")
"""The parameters without state in every checkpoint here."""
VERL_HEAD = (2, 3)
"""The same, as verl's index keys give them."""


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.body = nn.Linear(4, 6)
            self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor, use_all: bool = False) -> Tensor:
        y: Tensor = self.body(x)
        return self.head(y) if use_all else y


def _train(model: nn.Module, opt: Optimizer, rank: int, steps: int, *, use_all: bool) -> None:
    generator = torch.Generator().manual_seed(100 * rank + (1 if use_all else 0))
    for _ in range(steps):
        model(torch.randn(2, 4, generator=generator), use_all).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _fsdp1(seed: int) -> tuple[nn.Module, Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    cpu = torch.device("cpu")
    net = Net(seed)
    net.head = FSDP(net.head, device_id=cpu)  # its own unit: its flat parameter gets no gradient
    model = FSDP(net, device_id=cpu)
    return model, AdamW(model.parameters(), lr=0.01)


def _fsdp2(seed: int) -> tuple[nn.Module, Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = Net(seed)
    fully_shard(model)
    return model, AdamW(model.parameters(), lr=0.01)


def _local(model: nn.Module) -> dict[str, Tensor]:
    return {name: getattr(value, "_local_tensor", value).detach().clone() for name, value in model.state_dict().items()}


def _verl_name(kind: str, rank: int) -> str:
    return f"{kind}_world_size_{WORLD}_rank_{rank}.pt"


def _save(rank: int, root: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo", init_method=f"file://{root}/save.store", rank=rank, world_size=WORLD)
    try:
        model, opt = _fsdp1(0)
        _train(model, opt, rank, PRE_STEPS, use_all=False)
        optimizer_state, weights = FSDP.optim_state_dict(model, opt), model.state_dict()
        if rank == 0:
            (root / "fsdp1").mkdir()
            torch.save(optimizer_state, root / "fsdp1" / "optimizer.pt")
            torch.save(weights, root / "fsdp1" / "model.pt")
        _train(model, opt, rank, POST_STEPS, use_all=True)
        full = model.state_dict()
        if rank == 0:
            torch.save(full, root / "fsdp1-uninterrupted.pt")

        model, opt = _fsdp2(0)
        _train(model, opt, rank, PRE_STEPS, use_all=False)
        for name in ("verl", "sharded"):
            (root / name).mkdir(exist_ok=True)
        torch.save(model.state_dict(), root / "verl" / _verl_name("model", rank))
        torch.save(opt.state_dict(), root / "verl" / _verl_name("optim", rank))
        torch.save(get_optimizer_state_dict(model, opt), root / "sharded" / f"optimizer_rank_{rank}.pt")
        model_state, optimizer_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=root / "dcp")
        _train(model, opt, rank, POST_STEPS, use_all=True)
        torch.save(_local(model), root / f"verl-uninterrupted-{rank}.pt")
        dist.barrier()  # no rank tears gloo down while the other still uses it (an abort on a loaded machine)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Saved:
    root: Path

    @property
    def fsdp1(self) -> Path:
        return self.root / "fsdp1"

    @property
    def verl(self) -> Path:
        return self.root / "verl"

    @property
    def sharded(self) -> Path:
        return self.root / "sharded"

    @property
    def dcp(self) -> Path:
        return self.root / "dcp"

    def fsdp1_uninterrupted(self) -> dict[str, Tensor]:
        loaded: dict[str, Tensor] = torch.load(self.root / "fsdp1-uninterrupted.pt", weights_only=True)
        return loaded

    def verl_uninterrupted(self) -> list[dict[str, Tensor]]:
        return [torch.load(self.root / f"verl-uninterrupted-{rank}.pt", weights_only=True) for rank in range(WORLD)]


def save(root: Path) -> Saved:
    """Write the four checkpoints under ``root`` with two gloo ranks."""
    mp.spawn(_save, args=(root,), nprocs=WORLD)
    return Saved(root)


def _resume(rank: int, store: Path, fsdp1: list[tuple[Path, Path]], verl: list[Path], results: Path) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        found: dict[str, Any] = {}
        for optimizer_file, model_file in fsdp1:
            model, opt = _fsdp1(7)
            model.load_state_dict(torch.load(model_file, weights_only=True))
            try:
                opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, torch.load(optimizer_file)))
            except RuntimeError as exc:
                found[str(optimizer_file)] = str(exc)
                continue
            _train(model, opt, rank, POST_STEPS, use_all=True)
            found[str(optimizer_file)] = model.state_dict()
        for directory in verl:  # as verl's FSDPCheckpointManager.load_checkpoint does
            model, opt = _fsdp2(7)
            model.load_state_dict(torch.load(directory / _verl_name("model", rank), weights_only=False))
            opt.load_state_dict(torch.load(directory / _verl_name("optim", rank), weights_only=False))
            _train(model, opt, rank, POST_STEPS, use_all=True)
            found[str(directory)] = _local(model)
        torch.save(found, results / f"resumed-{rank}.pt")
        dist.barrier()  # no rank tears gloo down while the other still uses it (an abort on a loaded machine)
    finally:
        dist.destroy_process_group()


def resume(work: Path, fsdp1: Sequence[tuple[Path, Path]], verl: Sequence[Path]) -> list[dict[str, Any]]:
    """For each rank: each FSDP1 ``(optimizer file, model file)`` and verl directory, by its path, mapped to
    the parameters after ``POST_STEPS`` more steps (each rank's local shards for verl), or to the message of
    the ``RuntimeError`` its loader raised."""
    work.mkdir()
    mp.spawn(_resume, args=(work / "resume.store", list(fsdp1), list(verl), work), nprocs=WORLD)
    return [torch.load(work / f"resumed-{rank}.pt", weights_only=True) for rank in range(WORLD)]
