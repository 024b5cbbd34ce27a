"""The seed checkpoints: tiny models trained a few real steps, saved the way the named trainers save them.

Each builder writes under a directory it is given and returns what to give the tool. One head of every model
gets no gradient, so its parameters have no optimizer state: the sparse state the tool exists for.
"""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LinearLR, LRScheduler

STEPS = 3


class TwoHeadNet(nn.Module):
    """A trunk and two heads; ``head_unused`` is computed, then discarded."""

    def __init__(self, hidden: int = 8, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.trunk = nn.Linear(4, hidden)
            self.head_used = nn.Linear(hidden, 2)
            self.head_unused = nn.Linear(hidden, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.trunk(x))
        self.head_unused(h)
        out: Tensor = self.head_used(h)
        return out


class Wrapped(nn.Module):
    """A LightningModule holding ``self.net``: weights keyed ``net.<name>``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out


class TrickyNet(TwoHeadNet):
    """``TwoHeadNet`` plus complex, zero-size, bf16 and fp16 parameters, some never used."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.spectral = nn.Parameter(torch.randn(3, dtype=torch.complex64))
            self.spectral_unused = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
            self.void = nn.Parameter(torch.zeros(0, 4))
            self.gain_bf16 = nn.Parameter(torch.randn(2, 3).to(torch.bfloat16))
            self.gain_bf16_unused = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
            self.gain_fp16 = nn.Parameter(torch.randn(2).to(torch.float16))

    def forward(self, x: Tensor) -> Tensor:
        extra = (
            torch.view_as_real(self.spectral * (1 + 2j)).square().sum()
            + self.void.sum()
            + self.gain_bf16.float().square().sum()
            + self.gain_fp16.float().square().sum()
        )
        return super().forward(x) + extra


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(width, width)
        self.to_out = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.to_out(torch.tanh(self.to_q(x)))
        return x + out


class DeepNet(nn.Module):
    """Names several dots deep (``blocks.1.to_out.weight``), a ``head.proj`` that gets no gradient, every dim 0
    at least 2 (so that it splits in two)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.Sequential(Block(width), Block(width))
            self.head = nn.ModuleDict({"proj": nn.Linear(width, 2)})

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.blocks(x)
        return out


@dataclass
class TrainingArguments:
    """Stands in for ``transformers.TrainingArguments`` pickled into ``training_args.bin``."""

    output_dir: str
    learning_rate: float = 1e-2
    report_to: list[str] = field(default_factory=list)


def train(model: nn.Module, optimizer: Optimizer, scheduler: LRScheduler | None = None, steps: int = STEPS) -> None:
    """Real steps on a fixed input."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def trained(model: nn.Module, groups: int = 1) -> tuple[nn.Module, Optimizer, LRScheduler]:
    """``model`` after ``STEPS`` steps of AdamW (``groups=2``: matrices, then the rest at half the lr)."""
    params = list(model.parameters())
    if groups == 2:
        matrices = [p for p in params if p.ndim >= 2]
        rest = {"params": [p for p in params if p.ndim < 2], "lr": 5e-3, "weight_decay": 0.0}
        opt = torch.optim.AdamW([{"params": matrices}, rest], lr=1e-2, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    scheduler = LinearLR(opt, start_factor=0.5, total_iters=4)
    train(model, opt, scheduler)
    return model, opt, scheduler


def _json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _unirl_payload(model: nn.Module, opt: Optimizer, scheduler: LRScheduler) -> dict[str, Any]:
    return {
        "policy_state_dict": get_model_state_dict(model),
        "optimizer_state_dict": get_optimizer_state_dict(model, opt),
        "optimizer_step_count": STEPS,
        "step": STEPS,
        "save_mode": "full",
        "lora_config": None,
        "scheduler_state_dict": scheduler.state_dict(),
    }


def _file(root: Path, name: str, payload: Any, legacy: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    torch.save(payload, root / name, _use_new_zipfile_serialization=not legacy)
    return root / name


def unirl_torch(root: Path, legacy: bool = False) -> Path:
    """UniRL's ``checkpoint-<step>/``: ``checkpoint.pt`` (name-keyed optimizer) and its JSON files."""
    directory = root / f"checkpoint-{STEPS}"
    _file(directory, "checkpoint.pt", _unirl_payload(*trained(TwoHeadNet())), legacy=legacy)
    _json(directory / "trainer_state.json", {"global_step": STEPS, "epoch": 0, "best_metric": None})
    _json(directory / "sft_data_state.json", {"epoch": 0, "cursor": STEPS * 3, "seed": 0})
    return directory


def legacy_format(root: Path) -> Path:
    """``legacy.pt``: the UniRL payload in torch's pre-1.6 (non-zip) serialization."""
    return _file(root, "legacy.pt", _unirl_payload(*trained(TwoHeadNet())), legacy=True)


def hf_trainer(root: Path) -> Path:
    """HF Trainer's ``checkpoint-<step>/``: an index-keyed ``optimizer.pt`` and its companions."""
    model = TwoHeadNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = LambdaLR(opt, lambda s: 1.0 - s / 10)
    train(model, opt, scheduler)
    directory = root / f"checkpoint-{STEPS}"
    _file(directory, "optimizer.pt", opt.state_dict())
    torch.save(scheduler.state_dict(), directory / "scheduler.pt")
    rng = {"python": random.getstate(), "cpu": torch.get_rng_state()}
    try:
        import numpy

        rng["numpy"] = numpy.random.RandomState(0).get_state()
    except ImportError:  # numpy's pickled state only where numpy is installed
        pass
    torch.save(rng, directory / "rng_state.pth")
    torch.save(TrainingArguments(output_dir=str(root)), directory / "training_args.bin")
    save_file(model.state_dict(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    _json(directory / "trainer_state.json", {"global_step": STEPS, "epoch": 1.0, "log_history": []})
    return directory


def accelerate(root: Path) -> Path:
    """Accelerate's ``save_state`` directory: two index-keyed optimizers over overlapping halves of the model."""
    model = TwoHeadNet()
    first = torch.optim.AdamW([*model.trunk.parameters(), *model.head_unused.parameters()], lr=1e-2)
    second = torch.optim.Adam([model.head_used.weight, model.head_unused.bias, model.head_used.bias], lr=1e-2)
    scheduler = LinearLR(first, start_factor=0.5, total_iters=4)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        first.zero_grad(set_to_none=True)
        second.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        first.step()
        second.step()
        scheduler.step()
    directory = root / "checkpoints" / "checkpoint_0"
    _file(directory, "optimizer.bin", first.state_dict())
    torch.save(second.state_dict(), directory / "optimizer_1.bin")
    save_file(model.state_dict(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    torch.save(scheduler.state_dict(), directory / "scheduler.bin")
    torch.save({"step": 2, "random_state": random.getstate()}, directory / "random_states_0.pkl")
    return directory


def lightning(root: Path) -> Path:
    """Lightning's ``epoch=0-step=<step>.ckpt``: ``net.``-prefixed weights, an index-keyed optimizer."""
    module, opt, scheduler = trained(Wrapped(TwoHeadNet()))
    checkpoint = {
        "epoch": 0,
        "global_step": STEPS,
        "pytorch-lightning_version": "2.5.0",
        "state_dict": module.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}},
        "callbacks": {},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
        "hyper_parameters": {"hidden": 8, "lr": 1e-2},
    }
    return _file(root, f"epoch=0-step={STEPS}.ckpt", checkpoint)


def multi_optimizer(root: Path) -> Path:
    """``multi_optimizer.pt``: ``optimizers: {"actor": ..., "critic": ...}``, name-keyed, one with two groups."""
    actor, actor_opt, _ = trained(TwoHeadNet(seed=3))
    critic, critic_opt, _ = trained(TwoHeadNet(hidden=5, seed=4), groups=2)
    payload = {
        "models": {"actor": actor.state_dict(), "critic": critic.state_dict()},
        "optimizers": {
            "actor": get_optimizer_state_dict(actor, actor_opt),
            "critic": get_optimizer_state_dict(critic, critic_opt),
        },
        "step": STEPS,
    }
    return _file(root, "multi_optimizer.pt", payload)


def _poke(t: Tensor, int_dtype: torch.dtype, width: int, values: tuple[int, ...]) -> Tensor:
    """A copy of ``t`` with its first elements set bit-exactly to ``values``."""
    out = t.clone()
    signed = [v - (1 << width) if v >= 1 << (width - 1) else v for v in values]
    out.view(int_dtype).view(-1)[: len(values)] = torch.tensor(signed, dtype=int_dtype)
    return out


def tricky_tensors(root: Path) -> Path:
    """``tricky_tensors.pt``: bf16, fp16, complex and zero-size moments, NaN payloads and ``-0.0``, a transposed
    moment and two moments that are views of one storage."""
    payload = _unirl_payload(*trained(TrickyNet()))
    state = payload["optimizer_state_dict"]["state"]
    head = state["head_used.weight"]
    head["exp_avg"] = _poke(head["exp_avg"], torch.int32, 32, (0x7FC00001, 0xFFC12345, 0x80000000))
    head["exp_avg_sq"] = _poke(head["exp_avg_sq"], torch.int32, 32, (0x80000000,))
    state["gain_bf16"]["exp_avg"] = _poke(state["gain_bf16"]["exp_avg"], torch.int16, 16, (0x7FC1, 0x8000))
    state["gain_fp16"]["exp_avg"] = _poke(state["gain_fp16"]["exp_avg"], torch.int16, 16, (0x7E01, 0x8000))
    trunk = state["trunk.weight"]
    trunk["exp_avg"] = trunk["exp_avg"].t().contiguous().t()
    bias = state["trunk.bias"]
    n = bias["exp_avg"].numel()
    shared = torch.cat([bias["exp_avg"], bias["exp_avg_sq"]])
    bias["exp_avg"], bias["exp_avg_sq"] = shared[:n], shared[n:]
    return _file(root, "tricky_tensors.pt", payload)


def _dcp_state() -> dict[str, Any]:
    model, opt, _ = trained(DeepNet())
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def unirl_dcp(root: Path) -> Path:
    """UniRL's DCP checkpoint: ``checkpoint-<step>/`` with ``model``, ``optim`` and ``metadata.pt``."""
    path = root / f"checkpoint-{STEPS}"
    save(_dcp_state(), checkpoint_id=path)
    torch.save({"step": STEPS, "optimizer_step_count": STEPS, "save_mode": "full"}, path / "metadata.pt")
    return path


def torchtitan_dcp(root: Path) -> Path:
    """torchtitan's ``step-<n>/``: top-level weights, a flattened ``optimizer``, scheduler and dataloader state."""
    model, opt, scheduler = trained(DeepNet())
    path = root / f"step-{STEPS}"
    state = {
        **get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)),
        "lr_scheduler": scheduler.state_dict(),
        "dataloader": {"world_size": 1, "dp_rank_0": pickle.dumps({"sample_index": 3 * STEPS})},
        "train_state": {"step": STEPS, "ntokens_seen": 36},
    }
    save(state, checkpoint_id=path)
    return path


def _shard(value: Any, rank: int, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(value, Tensor):
        if value.dim() == 0:
            return value.clone()
        local = torch.chunk(value, 2, dim=0)[rank].clone()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, dict):
        return {key: _shard(item, rank, mesh) for key, item in value.items()}
    if isinstance(value, list):
        return [_shard(item, rank, mesh) for item in value]
    return value


def sharded_dcp(root: Path) -> Path:
    """``unirl_dcp`` as two FSDP ranks write it: each tensor in two dim-0 chunks, one file per rank, planned and
    written by DCP's own planner and writer under torch's fake process group, sequenced as ``dcp.save`` does."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    path = root / f"checkpoint-{STEPS}"
    state = _dcp_state()
    planners, writers, plans = [], [], []
    for rank in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            local = _shard(state, rank, DeviceMesh("cpu", [0, 1]))
            planner, writer = DefaultSavePlanner(), FileSystemWriter(path)
            planner.set_up_planner(state_dict=local, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            plans.append(writer.prepare_local_plan(planner.create_local_plan()))
            planners.append(planner)
            writers.append(writer)
        finally:
            dist.destroy_process_group()
    central, metadata = planners[0].create_global_plan(plans)
    central = writers[0].prepare_global_plan(central)
    results = []
    for rank in range(2):
        future = writers[rank].write_data(planners[rank].finish_plan(central[rank]), planners[rank])
        future.wait()
        results.append(future.value())
    writers[0].finish(metadata, results)
    return path


def dcp_parent(root: Path) -> Path:
    """A run directory holding a DCP checkpoint and a ``trainer_state.json``."""
    run_dir = root / "run"
    unirl_dcp(run_dir)
    (run_dir / "trainer_state.json").write_text('{"global_step": 3}\n')
    return run_dir


SEEDS: tuple[tuple[str, str, Callable[[Path], Path]], ...] = (
    ("unirl_torch.pt", "zip", lambda root: unirl_torch(root) / "checkpoint.pt"),
    ("hf_optimizer.pt", "zip", lambda root: hf_trainer(root) / "optimizer.pt"),
    ("lightning.ckpt", "zip", lightning),
    ("tricky_tensors.pt", "zip", tricky_tensors),
    ("multi_optimizer.pt", "zip", multi_optimizer),
    ("legacy.pt", "legacy", legacy_format),
    ("unirl_torch_legacy.pt", "legacy", lambda root: unirl_torch(root, legacy=True) / "checkpoint.pt"),
    ("unirl_dcp", "dcp", unirl_dcp),
    ("torchtitan_dcp", "dcp", torchtitan_dcp),
    ("sharded_dcp", "dcp", sharded_dcp),
    ("hf_trainer", "directory", hf_trainer),
    ("unirl_torch_dir", "directory", unirl_torch),
    ("accelerate", "directory", accelerate),
    ("dcp_parent", "directory", dcp_parent),
)
"""(name, kind, build) of every seed; ``build`` writes into a directory and returns what to give the tool."""
