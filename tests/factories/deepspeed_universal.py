"""A DeepSpeed *universal* checkpoint written by DeepSpeed's own code on CPU, and resumed by its own loader.

``save(root)`` runs, in one spawned process (gloo, world size 1, DeepSpeed's CPU accelerator):

1. ``Net`` of ``tests.factories.fsdp`` (``body`` = ``nn.Linear(4, 6)``, ``head`` = ``nn.Linear(6, 3)``) wrapped
   by ``deepspeed.initialize`` with a client ``torch.optim.AdamW`` and ZeRO stage ``STAGE`` in fp32; ``PRE_STEPS``
   steps in which ``head`` takes no part in the forward pass (``HEAD``: the unused branch).
2. ``engine.save_checkpoint(root / "zero", tag=TAG)``: the ordinary ZeRO checkpoint
   (``zero/TAG/mp_rank_00_model_states.pt`` and ``zero/TAG/zero_pp_rank_0_mp_rank_00_optim_states.pt``).
3. The same run goes on for ``POST_STEPS`` steps with every parameter; its parameters are written to
   ``root / "uninterrupted.pt"`` as the reference a resume should reach.
4. DeepSpeed's converter, ``python -m deepspeed.checkpoint.ds_to_universal`` with ``--inject_missing_state``
   (a plain ``nn.Module`` records no ``universal_checkpoint_info``; the converter refuses without it), in a
   subprocess, writes ``root / "zero" / f"{TAG}_universal"`` and ``root / "zero" / "latest_universal"``.

``save`` returns the universal directory. ``resume(universal)`` builds a fresh engine with
``checkpoint={"load_universal": True}``, calls ``engine.load_checkpoint(parent, tag=name,
load_optimizer_states=True)``, trains ``POST_STEPS`` steps with every parameter and returns the parameters.

Measured (deepspeed 0.19.8, torch 2.13.0+cpu), stages 1 and 2 alike:

* Per parameter, ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` each hold ``{"cat_dim": 0, "param": Tensor}``
  (fp32, the parameter's shape) and ``step.pt`` a bare 0-dim float32 tensor (``3.0``); their pickles name only
  ``torch._utils._rebuild_tensor_v2``, ``torch.FloatStorage`` and ``collections.OrderedDict``.
  ``zero/optimizer_state.pt`` names ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` and
  ``deepspeed.runtime.zero.config.ZeroStageEnum`` (``torch.load(weights_only=True)`` refuses it).
* The unused ``head`` is NOT missing: ZeRO steps its flat partition with zero gradients, so it has all four files,
  ``exp_avg``/``exp_avg_sq`` all zeros, ``step`` 3 and ``fp32`` = initial value * (1 - lr * weight_decay) ** 3.
* ``frozen=True`` (``requires_grad=False``, outside the optimizer): ``zero/head.*/`` hold ``fp32.pt`` only,
  ``{"param": Tensor}`` without ``cat_dim`` (the converter's copy of the module state); no moments, no step.
* Resuming with ``load_universal`` works on CPU and reaches the uninterrupted run bit for bit (also into stage 1).
* ``deepspeed.init_distributed`` on the CPU accelerator JIT-compiles its shared-memory comm op
  (``deepspeed_shm_comm``, g++ and ninja, cached under ``~/.cache/torch_extensions``): the first ``save`` on a
  machine takes about 45 s, later ones about 7 s; ``resume`` about 5 s.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor

from tests.factories.fsdp import Net

__all__ = ["HEAD", "POST_STEPS", "PRE_STEPS", "STAGE", "TAG", "resume", "save", "uninterrupted"]

PRE_STEPS = 3
POST_STEPS = 3
STAGE = 2
TAG = "global_step3"
HEAD = ("head.weight", "head.bias")
"""The parameters that never got a gradient before the checkpoint."""
LR = 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _environment(port: int) -> dict[str, str]:
    return {
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }


def _config(stage: int, *, universal: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def _engine(stage: int, frozen: bool, *, universal: bool) -> Any:
    import deepspeed

    net = Net(0)
    net.head.requires_grad_(not frozen)
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR)
    config = _config(stage, universal=universal)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    return engine


def _train(engine: Any, steps: int, *, use_all: bool) -> None:
    generator = torch.Generator().manual_seed(1 if use_all else 0)
    for _ in range(steps):
        loss = engine(torch.randn(2, 4, generator=generator), use_all=use_all).square().sum()
        engine.backward(loss)
        engine.step()


def _parameters(engine: Any) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in engine.module.named_parameters()}


def _in_process(target: str, port: int, root: str, stage: int, frozen: bool) -> None:
    """The spawned child: DeepSpeed's environment, one gloo rank, then ``target``."""
    os.environ.update(_environment(port))
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    try:
        if target == "save":
            engine = _engine(stage, frozen, universal=False)
            _train(engine, PRE_STEPS, use_all=False)
            engine.save_checkpoint(str(Path(root) / "zero"), tag=TAG)
            _train(engine, POST_STEPS, use_all=True)
            torch.save(_parameters(engine), Path(root) / "uninterrupted.pt")
        else:
            universal = Path(root)
            engine = _engine(stage, frozen, universal=True)
            load_path, _ = engine.load_checkpoint(str(universal.parent), tag=universal.name, load_optimizer_states=True)
            assert load_path is not None, f"DeepSpeed loaded nothing from {universal}"
            torch.save(_parameters(engine), universal.parent.parent / "resumed-loaded.pt")
            _train(engine, POST_STEPS, use_all=True)
            torch.save(_parameters(engine), universal.parent.parent / "resumed.pt")
        engine.destroy()
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _spawn(target: str, root: Path, stage: int, frozen: bool) -> None:
    ctx = mp.get_context("spawn")
    process = ctx.Process(target=_in_process, args=(target, _free_port(), str(root), stage, frozen))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"DeepSpeed {target} process exited with {process.exitcode}")


def save(root: Path, *, stage: int = STAGE, frozen: bool = False) -> Path:
    """Train, save a ZeRO checkpoint and convert it with ``ds_to_universal``; the universal directory.

    ``frozen``: ``head`` has ``requires_grad=False`` (outside the optimizer) instead of being an unused branch.
    """
    if stage not in (1, 2):
        raise ValueError(f"ZeRO stage {stage}: only 1 and 2 are written here")
    root.mkdir(parents=True, exist_ok=True)
    _spawn("save", root, stage, frozen)
    zero = root / "zero"
    universal = zero / f"{TAG}_universal"
    env = {**os.environ, **_environment(_free_port())}
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(zero / TAG), "--output_folder", str(universal),
        "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return universal


def uninterrupted(universal: Path) -> dict[str, Tensor]:
    """The parameters of the run that was saved, ``POST_STEPS`` steps on without a break."""
    loaded: dict[str, Tensor] = torch.load(universal.parent.parent / "uninterrupted.pt", weights_only=True)
    return loaded


def resume(universal: Path, *, stage: int = STAGE, frozen: bool = False) -> dict[str, Tensor]:
    """DeepSpeed's own universal loader, then ``POST_STEPS`` steps; the parameters afterwards.

    ``stage`` and ``frozen`` as given to ``save`` (the stage may differ: the universal format is stage-free).
    """
    _spawn("resume", universal, stage, frozen)
    loaded: dict[str, Tensor] = torch.load(universal.parent.parent / "resumed.pt", weights_only=True)
    return loaded
