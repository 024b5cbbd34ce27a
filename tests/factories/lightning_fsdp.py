"""A sharded FSDP checkpoint written by PyTorch Lightning's own ``Trainer`` and ``FSDPStrategy`` on two real gloo
ranks (CPU), and resumed through Lightning's own ``Trainer.fit(..., ckpt_path=...)``.

The run is ``tests.factories.fsdp``'s: ``Net``'s ``body`` and ``head`` (same seed, same layers, same ``forward``)
train ``PRE_STEPS`` steps in which ``head`` gets no gradient, so AdamW has no state for ``head.weight``/``head.bias``;
the checkpoint is saved; the same run trains ``POST_STEPS`` steps with every parameter, and its parameters are the
uninterrupted reference. Each rank draws its inputs as ``tests.factories.fsdp._train`` does (a generator seeded
``100 * rank + use_all``, fresh when the phase starts), so a resumed run sees the inputs the uninterrupted one saw.

What Lightning does here, unchanged:

* ``Trainer(strategy=..., accelerator="cpu", devices=2, max_steps=PRE_STEPS + POST_STEPS).fit(module)``: Lightning's
  own ``FSDPStrategy.setup`` wraps the ``LightningModule`` with ``FullyShardedDataParallel`` (its default
  ``use_orig_params=True``, ``FULL_SHARD``, ``FSDPPrecision("32-true")``), with ``auto_wrap_policy={nn.Linear}``
  (Lightning's set-of-layer-classes form) so that ``body`` and ``head`` are FSDP units of their own: were ``head``
  in ``body``'s flat parameter, FSDP would give it a zero gradient and AdamW state would cover it (nothing would be
  missing). Lightning's automatic optimization runs one ``AdamW`` from ``configure_optimizers``.
* Saving: a callback calls ``trainer.save_checkpoint(path)`` after step ``PRE_STEPS`` (what ``ModelCheckpoint``
  calls), so ``FSDPStrategy.lightning_module_state_dict``/``optimizer_state`` (``FSDP.optim_state_dict`` under
  SHARDED_STATE_DICT) and ``FSDPStrategy.save_checkpoint`` (``state_dict_type="sharded"``: ``dcp.save`` of
  ``{"model": ..., "optimizer_0": ...}`` and rank 0's ``torch.save`` of everything else as ``meta.pt``) write it.
* Resuming: a fresh module (``Net(7)`` weights) and a fresh ``Trainer``, ``fit(module, ckpt_path=directory)``:
  ``FSDPStrategy.load_checkpoint`` loads the model through ``dcp.load`` and the optimizer through
  ``load_sharded_optimizer_state_dict`` + ``FSDP.optim_state_dict_to_load`` + ``optimizer.load_state_dict``,
  then the loops resume from ``meta.pt`` (global step ``PRE_STEPS``) and train ``POST_STEPS`` more steps.

Stand-ins, only what CPU needs:

* ``CPUFSDPStrategy``, a subclass of ``FSDPStrategy``, for two reasons. Lightning's accelerator connector raises
  "The strategy `fsdp` requires a GPU accelerator" when ``type(strategy) is FSDPStrategy`` and the accelerator is
  not CUDA; a subclass is not checked. And Lightning's ``_setup_model`` builds ``FullyShardedDataParallel(...,
  device_id=self.root_device.index)``, which is ``None`` on CPU, and torch 2.13's FSDP then raises "FSDP needs a
  non-CPU accelerator device, but no accelerator device is detected". So the subclass's ``_setup_model`` makes
  Lightning's own constructor call (its ``cpu_offload``, ``mixed_precision``, ``sharding_strategy`` and ``kwargs``:
  ``use_orig_params=True`` and the auto-wrap policy) with ``device_id=torch.device("cpu")`` instead, then hands the
  wrapped model to Lightning's ``_setup_model``, which takes its path for a model already wrapped (torchmetrics,
  activation checkpointing). Everything else (setup, optimizer handling, state dicts, saving, loading) is
  Lightning's.
* The gloo group is created before the ``Trainer`` (``init_process_group("gloo", init_method="file://...")``, as
  ``tests.factories.fsdp`` does), with ``LOCAL_RANK`` set so that Lightning's ``LightningEnvironment`` treats the
  processes as launched externally (no launcher of its own); Lightning's ``_init_dist_connection`` finds the group
  initialised and adopts it. Each resumed checkpoint gets a group of its own with ``LOAD_TIMEOUT``.
* The data loader yields ``PRE_STEPS + POST_STEPS`` placeholder batches that ``training_step`` ignores (the inputs
  come from the per-rank generators above); logger, progress bar, model summary and checkpointing callbacks are off.

The uninterrupted reference and each resumed run's result are the full state dict (FSDP's default
FULL_STATE_DICT, ``rank0_only=False``, no CPU offload: every rank holds it), taken in ``on_train_end``.
"""

from __future__ import annotations

import gc
import os
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from tests.factories.fsdp import HEAD, POST_STEPS, PRE_STEPS, WORLD, Net

__all__ = ["HEAD", "POST_STEPS", "PRE_STEPS", "WORLD", "Saved", "resume", "save"]

CHECKPOINT = "lightning"
"""The checkpoint directory's name under ``save``'s root."""

LOAD_TIMEOUT = timedelta(seconds=20)
"""gloo's timeout while resuming: where one rank's loader fails and the other waits in a collective, the waiting
rank fails after this long instead of hanging."""


def _module(seed: int) -> Any:
    import pytorch_lightning as pl

    class LitNet(pl.LightningModule):
        """``Net``'s layers and forward, trained with Lightning's automatic optimization."""

        def __init__(self) -> None:
            super().__init__()
            net = Net(seed)
            self.body, self.head = net.body, net.head
            self._inputs: dict[bool, torch.Generator] = {}
            self.final: dict[str, Tensor] | None = None

        def forward(self, x: Tensor, use_all: bool = False) -> Tensor:
            return Net.forward(self, x, use_all)  # type: ignore[arg-type]

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            use_all = self.trainer.global_step >= PRE_STEPS
            if use_all not in self._inputs:  # as tests.factories.fsdp._train: fresh when the phase starts
                self._inputs[use_all] = torch.Generator().manual_seed(100 * self.global_rank + (1 if use_all else 0))
            loss: Tensor = self(torch.randn(2, 4, generator=self._inputs[use_all]), use_all).square().sum()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(PRE_STEPS + POST_STEPS)))

    return LitNet()


def _trainer(callbacks: list[Any]) -> Any:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning's ``FSDPStrategy``, run on CPU: see the module's docstring."""

        def _setup_model(self, model: nn.Module) -> nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            wrapped = FullyShardedDataParallel(  # Lightning's own call, with device_id on the CPU
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            self.kwargs.pop("auto_wrap_policy")  # applied above; Lightning's own method would warn and drop it
            return super()._setup_model(wrapped)  # Lightning's path for an already-wrapped model

    class Final(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            assert trainer.strategy.model is not None
            pl_module.final = {k: v.detach().clone() for k, v in trainer.strategy.model.state_dict().items()}

    strategy = CPUFSDPStrategy(state_dict_type="sharded", auto_wrap_policy={nn.Linear}, process_group_backend="gloo")
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD,
        num_nodes=1,
        max_steps=PRE_STEPS + POST_STEPS,
        callbacks=[*callbacks, Final()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )


@contextmanager
def _group(rank: int, store: Path, timeout: timedelta) -> Iterator[None]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, mid-epoch resume) is noise here
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _save(rank: int, root: Path) -> None:
    import pytorch_lightning as pl

    class SaveAfterPre(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == PRE_STEPS:
                trainer.save_checkpoint(root / CHECKPOINT)  # what ModelCheckpoint calls

    with _group(rank, root / "save.store", timedelta(seconds=120)):
        module = _module(0)
        _trainer([SaveAfterPre()]).fit(module)
        assert module.final is not None
        torch.save(module.final, root / f"uninterrupted-{rank}.pt")
        dist.barrier()  # no rank tears gloo down while the other still uses it


@dataclass(frozen=True)
class Saved:
    root: Path

    @property
    def checkpoint(self) -> Path:
        """The sharded checkpoint directory Lightning wrote (``.metadata``, ``__*.distcp``, ``meta.pt``)."""
        return self.root / CHECKPOINT

    def uninterrupted(self) -> list[dict[str, Tensor]]:
        """Each rank's full state dict after the uninterrupted run."""
        return [torch.load(self.root / f"uninterrupted-{rank}.pt", weights_only=True) for rank in range(WORLD)]


def save(root: Path) -> Saved:
    """Write Lightning's sharded checkpoint under ``root / "lightning"`` and the uninterrupted reference, in one
    spawn."""
    mp.spawn(_save, args=(root,), nprocs=WORLD)
    return Saved(root)


def _job(directory: Path, trace: Path) -> Any:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    module = _module(7)
    try:
        _trainer([]).fit(module, ckpt_path=directory)
    except (Exception, CheckpointException) as exc:  # the loader's message is the result
        trace.write_text(traceback.format_exc())
        return f"{type(exc).__name__}: {exc}"
    assert module.final is not None
    return module.final


def _resume(rank: int, work: Path, checkpoints: list[Path]) -> None:
    found: dict[str, Any] = {}
    for job, directory in enumerate(checkpoints):
        with _group(rank, work / f"resume-{job}.store", LOAD_TIMEOUT):
            result = _job(directory, work / f"traceback-{job}-{rank}.txt")
            gc.collect()  # a failed loader's frames hold the model, which holds the group
            if not isinstance(result, str):
                dist.barrier()  # no rank tears gloo down while the other still uses it
        found[str(directory)] = result
    torch.save(found, work / f"resumed-{rank}.pt")


def resume(work: Path, checkpoint_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """For each rank: each checkpoint directory, by its path, mapped to the full state dict after Lightning's
    ``fit(ckpt_path=...)`` resumed it and trained ``POST_STEPS`` more steps (as in ``Saved.uninterrupted``), or to
    ``"<ExceptionType>: <message>"`` of what Lightning's loading raised (its traceback in ``work``)."""
    work.mkdir()
    mp.spawn(_resume, args=(work, list(checkpoint_dirs)), nprocs=WORLD)
    return [torch.load(work / f"resumed-{rank}.pt", weights_only=True) for rank in range(WORLD)]
