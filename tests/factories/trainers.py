"""Trainer-style checkpoints: tiny models trained a few real steps, saved the way the named trainers save them."""

from __future__ import annotations

import json
import pickle
import random
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import TensorSpec, serialize_file
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LambdaLR, LinearLR

from tests.factories.built import Built, Site, StateDict
from tests.factories.models import (
    BugReportNet,
    LitWrapper,
    ParamKey,
    Run,
    TwoHeadNet,
    absent_entries,
    make_optimizer,
    run,
    train,
)


def unirl_payload(r: Run, save_mode: str = "full", lora_config: dict[str, Any] | None = None) -> StateDict:
    """UniRL's ``checkpoint.pt`` dict; its optimizer comes from ``get_optimizer_state_dict``."""
    weights = get_model_state_dict(r.model)
    if save_mode == "lora":
        weights = {k: v for k, v in weights.items() if "lora_" in k}
    return {
        "policy_state_dict": weights,
        "optimizer_state_dict": get_optimizer_state_dict(r.model, r.optimizer),
        "optimizer_step_count": r.steps,
        "step": r.steps,
        "save_mode": save_mode,
        "lora_config": lora_config,
        "scheduler_state_dict": r.scheduler.state_dict(),
    }


OPT_SITE = ("optimizer_state_dict",)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_unirl_dir(directory: Path, payload: StateDict, step: int, legacy: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(payload, directory / "checkpoint.pt", _use_new_zipfile_serialization=not legacy)
    _write_json(directory / "trainer_state.json", {"global_step": step, "epoch": 0, "best_metric": None})
    _write_json(directory / "sft_data_state.json", {"epoch": 0, "cursor": step * 3, "seed": 0})


def save_safetensors(tensors: Mapping[str, Tensor], path: Path) -> None:
    """``safetensors.torch.save_file``; without numpy, the same Rust writer fed torch's pointers."""
    metadata = {"format": "pt"}
    try:
        save_file(dict(tensors), str(path), metadata=metadata)
    except ModuleNotFoundError:  # safetensors.torch needs numpy only to find each buffer's address
        alive = {k: v.detach().contiguous() for k, v in tensors.items()}
        specs = {
            k: TensorSpec(
                dtype=str(v.dtype).removeprefix("torch."),
                shape=list(v.shape),
                data_ptr=v.data_ptr(),
                data_len=v.numel() * v.element_size(),
            )
            for k, v in alive.items()
        }
        serialize_file(specs, str(path), metadata=metadata)


def single_file(root: Path, name: str, payload: StateDict, legacy: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / name
    torch.save(payload, path, _use_new_zipfile_serialization=not legacy)
    return path


# --------------------------------------------------------------------------- trainer layouts


def unirl_torch(
    root: Path,
    optimizer: str = "adamw",
    groups: int = 1,
    steps: int = 2,
    legacy: bool = False,
) -> Built:
    """``checkpoint-<steps>/checkpoint.pt`` (+ JSON files): name-keyed, ``head_unused.*`` absent."""
    r = run(optimizer=optimizer, groups=groups, steps=steps)
    directory = root / f"checkpoint-{steps}"
    _write_unirl_dir(directory, unirl_payload(r), steps, legacy=legacy)
    site = Site("checkpoint.pt", OPT_SITE)
    return Built(directory, {site: absent_entries(r.model, r.optimizer, "name")})


def petrainer(root: Path, optimizer: str = "adamw", steps: int = 2) -> Built:
    """``checkpoint-<steps>/diffusion/checkpoint.pt`` and ``.../ar/checkpoint.pt``, both sparse."""
    directory = root / f"checkpoint-{steps}"
    missing: dict[Site, tuple[ParamKey, ...]] = {}
    for side, model in (("diffusion", TwoHeadNet(seed=1)), ("ar", TwoHeadNet(hidden=6, seed=2))):
        r = run(model, optimizer=optimizer, steps=steps, groups=2 if side == "ar" else 1)
        _write_unirl_dir(directory / side, unirl_payload(r), steps)
        missing[Site(f"{side}/checkpoint.pt", OPT_SITE)] = absent_entries(r.model, r.optimizer, "name")
    return Built(directory, missing)


@dataclass
class _NumpyGlobal:
    """A numpy global, pickled by name (``numpy._core.multiarray._reconstruct``) without numpy installed."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class _NumpyArray:
    """Pickles exactly as numpy 2 pickles a 1-d ``uint32`` array (``ndarray.__reduce__``)."""

    def __init__(self, values: Sequence[int]) -> None:
        self.values = values

    def __reduce__(self) -> tuple[Any, ...]:
        dtype = _NumpyDType()
        raw = b"".join(value.to_bytes(4, "little") for value in self.values)
        reconstruct = _NumpyGlobal("numpy._core.multiarray", "_reconstruct")
        return reconstruct, (_NumpyGlobal("numpy", "ndarray"), (0,), b"b"), (1, (len(self.values),), dtype, False, raw)


class _NumpyDType:
    def __reduce__(self) -> tuple[Any, ...]:
        return _NumpyGlobal("numpy", "dtype"), ("u4", False, True), (3, "<", None, None, None, -1, -1, 0)


class _NumpyPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    dispatch = pickle._Pickler.dispatch.copy()  # type: ignore[attr-defined]

    def _save_numpy_global(self, obj: _NumpyGlobal) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_NumpyGlobal] = _save_numpy_global


def save_rng_state(path: Path) -> None:
    """HF Trainer's ``rng_state.pth``: Python's, numpy's and torch's RNG states, with numpy's as numpy pickles it
    (real numpy when it is installed)."""
    try:
        import numpy

        state: Any = numpy.random.RandomState(0).get_state()
        pickle_module: Any = pickle
    except ImportError:
        state = ("MT19937", _NumpyArray(list(range(624))), 624, 0, 0.0)
        pickle_module = types.SimpleNamespace(Pickler=_NumpyPickler, __name__="pickle")
    rng = {"python": random.getstate(), "numpy": state, "cpu": torch.get_rng_state()}
    torch.save(rng, path, pickle_module=pickle_module)


class LossScaler:
    """Stands in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler``, pickled under DeepSpeed's name."""

    def __init__(self) -> None:
        self.cur_scale = 1.0
        self.cur_iter = 0


def deepspeed_zero(root: Path, steps: int = 3) -> Built:
    """HF Trainer + DeepSpeed ZeRO-1's ``checkpoint-<steps>/``: ``global_step<steps>/`` holds
    ``mp_rank_00_model_states.pt`` and ``zero_pp_rank_0_mp_rank_00_optim_states.pt`` (flat fp32 partitions
    per group, a pickled ``LossScaler``), beside ``latest``, the model and the trainer's files; no optimizer.pt."""
    model = TwoHeadNet()
    opt = make_optimizer(model, "adamw")
    train(model, opt, steps)
    directory = root / f"checkpoint-{steps}"
    shards = directory / f"global_step{steps}"
    shards.mkdir(parents=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    partition = {"state": {0: {"step": torch.tensor(float(steps)), "exp_avg": torch.zeros_like(flat),
                               "exp_avg_sq": torch.zeros_like(flat)}},
                 "param_groups": [{**opt.param_groups[0], "params": [0]}]}  # fmt: skip
    # pickle names a class by its module, which it imports: DeepSpeed's, registered for the save only
    names = ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", "deepspeed.runtime.fp16.loss_scaler")
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[names[-1]].LossScaler = LossScaler  # type: ignore[attr-defined]
    LossScaler.__module__ = names[-1]
    try:
        optim_states = {"optimizer_state_dict": {"loss_scaler": LossScaler(), "dynamic_loss_scale": False,
                                                 "overflow": False, "clip_grad": 1.0,
                                                 "base_optimizer_state": partition,
                                                 "single_partition_of_fp32_groups": [flat.clone()],
                                                 "zero_stage": 1, "group_paddings": [0], "partition_count": [1],
                                                 "ds_version": "0.19.0"},
                        "ds_config": {"zero_optimization": {"stage": 1}}, "ds_version": "0.19.0"}  # fmt: skip
        torch.save(optim_states, shards / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        model_states = {"module": model.state_dict(), "buffer_names": [], "optimizer": None,
                        "param_shapes": [{n: p.shape for n, p in model.named_parameters()}],
                        "lr_scheduler": None, "loss_scaler": LossScaler(), "ds_version": "0.19.0"}  # fmt: skip
        torch.save(model_states, shards / "mp_rank_00_model_states.pt")
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    (directory / "latest").write_text(f"global_step{steps}")
    save_rng_state(directory / "rng_state.pth")
    save_safetensors(model.state_dict(), directory / "model.safetensors")
    _write_json(directory / "trainer_state.json", {"global_step": steps, "epoch": 1.0, "log_history": []})
    return Built(directory, {})


@dataclass
class TrainingArguments:
    """Stands in for ``transformers.TrainingArguments`` pickled into ``training_args.bin``."""

    output_dir: str
    learning_rate: float = 1e-2
    num_train_epochs: float = 1.0
    per_device_train_batch_size: int = 3
    seed: int = 0
    report_to: list[str] = field(default_factory=list)


def hf_trainer(root: Path, optimizer: str = "adamw", groups: int = 1, steps: int = 3) -> Built:
    """HF Trainer's ``checkpoint-<steps>/``: index-keyed ``optimizer.pt`` and its companions."""
    model = TwoHeadNet()
    opt = make_optimizer(model, optimizer, groups=groups)
    scheduler = LambdaLR(opt, lambda s: 1.0 - s / 10)
    train(model, opt, steps, scheduler=scheduler)
    directory = root / f"checkpoint-{steps}"
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(opt.state_dict(), directory / "optimizer.pt")
    torch.save(scheduler.state_dict(), directory / "scheduler.pt")
    save_rng_state(directory / "rng_state.pth")
    torch.save(TrainingArguments(output_dir=str(root)), directory / "training_args.bin")
    save_safetensors(model.state_dict(), directory / "model.safetensors")
    _write_json(
        directory / "trainer_state.json",
        {"global_step": steps, "epoch": 1.0, "log_history": [], "best_model_checkpoint": None},
    )
    return Built(directory, {Site("optimizer.pt"): absent_entries(model, opt, "index")})


def accelerate(root: Path, steps: int = 2) -> Built:
    """Accelerate's ``save_state`` dir: index-keyed ``optimizer.bin`` and ``optimizer_1.bin``.

    Optimizer 0 holds ``trunk.*`` and ``head_unused.*`` (indices 2, 3 absent); optimizer 1 holds
    ``head_used.weight``, ``head_unused.bias``, ``head_used.bias`` (index 1 absent).
    """
    model = TwoHeadNet()
    first = torch.optim.AdamW(
        [model.trunk.weight, model.trunk.bias, model.head_unused.weight, model.head_unused.bias],
        lr=1e-2,
    )
    second = torch.optim.Adam([model.head_used.weight, model.head_unused.bias, model.head_used.bias], lr=1e-2)
    scheduler = LinearLR(first, start_factor=0.5, total_iters=4)
    generator = torch.Generator().manual_seed(0)
    x = model.example_input(generator)
    for _ in range(steps):
        first.zero_grad(set_to_none=True)
        second.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        first.step()
        second.step()
        scheduler.step()
    directory = root / "checkpoints" / "checkpoint_0"
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(first.state_dict(), directory / "optimizer.bin")
    torch.save(second.state_dict(), directory / "optimizer_1.bin")
    save_safetensors(model.state_dict(), directory / "model.safetensors")
    torch.save(scheduler.state_dict(), directory / "scheduler.bin")
    torch.save(
        {
            "step": steps,
            "random_state": random.getstate(),
            "torch_manual_seed": torch.get_rng_state(),
        },
        directory / "random_states_0.pkl",
    )
    return Built(
        directory,
        {
            Site("optimizer.bin"): absent_entries(model, first, "index"),
            Site("optimizer_1.bin"): absent_entries(model, second, "index"),
        },
    )


def lightning(root: Path, optimizer: str = "adamw", steps: int = 3) -> Built:
    """Lightning's ``epoch=0-step=<steps>.ckpt``: ``net.``-prefixed weights, index keys."""
    module = LitWrapper(TwoHeadNet())
    r = run(module, optimizer=optimizer, steps=steps)
    checkpoint = {
        "epoch": 0,
        "global_step": steps,
        "pytorch-lightning_version": "2.5.0",
        "state_dict": module.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}},
        "callbacks": {},
        "optimizer_states": [r.optimizer.state_dict()],
        "lr_schedulers": [r.scheduler.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"hidden": 8, "lr": 1e-2},
    }
    path = single_file(root, f"epoch=0-step={steps}.ckpt", checkpoint)
    site = Site("", ("optimizer_states", 0))
    return Built(path, {site: absent_entries(module, r.optimizer, "index")})


def multi_optimizer(root: Path) -> Built:
    """``multi_optimizer.pt``: ``optimizers: {"actor": ..., "critic": ...}``, name-keyed."""
    actor = run(TwoHeadNet(seed=3), steps=2)
    critic = run(TwoHeadNet(hidden=5, seed=4), optimizer="adam", groups=2, steps=1)
    payload = {
        "models": {"actor": actor.model.state_dict(), "critic": critic.model.state_dict()},
        "optimizers": {
            "actor": get_optimizer_state_dict(actor.model, actor.optimizer),
            "critic": get_optimizer_state_dict(critic.model, critic.optimizer),
        },
        "step": 2,
    }
    path = single_file(root, "multi_optimizer.pt", payload)
    return Built(
        path,
        {
            Site("", ("optimizers", "actor")): absent_entries(actor.model, actor.optimizer, "name"),
            Site("", ("optimizers", "critic")): absent_entries(critic.model, critic.optimizer, "name"),
        },
    )


def legacy_format(root: Path, optimizer: str = "adamw") -> Built:
    """``legacy.pt``: the UniRL payload in torch's pre-1.6 (non-zip) serialization."""
    r = run(optimizer=optimizer)
    path = single_file(root, "legacy.pt", unirl_payload(r), legacy=True)
    return Built(path, {Site("", OPT_SITE): absent_entries(r.model, r.optimizer, "name")})


def bug_report(root: Path, steps: int = 2) -> Built:
    """The FINDINGS case: a LoRA run, UniRL layout, the 4 ``BUG_REPORT_MISSING`` entries absent."""
    model = BugReportNet()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    scheduler = LinearLR(opt, start_factor=0.5, total_iters=4)
    train(model, opt, steps, scheduler=scheduler)
    r = Run(model, opt, scheduler, steps)
    lora_config = {
        "r": 2,
        "lora_alpha": 4,
        "target_modules": [
            "to_q",
            "to_k",
            "to_v",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_out.0",
            "to_add_out",
            "net.2",
        ],
    }
    directory = root / f"checkpoint-{steps}"
    _write_unirl_dir(directory, unirl_payload(r, save_mode="lora", lora_config=lora_config), steps)
    return Built(directory, {Site("checkpoint.pt", OPT_SITE): absent_entries(model, opt, "name")})
