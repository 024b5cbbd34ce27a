"""Real DCP checkpoints for tests, saved with ``torch.distributed.checkpoint`` the way trainers save them.

Each factory trains a small model with a real optimizer for a few steps in which one head gets no
gradient (so its parameters have no optimizer state), saves with stock ``dcp.save`` (single
process, no process group) and returns a ``Built`` (from ``tests.factories.built``) whose ``missing``
names the optimizer sites and their stateless parameters:

* ``unirl_dcp``: UniRL's ``checkpoint-<step>/``: keys ``model`` and ``optim`` (nested
  ``get_optimizer_state_dict``), ``metadata.pt`` beside the shards.
* ``torchtitan_dcp``: torchtitan's ``step-<n>/``: top-level weights, a flattened ``optimizer``
  (``flatten_optimizer_state_dict=True``), ``lr_scheduler``, ``dataloader``, ``train_state``.
* ``two_optimizers_dcp``: a generator/discriminator pair, one nested, one flattened.
* ``sharded_dcp``: what two FSDP ranks write: every tensor split along dim 0 into one chunk per
  rank, each rank's chunks in its own ``__<rank>_0.distcp``. ``dcp.save`` cannot gather plans
  across real processes here (its object collectives need numpy), so the two ranks' DTensor state
  dicts are planned and written by DCP's own planner and writer in one process, under torch's fake
  process group, exactly as ``dcp.save`` sequences them.

``resume`` is the other side: stock ``dcp.load`` into a fresh ``get_optimizer_state_dict`` template
and ``set_optimizer_state_dict``, then more training.
"""

from __future__ import annotations

import inspect
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LinearLR

from optim_repair.checkpoint.discovery import discover
from optim_repair.checkpoint.planning import finish_plan
from optim_repair.checkpoint.writing import write_copy
from optim_repair.formats.dcp import METADATA_FILE, PlannedEntries, plan_dcp, read_dcp, read_metadata
from optim_repair.formats.dcp.metadata import display_path
from optim_repair.formats.dcp.verifier import verify_planned_dcp
from optim_repair.formats.dcp.writer import write_planned_dcp
from optim_repair.records.inventory import FileInventory, OptimizerInventory
from optim_repair.records.repair_plan import Addition, FreshTensor, ParamChange, RepairPlan
from optim_repair.records.request import CopyRequest
from optim_repair.records.verification import Verification
from tests.factories.built import Built, Site
from tests.factories.models import Net, make_optimizer, train
from tests.factories.support import read_checkpoint

PRE_STEPS = 3
"""Steps before the checkpoint, in which ``head`` gets no gradient."""
POST_STEPS = 3
"""Steps after the resume, in which every parameter gets a gradient."""


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(width, width)
        self.to_out = nn.Linear(width, width)


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 2)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = Attention(width)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.attn.to_out(torch.tanh(self.attn.to_q(x)))
        return x + out


class DeepNet(Net):
    """Blocks with names several dots deep (``blocks.1.attn.to_out.weight``) and a ``head.proj``
    that gets a gradient only when ``use_all``. Every dim 0 is at least 2, so it splits in two."""

    def __init__(self, width: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.width = width
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList([Block(width), Block(width)])
            self.head = Head(width)

    def example_input(self, generator: torch.Generator) -> Tensor:
        return torch.randn(3, self.width, generator=generator)

    def forward(self, x: Tensor, use_all: bool = False) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head.proj(x) if use_all else x


HEAD = ("head.proj.weight", "head.proj.bias")
"""The parameters ``DeepNet`` leaves without state before the resume."""


@dataclass
class Trained:
    model: DeepNet
    optimizer: Optimizer


def trained(optimizer: str = "adamw", seed: int = 0) -> Trained:
    """``DeepNet`` after ``PRE_STEPS`` steps of ``optimizer`` with ``head`` unused."""
    model = DeepNet(seed=seed)
    opt = make_optimizer(model, optimizer)
    train(model, opt, PRE_STEPS, use_all=False, seed=seed)
    return Trained(model, opt)


def uninterrupted(optimizer: str = "adamw") -> dict[str, Tensor]:
    """The parameters after ``PRE_STEPS`` steps with ``head`` unused and ``POST_STEPS`` with all."""
    run = trained(optimizer)
    train(run.model, run.optimizer, POST_STEPS, use_all=True, seed=1)
    return {name: p.detach().clone() for name, p in run.model.named_parameters()}


def options(flatten: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def _missing(key: str, names: tuple[str, ...] = HEAD) -> dict[Site, tuple[str, ...]]:
    return {Site("", (key,)): names}


def _unirl_state(optimizer: str, flatten: bool) -> dict[str, Any]:
    """What UniRL hands ``dcp.save``: the model and its optimizer, after ``trained(optimizer)``."""
    run = trained(optimizer)
    return {
        "model": get_model_state_dict(run.model),
        "optim": get_optimizer_state_dict(run.model, run.optimizer, options=options(flatten)),
    }


def unirl_dcp(root: Path, optimizer: str = "adamw", flatten: bool = False) -> Built:
    """UniRL's DCP checkpoint: ``checkpoint-<step>/`` with ``model``, ``optim`` and ``metadata.pt``."""
    path = root / f"checkpoint-{PRE_STEPS}"
    save(_unirl_state(optimizer, flatten), checkpoint_id=path)
    torch.save({"step": PRE_STEPS, "optimizer_step_count": PRE_STEPS, "save_mode": "full"}, path / "metadata.pt")
    return Built(path, _missing("optim"))


def rank_local_dcp(root: Path, ranks: int = 1) -> Built:
    """UniRL's state saved by ``dcp.save(..., use_collectives=False)``: each rank writes ``__<rank>.metadata`` (its own
    view) and ``__<rank>_0.distcp``, and there is no global ``.metadata``. With two ``ranks``, each saves its dim-0
    half of every tensor (``_shard``), one rank after the other under a fake process group, as nothing coordinates
    them. Needs a torch whose ``dcp.save`` takes ``use_collectives``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    path = root / f"checkpoint-{PRE_STEPS}"
    state = _unirl_state("adamw", False)
    if ranks == 1:
        save(state, checkpoint_id=path, use_collectives=False)  # type: ignore[call-arg,unused-ignore]
        return Built(path, _missing("optim"))
    for rank in range(ranks):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
        try:
            local = _shard(dict(state), rank, DeviceMesh("cpu", list(range(ranks))))
            save(local, checkpoint_id=path, use_collectives=False)  # type: ignore[call-arg,unused-ignore]
        finally:
            dist.destroy_process_group()
    return Built(path, _missing("optim"))


def rank_local_views(path: Path, ranks: int) -> list[dict[str, Any]]:
    """What each rank's stock ``dcp.load`` reads from the checkpoint at ``path`` saved without collectives into a
    fresh model's sharded template: the ``optim`` state dict of each. Each rank's load is torch's own, through
    torch's ``FileSystemReader`` reading that rank's own metadata (``read_metadata(rank=...)``, as ``dcp.load``
    falls back to it); the fake process group takes no collectives, so each load runs as its rank alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    class RankReader(FileSystemReader):
        def __init__(self, rank: int) -> None:
            super().__init__(path)
            self.own = rank

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return super().read_metadata(rank=self.own)

    loaded = []
    for rank in range(ranks):
        model = DeepNet(seed=7)
        opt = make_optimizer(model, "adamw")
        train(model, opt, 1, use_all=True, seed=5)  # a template with every entry, which the load overwrites
        template = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
        try:
            local = _shard(template, rank, DeviceMesh("cpu", list(range(ranks))))
            load(local, storage_reader=RankReader(rank), no_dist=True)  # type: ignore[call-arg,unused-ignore]
        finally:
            dist.destroy_process_group()
        loaded.append(local["optim"])
    return loaded


def torchtitan_dcp(root: Path, optimizer: str = "adamw") -> Built:
    """torchtitan's ``step-<n>/``, as its ``CheckpointManager`` saves it: the model's weights at the top level
    (``blocks.0.attn.to_q.weight``, not under ``model``), a flattened ``optimizer``, scheduler and dataloader state."""
    model = DeepNet()
    opt = make_optimizer(model, optimizer)
    scheduler = LinearLR(opt, start_factor=0.5, total_iters=10)
    train(model, opt, PRE_STEPS, use_all=False, seed=0, scheduler=scheduler)
    path = root / f"step-{PRE_STEPS}"
    state = {
        **get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, opt, options=options(True)),
        "lr_scheduler": scheduler.state_dict(),
        "dataloader": {"world_size": 1, "dp_rank_0": pickle.dumps({"sample_index": 3 * PRE_STEPS})},
        "train_state": {"step": PRE_STEPS, "ntokens_seen": 36},
    }
    save(state, checkpoint_id=path)
    return Built(path, _missing("optimizer"))


def torchtitan_model_only(root: Path) -> Path:
    """The model-only step torchtitan writes last (``last_save_model_only``): top-level weights, no optimizer."""
    path = root / f"step-{PRE_STEPS}-model-only"
    save(get_model_state_dict(trained("adamw").model), checkpoint_id=path)
    return path


def flattened_without_model(root: Path) -> Built:
    """A flattened optimizer saved without the model: names come from the param-group keys alone."""
    run = trained("adamw")
    path = root / "optimizer-only"
    save({"optimizer": get_optimizer_state_dict(run.model, run.optimizer, options=options(True))}, checkpoint_id=path)
    return Built(path, _missing("optimizer"))


def two_optimizers_dcp(root: Path) -> Built:
    """``optim_g`` (AdamW, nested) and ``optim_d`` (NAdam, flattened) over disjoint parameters; the
    loss uses neither the second block's ``to_out`` (in ``optim_g``) nor the head (in ``optim_d``)."""
    model = DeepNet()
    in_d = ("blocks.1.attn.to_q.", "head.")
    gen = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith(in_d)], lr=1e-2)
    disc = torch.optim.NAdam([p for n, p in model.named_parameters() if n.startswith(in_d)], lr=1e-2)
    x = model.example_input(torch.Generator().manual_seed(0))
    for _ in range(PRE_STEPS):
        model.zero_grad(set_to_none=True)
        first, second = (cast(Block, block) for block in model.blocks)
        loss = torch.tanh(second.attn.to_q(first(x))).square().mean()
        torch.autograd.backward(loss)
        gen.step()
        disc.step()
    path = root / "gan"
    state = {
        "model": get_model_state_dict(model),
        "optim_g": get_optimizer_state_dict(model, gen),
        "optim_d": get_optimizer_state_dict(model, disc, options=options(True)),
    }
    save(state, checkpoint_id=path)
    unused = ("blocks.1.attn.to_out.weight", "blocks.1.attn.to_out.bias")
    return Built(path, {Site("", ("optim_g",)): unused, Site("", ("optim_d",)): HEAD})


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


def save_two_ranks(state: Mapping[str, Any], path: Path) -> None:
    """Write ``state`` as two FSDP ranks would: DCP's planner and writer, sequenced as ``dcp.save``."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    planners, writers, plans = [], [], []
    for rank in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            local = _shard(dict(state), rank, DeviceMesh("cpu", [0, 1]))
            planner, writer = DefaultSavePlanner(), FileSystemWriter(path)
            planner.set_up_planner(state_dict=local, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
            if "kwargs" in inspect.signature(writer.set_up_storage_writer).parameters:  # as dcp.save asks
                writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            else:  # torch before 2.9 takes is_coordinator alone
                writer.set_up_storage_writer(rank == 0)
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


def sharded_dcp(root: Path, optimizer: str = "adamw", flatten: bool = False) -> Built:
    """``unirl_dcp`` as two FSDP ranks write it: each tensor in two dim-0 chunks, one file per rank."""
    path = root / f"checkpoint-{PRE_STEPS}"
    save_two_ranks(_unirl_state(optimizer, flatten), path)
    return Built(path, _missing("optim"))


# --------------------------------------------------------------------------- repairs and resumes


def fresh_state(optimizer: str, dtype: str, shape: tuple[int, ...]) -> tuple[tuple[str, Any], ...]:
    """What ``_init_group`` of ``optimizer`` creates on a parameter's first step, written out by hand."""
    step = ("step", FreshTensor("float32", (), 0.0))
    zeros = FreshTensor(dtype, shape, 0.0)
    if optimizer == "nadam":
        return (step, ("mu_product", FreshTensor("float32", (), 1.0)), ("exp_avg", zeros), ("exp_avg_sq", zeros))
    if optimizer == "adam_amsgrad":
        return (step, ("exp_avg", zeros), ("exp_avg_sq", zeros), ("max_exp_avg_sq", zeros))
    if optimizer in ("adamw", "adam"):
        return (step, ("exp_avg", zeros), ("exp_avg_sq", zeros))
    if optimizer == "sgd_dampening":
        return (("momentum_buffer", None),)
    raise ValueError(f"no hand-written fresh state for {optimizer}")


def additions_for(inventory: FileInventory, optimizers: Mapping[str, str]) -> tuple[Addition, ...]:
    """Exact fresh state for every stateless parameter; ``optimizers`` maps a location to its kind."""
    weights = inventory.weights[0].lookup()
    found = []
    for opt in inventory.optimizers:
        for param in missing_params(opt):
            weight = weights[str(param)]
            state = fresh_state(optimizers[opt.location], weight.dtype, weight.shape)
            found.append(Addition(inventory.file, opt.location, opt.address, param, state))
    return tuple(found)


def missing_params(opt: OptimizerInventory) -> tuple[str | int, ...]:
    return tuple(param for param in opt.params if opt.entry(param) is None)


def resume(
    path: Path, optimizer: str, key: str, flatten: bool, steps: int = POST_STEPS, *, top_level: bool = False
) -> dict[str, Tensor]:
    """Load ``path`` with stock DCP into a fresh model (other init) and optimizer, then train with all.
    ``top_level``: the weights sit at the top level, as torchtitan saves them, not under ``model``."""
    model = DeepNet(seed=7)
    opt = make_optimizer(model, optimizer)
    weights = get_model_state_dict(model)
    state: dict[str, Any] = {
        **(weights if top_level else {"model": weights}),
        key: get_optimizer_state_dict(model, opt, options=options(flatten)),
    }
    load(state, checkpoint_id=path)
    set_model_state_dict(model, {name: state[name] for name in weights} if top_level else state["model"])
    set_optimizer_state_dict(model, opt, state[key], options=options(flatten))
    train(model, opt, steps, use_all=True, seed=1)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --------------------------------------------------------------------------- unsafe inputs


class CreateOnLoad:
    """Pickles as ``open(path, "w")``: unpickling it creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (open, (os.fspath(self.path), "w"))


def unsafe_metadata(root: Path, marker: Path) -> Path:
    """A real checkpoint whose ``.metadata`` creates ``marker`` when torch unpickles it."""
    path = unirl_dcp(root).path
    with (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    metadata.planner_data["optim.state.head.proj.weight.step"] = CreateOnLoad(marker)
    with (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    return path


def unsafe_bytes_entry(root: Path, marker: Path) -> Path:
    """A checkpoint whose optimizer ``lr`` bytes entry creates ``marker`` when ``torch.load``'ed."""
    run = trained("adamw")
    osd: Any = get_optimizer_state_dict(run.model, run.optimizer)
    osd["param_groups"][0]["lr"] = CreateOnLoad(marker)
    path = root / "unsafe-bytes"
    save({"model": get_model_state_dict(run.model), "optim": osd}, checkpoint_id=path)
    return path


def with_transform(path: Path, key: str, descriptor: str) -> None:
    """Mark the bytes entry ``key`` of ``path``'s metadata as written through ``descriptor``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    with (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    metadata.storage_data[MetadataIndex(key)].transform_descriptors = [descriptor]
    with (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)


def files(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` by relative name, with its bytes."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def repaired(built: Built, kinds: dict[str, str], dest: Path, *, link: bool = False) -> tuple[Addition, ...]:
    """Write ``built`` repaired with hand-written fresh state to ``dest`` (the tool's own atomic, verified copy);
    returns the additions."""
    additions = additions_for(read_dcp(built.path, ""), kinds)
    found = discover(built.path)
    finished = finish_plan(found.target, read_checkpoint(built.path), RepairPlan("fresh", additions))
    write_copy(found, finished, dest, CopyRequest(link=link))
    return additions


def by_name(opt: OptimizerInventory) -> dict[object, dict[str, object]]:
    return {entry.param: dict(entry.values or ()) for entry in opt.entries}


def only(inventory: FileInventory) -> OptimizerInventory:
    (opt,) = inventory.optimizers
    return opt


def write_dcp(
    src: Path, additions: Sequence[Addition], dest: Path, *, changes: Sequence[ParamChange] = ()
) -> PlannedEntries:
    """Plan, then write into ``dest`` what ``fix`` writes for ``additions`` and ``changes`` to ``src``."""
    source = display_path(str(src), METADATA_FILE)
    planned = plan_dcp(read_metadata(src, str(src)), source, additions, changes)
    write_planned_dcp(src, planned, dest)
    return planned


def verify_dcp(src: Path, dest: Path, additions: Sequence[Addition]) -> Verification:
    """Verify ``dest`` as the copy of ``src`` with ``additions``, planned anew from ``src``'s own metadata."""
    source = display_path(str(src), METADATA_FILE)
    return verify_planned_dcp(src, dest, plan_dcp(read_metadata(src, str(src)), source, additions))
