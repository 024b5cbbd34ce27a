"""Real checkpoints for tests: tiny torch models, real optimizers, saved the way trainers save them.

Every factory takes a directory (pytest's ``tmp_path``), writes inside it and returns a
:class:`Built`:

* ``Built.path`` is what a user would point the tool at: a checkpoint directory
  (``checkpoint-3/``) or a single file (``healthy.pt``).
* ``Built.missing`` maps each optimizer state dict written (a :class:`Site`: a file relative to
  ``path``, ``""`` when ``path`` is the file, and the keys leading to the state dict inside it)
  to the parameter keys whose ``state`` entry is absent although the optimizer would create one
  on a step. Keys are names (``"head_unused.weight"``) in name-keyed state dicts
  (``get_optimizer_state_dict``) and integers in index-keyed ones (``optimizer.state_dict()``).
  Every optimizer written appears, with ``()`` when nothing is missing.
* ``Built.defects`` lists, per site, the parameters whose entry (or listing) was made wrong on
  purpose: ``{}`` entries, phantom-step entries, malformed entries, duplicated or orphan names.

Nothing here is mocked: models are trained for a few real steps with real optimizers, and
files are written with ``torch.save`` / ``safetensors`` exactly as the named trainers do.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import shlex
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import TensorSpec, serialize_file
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LambdaLR, LinearLR

from tests.models import (
    BugReportNet,
    LitWrapper,
    ParamKey,
    Run,
    TrickyNet,
    TwoHeadNet,
    absent_entries,
    all_keys,
    make_optimizer,
    run,
    train,
)

StateDict = dict[str, Any]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Site:
    """Where one optimizer state dict lies: a file under ``Built.path`` and the keys to it."""

    file: str = ""
    """Path relative to ``Built.path`` with ``/`` separators; ``""`` when ``path`` is the file."""
    address: tuple[ParamKey, ...] = ()
    """Dict keys and list indices from the loaded object to the state dict; ``()``: top level."""

    @property
    def location(self) -> str:
        """The address for humans: ``optimizer_states[0]``, ``optimizers.actor``, ``""``."""
        text = ""
        for part in self.address:
            if isinstance(part, int):
                text += f"[{part}]"
            else:
                text += f".{part}" if text else part
        return text


@dataclass(frozen=True)
class Built:
    """A checkpoint a factory wrote, and what is known to be wrong with it."""

    path: Path
    missing: Mapping[Site, tuple[ParamKey, ...]]
    defects: Mapping[Site, tuple[ParamKey, ...]] = field(default_factory=dict)

    @property
    def sites(self) -> tuple[Site, ...]:
        """Every optimizer state dict written."""
        return tuple(self.missing)

    @property
    def site(self) -> Site:
        """The only optimizer state dict written (raises when there are several)."""
        if len(self.missing) != 1:
            raise ValueError(f"{len(self.missing)} optimizer sites, not one")
        return next(iter(self.missing))

    @property
    def all_missing(self) -> tuple[ParamKey, ...]:
        """Missing keys of every site, concatenated in site order."""
        return tuple(key for keys in self.missing.values() for key in keys)

    def file(self, site: Site | None = None) -> Path:
        """The file holding ``site`` (default: the only site)."""
        site = self.site if site is None else site
        return self.path / site.file if site.file else self.path

    def load(self, site: Site | None = None) -> StateDict:
        """The optimizer state dict at ``site``, read with ``torch.load(weights_only=True)``."""
        site = self.site if site is None else site
        obj: Any = torch.load(self.file(site), map_location="cpu", weights_only=True)
        for part in site.address:
            obj = obj[part]
        if not isinstance(obj, dict):
            raise TypeError(f"{site.location!r} is a {type(obj).__name__}")
        return obj


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


def _single_file(root: Path, name: str, payload: StateDict, legacy: bool = False) -> Path:
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
    path = _single_file(root, f"epoch=0-step={steps}.ckpt", checkpoint)
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
    path = _single_file(root, "multi_optimizer.pt", payload)
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
    path = _single_file(root, "legacy.pt", unirl_payload(r), legacy=True)
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


# --------------------------------------------------------------------------- optimizer states


def healthy(root: Path, optimizer: str = "adamw", groups: int = 1) -> Built:
    """``healthy.pt``: UniRL payload where every param was trained (nothing missing)."""
    r = run(optimizer=optimizer, groups=groups, use_all=True)
    path = _single_file(root, "healthy.pt", unirl_payload(r))
    return Built(path, {Site("", OPT_SITE): absent_entries(r.model, r.optimizer, "name")})


def cold(root: Path, optimizer: str = "adamw") -> Built:
    """``cold.pt``: a never-stepped ``optimizer.state_dict()`` (``state == {}``), index-keyed."""
    model = TwoHeadNet()
    opt = make_optimizer(model, optimizer)
    path = _single_file(root, "cold.pt", opt.state_dict())
    return Built(path, {Site(): absent_entries(model, opt, "index")})


def phantom_step(root: Path, optimizer: str = "adamw") -> Built:
    """``phantom_step.pt``: ``get_optimizer_state_dict`` of a never-stepped optimizer.

    torch runs a fake step first, so every entry exists with ``step == 1`` and zero moments; all
    of them are listed in ``defects``.
    """
    model = TwoHeadNet()
    opt = make_optimizer(model, optimizer)
    scheduler = LinearLR(opt, start_factor=0.5, total_iters=4)
    payload = unirl_payload(Run(model, opt, scheduler, 0))
    path = _single_file(root, "phantom_step.pt", payload)
    site = Site("", OPT_SITE)
    return Built(path, {site: ()}, {site: all_keys(model, opt, "name")})


def empty_entries(root: Path, optimizer: str = "adamw") -> Built:
    """``empty_entries.pt``: name-keyed, the absent entries filled with ``{}`` (the naive fix)."""
    r = run(optimizer=optimizer)
    payload = unirl_payload(r)
    absent = absent_entries(r.model, r.optimizer, "name")
    state = payload["optimizer_state_dict"]["state"]
    for name in absent:
        state[name] = {}
    payload["optimizer_state_dict"]["state"] = {k: state[k] for k in all_keys(r.model, r.optimizer, "name")}
    path = _single_file(root, "empty_entries.pt", payload)
    site = Site("", OPT_SITE)
    return Built(path, {site: ()}, {site: absent})


# --------------------------------------------------------------------------- malformed

Edit = Callable[[StateDict], tuple[ParamKey, ...]]


def _malformed(root: Path, name: str, edit: Edit, groups: int = 1) -> Built:
    r = run(groups=groups)
    payload = unirl_payload(r)
    payload["optimizer_state_dict"] = copy.deepcopy(payload["optimizer_state_dict"])
    defects = edit(payload["optimizer_state_dict"])
    path = _single_file(root, f"{name}.pt", payload)
    site = Site("", OPT_SITE)
    return Built(path, {site: absent_entries(r.model, r.optimizer, "name")}, {site: defects})


def partial_state(root: Path) -> Built:
    """``partial_state.pt``: the ``trunk.bias`` entry lacks ``exp_avg_sq``."""

    def edit(sd: StateDict) -> tuple[ParamKey, ...]:
        del sd["state"]["trunk.bias"]["exp_avg_sq"]
        return ("trunk.bias",)

    return _malformed(root, "partial_state", edit)


def orphan_state(root: Path) -> Built:
    """``orphan_state.pt``: a state entry for ``ghost.weight``, a name in no group."""

    def edit(sd: StateDict) -> tuple[ParamKey, ...]:
        sd["state"]["ghost.weight"] = copy.deepcopy(sd["state"]["trunk.weight"])
        return ("ghost.weight",)

    return _malformed(root, "orphan_state", edit)


def duplicate_param(root: Path) -> Built:
    """``duplicate_param.pt``: two groups, ``trunk.weight`` listed in both."""

    def edit(sd: StateDict) -> tuple[ParamKey, ...]:
        sd["param_groups"][1]["params"].append("trunk.weight")
        return ("trunk.weight",)

    return _malformed(root, "duplicate_param", edit, groups=2)


def bad_entry_not_mapping(root: Path, kind: Literal["list", "float"] = "list") -> Built:
    """``bad_entry_not_mapping_<kind>.pt``: the ``trunk.bias`` entry is a list or a float."""

    def edit(sd: StateDict) -> tuple[ParamKey, ...]:
        entry = sd["state"]["trunk.bias"]
        sd["state"]["trunk.bias"] = list(entry.values()) if kind == "list" else 0.5
        return ("trunk.bias",)

    return _malformed(root, f"bad_entry_not_mapping_{kind}", edit)


def bad_entry_moment_not_tensor(root: Path) -> Built:
    """``bad_entry_moment_not_tensor.pt``: ``trunk.weight``'s ``exp_avg`` is a float."""

    def edit(sd: StateDict) -> tuple[ParamKey, ...]:
        sd["state"]["trunk.weight"]["exp_avg"] = 0.25
        return ("trunk.weight",)

    return _malformed(root, "bad_entry_moment_not_tensor", edit)


def shape_mismatch(root: Path) -> Built:
    """``shape_mismatch.pt``: ``trunk.weight``'s ``exp_avg_sq`` has shape (3, 3), not (8, 4)."""

    def edit(sd: StateDict) -> tuple[ParamKey, ...]:
        sd["state"]["trunk.weight"]["exp_avg_sq"] = torch.full((3, 3), 1e-4)
        return ("trunk.weight",)

    return _malformed(root, "shape_mismatch", edit)


MALFORMED: dict[str, Callable[[Path], Built]] = {
    "partial_state": partial_state,
    "orphan_state": orphan_state,
    "duplicate_param": duplicate_param,
    "bad_entry_not_mapping_list": lambda root: bad_entry_not_mapping(root, "list"),
    "bad_entry_not_mapping_float": lambda root: bad_entry_not_mapping(root, "float"),
    "bad_entry_moment_not_tensor": bad_entry_moment_not_tensor,
    "shape_mismatch": shape_mismatch,
}
"""Every malformed variant by name; each writes ``<root>/<name>.pt``."""


# --------------------------------------------------------------------------- tricky tensors

NAN_BITS_F32: tuple[int, ...] = (0x7FC00001, 0xFFC12345)
"""Non-default float32 NaN payloads written into ``head_used.weight``'s ``exp_avg``."""
NEG_ZERO_F32 = 0x80000000
NAN_BITS_BF16 = 0x7FC1
NAN_BITS_F16 = 0x7E01


def _as_signed(bits: int, width: int) -> int:
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def _poke(t: Tensor, int_dtype: torch.dtype, width: int, values: Sequence[int]) -> Tensor:
    """A copy of ``t`` with its first elements set bit-exactly to ``values``."""
    out = t.clone()
    bits = out.view(int_dtype).view(-1)
    bits[: len(values)] = torch.tensor([_as_signed(v, width) for v in values], dtype=int_dtype)
    return out


def tricky_tensors(root: Path) -> Built:
    """``tricky_tensors.pt``: name-keyed AdamW state with tensors that are easy to disturb.

    Present entries hold: bf16/fp16 moments (real, from bf16/fp16 params), complex64 moments,
    a zero-size param's moments, NaNs with payloads ``NAN_BITS_*`` and ``-0.0`` (first elements of
    ``head_used.weight``'s ``exp_avg`` / ``exp_avg_sq``, ``gain_bf16``'s and ``gain_fp16``'s
    ``exp_avg``), a transposed (non-contiguous) ``trunk.weight`` ``exp_avg``, and ``trunk.bias``'s
    two moments as views of one storage. Missing: ``head_unused.*``, ``spectral_unused``
    (complex64), ``void_unused`` (zero-size), ``gain_bf16_unused`` (bf16).
    """
    model = TrickyNet()
    r = run(model)
    payload = unirl_payload(r)
    sd = copy.deepcopy(payload["optimizer_state_dict"])
    state = sd["state"]
    i32, i16 = torch.int32, torch.int16
    hw = state["head_used.weight"]
    hw["exp_avg"] = _poke(hw["exp_avg"], i32, 32, [*NAN_BITS_F32, NEG_ZERO_F32])
    hw["exp_avg_sq"] = _poke(hw["exp_avg_sq"], i32, 32, [NEG_ZERO_F32])
    state["gain_bf16"]["exp_avg"] = _poke(state["gain_bf16"]["exp_avg"], i16, 16, [NAN_BITS_BF16, 0x8000])
    state["gain_fp16"]["exp_avg"] = _poke(state["gain_fp16"]["exp_avg"], i16, 16, [NAN_BITS_F16, 0x8000])
    tw = state["trunk.weight"]
    tw["exp_avg"] = tw["exp_avg"].t().contiguous().t()
    tb = state["trunk.bias"]
    n = tb["exp_avg"].numel()
    shared = torch.cat([tb["exp_avg"], tb["exp_avg_sq"]])
    tb["exp_avg"], tb["exp_avg_sq"] = shared[:n], shared[n:]
    payload["optimizer_state_dict"] = sd
    path = _single_file(root, "tricky_tensors.pt", payload)
    return Built(path, {Site("", OPT_SITE): absent_entries(model, r.optimizer, "name")})


# --------------------------------------------------------------------------- unsafe pickles


class ShellOnLoad:
    """Pickles as ``os.system(command)``: unpickling it runs the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return (os.system, (self.command,))


def _unsafe(root: Path, marker: Path, name: str, legacy: bool) -> Built:
    r = run()
    payload = unirl_payload(r)
    payload["callback"] = ShellOnLoad(f"touch {shlex.quote(str(marker))}")
    path = _single_file(root, name, payload, legacy=legacy)
    return Built(path, {Site("", OPT_SITE): absent_entries(r.model, r.optimizer, "name")})


def unsafe_pickle(root: Path, marker: Path) -> Built:
    """``unsafe.pt``: a sparse UniRL payload that runs ``touch <marker>`` if unpickled."""
    return _unsafe(root, marker, "unsafe.pt", legacy=False)


def unsafe_legacy_pickle(root: Path, marker: Path) -> Built:
    """``unsafe_legacy.pt``: ``unsafe_pickle`` in the legacy (non-zip) serialization."""
    return _unsafe(root, marker, "unsafe_legacy.pt", legacy=True)


# --------------------------------------------------------------------------- registry

FACTORIES: dict[str, Callable[[Path], Built]] = {
    "unirl_torch": unirl_torch,
    "petrainer": petrainer,
    "hf_trainer": hf_trainer,
    "accelerate": accelerate,
    "lightning": lightning,
    "multi_optimizer": multi_optimizer,
    "legacy_format": legacy_format,
    "bug_report": bug_report,
    "healthy": healthy,
    "cold": cold,
    "phantom_step": phantom_step,
    "empty_entries": empty_entries,
    "tricky_tensors": tricky_tensors,
    **MALFORMED,
}
"""Every factory that needs only a directory, by name."""


def iter_files(built: Built) -> Iterator[Path]:
    """Every file under ``built.path`` (or the file itself), sorted."""
    if built.path.is_file():
        yield built.path
        return
    yield from sorted(p for p in built.path.rglob("*") if p.is_file())
