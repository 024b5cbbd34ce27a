"""FSDP checkpoints written by accelerate's own ``save_fsdp_model``/``save_fsdp_optimizer`` on two real gloo ranks
(CPU), and resumed through its own ``load_fsdp_model``/``load_fsdp_optimizer``.

The run is ``tests.factories.fsdp``'s: ``Net`` trains ``PRE_STEPS`` steps in which ``head`` gets no gradient, so
AdamW has no state for ``head.weight``/``head.bias``; the checkpoint is saved; the same run trains ``POST_STEPS``
steps with every parameter, and its parameters (``fsdp._local``: each rank's local shards for FSDP2, the full state
dict, on every rank, for FSDP1) are the uninterrupted reference.

``Accelerator(...)`` with an FSDP plugin refuses to run on CPU, so the four functions of
``accelerate.utils.fsdp_utils`` are called directly, in the order and with the arguments ``Accelerator.save_state``
and ``Accelerator.load_state`` use (model first, then optimizer, index 0, ``use_dcp=True``):

* ``fsdp_plugin`` is a real ``accelerate.FullyShardedDataParallelPlugin(fsdp_version=..., state_dict_type=...)``
  (its ``__post_init__`` runs on CPU as long as ``sync_module_states`` is off), one per save and one per resume, as
  a fresh process would have; the save functions mutate its ``state_dict_config`` (``offload_to_cpu`` and
  ``rank0_only`` for FULL_STATE_DICT with more than one process), so model and optimizer share one plugin.
* ``accelerator`` is ``_Ranks``, a stand-in with the only members these four functions read: ``process_index``,
  ``num_processes``, ``is_main_process``, ``is_fsdp2`` and ``wait_for_everyone()`` (a ``dist.barrier()``, as
  ``PartialState.wait_for_everyone`` is under torch.distributed). A real ``Accelerator`` cannot be built here.
* The model is sharded as accelerate's ``prepare`` leaves it. FSDP1: ``fsdp._fsdp1``, ``head`` wrapped by hand as
  its own unit and the root wrapped with ``FullyShardedDataParallel(net, device_id=cpu)``: accelerate's prepare
  does not re-wrap a model that is already an FSDP instance ("manual wrapping"), and ``use_orig_params=False`` is its
  default; it would pass ``backward_prefetch=None`` where ``_fsdp1`` keeps torch's default, which changes
  scheduling, not numbers. Without ``head`` as a unit of its own, FSDP1 with ``use_orig_params=False`` gives the
  one flat parameter a gradient and AdamW state covers ``head`` too (nothing would be missing). FSDP2:
  ``fsdp._fsdp2``, ``fully_shard(model)``, which is what ``fsdp2_prepare_model`` does for ``Net`` with accelerate's
  defaults (no auto-wrap policy, no embeddings or final norm, ``OffloadPolicy()``, ``MixedPrecisionPolicy()``).

Variants (each a directory laid out as ``save_state`` lays out its FSDP part; the RNG, scheduler and sampler files
it also writes are left out):

* ``fsdp1-sharded``: ``pytorch_model_fsdp_0/`` (DCP, ``model.<name>``) and ``optimizer_0/`` (DCP,
  ``optimizer.state.<name>.<field>``, ``optimizer.param_groups...``: ``FSDP.optim_state_dict`` under
  SHARDED_STATE_DICT). Measured: ``load_fsdp_optimizer`` reads no optimizer state from it into a fresh optimizer
  (its DCP template is ``FSDP.optim_state_dict`` of an optimizer without state: ``param_groups`` only).
* ``fsdp2-sharded``: ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (DCP, ``get_model_state_dict``/
  ``get_optimizer_state_dict``).
* ``fsdp2-full``: ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (``full_state_dict=True, cpu_offload=True``:
  only rank 0 holds, and saves, the state).

Not written: FSDP1 with FULL_STATE_DICT (``pytorch_model_fsdp.bin`` + ``optimizer.bin``). With more than one process
``save_fsdp_model`` forces ``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)``, and FSDP1 (torch 2.13)
cannot unshard with ``offload_to_cpu=True`` when its parameters already live on the CPU: rank 0 raises "setStorage:
sizes [24], strides [1], storage offset 0, and itemsize 4 requiring a storage size of 96 are out of bounds for
storage of size 0" in ``_unflatten_as_params`` and rank 1 waits in its all-gather until gloo times out (measured also
with ``rank0_only=False`` and without the nested ``head`` unit; ``use_orig_params=True`` segfaults instead). With
parameters on a GPU it presumably works (not checked here).

Also needed on CPU: accelerate's logger, which all four functions call, raises unless a ``PartialState`` exists, so
each gloo group is adopted by ``PartialState(cpu=True)`` (which finds the group already initialised and only reads
its rank and size). Resuming, each checkpoint gets a gloo group of its own with ``LOAD_TIMEOUT``: where the loaders
fail on one rank only (FSDP2 FULL_STATE_DICT, rank 0 before its broadcast), the other rank fails too, by a gloo
timeout (``LOAD_TIMEOUT``, about 10 s spent) or a closed connection, instead of hanging.
"""

from __future__ import annotations

import gc
import traceback
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
from torch.optim import Optimizer

from tests.factories.fsdp import HEAD, POST_STEPS, PRE_STEPS, WORLD, _fsdp1, _fsdp2, _local, _train

__all__ = ["HEAD", "POST_STEPS", "PRE_STEPS", "VARIANTS", "WORLD", "Saved", "resume", "save", "weights"]

VARIANTS: dict[str, tuple[int, str]] = {
    "fsdp1-sharded": (1, "SHARDED_STATE_DICT"),
    "fsdp2-sharded": (2, "SHARDED_STATE_DICT"),
    "fsdp2-full": (2, "FULL_STATE_DICT"),
}
"""Each variant's ``fsdp_version`` and ``state_dict_type``. FSDP1 with FULL_STATE_DICT is not among them: see the
module's docstring."""

LOAD_TIMEOUT = timedelta(seconds=10)
"""gloo's timeout while loading: where one rank's loader raises outside a collective and the other waits in one
(FSDP2 FULL_STATE_DICT: rank 0 raises before its broadcast), the waiting rank fails after this long instead of
hanging. Each resumed checkpoint gets a group of its own, so a timed-out group is never used again."""


@dataclass(frozen=True)
class _Ranks:
    """The members of an ``Accelerator`` that accelerate's four FSDP checkpoint functions read."""

    process_index: int
    num_processes: int
    is_fsdp2: bool

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    def wait_for_everyone(self) -> None:
        dist.barrier()


@contextmanager
def _group(rank: int, store: Path, timeout: timedelta) -> Iterator[None]:
    """The gloo group for one job, adopted by accelerate's ``PartialState``: its logger, which the four functions
    call, raises until a ``PartialState`` exists."""
    import os

    from accelerate import PartialState

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else it resets torch's threads
        state = PartialState(cpu=True)
        assert (state.process_index, state.num_processes) == (rank, WORLD), state
        yield
    finally:
        dist.destroy_process_group()


def _plugin(variant: str) -> Any:
    from accelerate import FullyShardedDataParallelPlugin

    version, state_dict_type = VARIANTS[variant]
    return FullyShardedDataParallelPlugin(fsdp_version=version, state_dict_type=state_dict_type)


def _build(variant: str, seed: int) -> tuple[nn.Module, Optimizer]:
    return _fsdp1(seed) if VARIANTS[variant][0] == 1 else _fsdp2(seed)


def weights(directory: Path, variant: str) -> Path:
    """Where the variant's model weights lie inside its checkpoint directory (``--model`` for ``fix``)."""
    full = VARIANTS[variant][1] == "FULL_STATE_DICT"
    return directory / ("pytorch_model_fsdp.bin" if full else "pytorch_model_fsdp_0")


def _save(rank: int, root: Path, variants: list[str]) -> None:
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    with _group(rank, root / "save.store", timedelta(seconds=120)):
        for variant in variants:
            plugin, ranks = _plugin(variant), _Ranks(rank, WORLD, VARIANTS[variant][0] == 2)
            model, opt = _build(variant, 0)
            _train(model, opt, rank, PRE_STEPS, use_all=False)
            save_fsdp_model(plugin, ranks, model, root / variant, 0)
            save_fsdp_optimizer(plugin, ranks, opt, model, root / variant, 0)
            _train(model, opt, rank, POST_STEPS, use_all=True)
            torch.save(_local(model), root / f"{variant}-uninterrupted-{rank}.pt")
        dist.barrier()  # no rank tears gloo down while the other still uses it


@dataclass(frozen=True)
class Saved:
    root: Path
    variants: tuple[str, ...]

    def checkpoint(self, variant: str) -> Path:
        return self.root / variant

    def weights(self, variant: str) -> Path:
        return weights(self.checkpoint(variant), variant)

    def uninterrupted(self, variant: str) -> list[dict[str, Tensor]]:
        """Each rank's parameters after the uninterrupted run."""
        return [
            torch.load(self.root / f"{variant}-uninterrupted-{rank}.pt", weights_only=True) for rank in range(WORLD)
        ]


def save(root: Path, variants: Sequence[str] = tuple(VARIANTS)) -> Saved:
    """Write each variant's checkpoint under ``root / variant`` and its uninterrupted reference, in one spawn."""
    mp.spawn(_save, args=(root, list(variants)), nprocs=WORLD)
    return Saved(root, tuple(variants))


def _job(rank: int, variant: str, directory: Path, trace: Path) -> Any:
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    plugin, ranks = _plugin(variant), _Ranks(rank, WORLD, VARIANTS[variant][0] == 2)
    model, opt = _build(variant, 7)
    try:  # as Accelerator.load_state: the model, then the optimizer
        load_fsdp_model(plugin, ranks, model, directory, 0)
        load_fsdp_optimizer(plugin, ranks, opt, model, directory, 0)
    except (Exception, CheckpointException) as exc:  # the loader's message is the result
        trace.write_text(traceback.format_exc())
        return f"{type(exc).__name__}: {exc}"
    _train(model, opt, rank, POST_STEPS, use_all=True)
    return _local(model)


def _resume(rank: int, work: Path, checkpoints: list[tuple[str, Path]]) -> None:
    found: dict[str, Any] = {}
    for job, (variant, directory) in enumerate(checkpoints):
        with _group(rank, work / f"resume-{job}.store", LOAD_TIMEOUT):
            result = _job(rank, variant, directory, work / f"traceback-{job}-{rank}.txt")
            # A failed loader's frames (reference cycles) hold the model, which holds the group: without this,
            # groups left half-dead by a one-sided failure aborted the process at exit ("terminate called without
            # an active exception", SIGABRT) in 3 of 8 runs; with it, in none of 8.
            gc.collect()
            if not isinstance(result, str):
                dist.barrier()  # no rank tears gloo down while the other still uses it
        found[str(directory)] = result
    torch.save(found, work / f"resumed-{rank}.pt")


def resume(work: Path, checkpoints: Sequence[tuple[str, Path]]) -> list[dict[str, Any]]:
    """For each rank: each ``(variant, checkpoint directory)``, by the directory's path, mapped to the parameters
    (as in ``Saved.uninterrupted``) after accelerate's loaders and ``POST_STEPS`` more steps, or to
    ``"<ExceptionType>: <message>"`` of what the loaders raised (its traceback in ``work``)."""
    work.mkdir()
    mp.spawn(_resume, args=(work, list(checkpoints)), nprocs=WORLD)
    return [torch.load(work / f"resumed-{rank}.pt", weights_only=True) for rank in range(WORLD)]
