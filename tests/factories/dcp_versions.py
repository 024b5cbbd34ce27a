"""DCP checkpoints as other torch versions and libraries write them, made with the installed torch.

* ``as_torch_215``: torch 2.15 adds a sixth field, ``strides`` (the saved tensor's ``stride()``), to
  ``TensorProperties``, pickled under the same module and class name. On a torch before 2.15 the real
  ``dcp.save`` output's ``.metadata`` is pickled again with that field, as 2.15's ``__getstate__`` gives it;
  a torch that has the field already wrote it. ``torch_215_properties`` makes the installed torch read (and
  write) ``TensorProperties`` as 2.15 does, with 2.15's own ``__getstate__`` and ``__setstate__``.
* ``torchao_dcp``: torchao's 8-bit AdamW, whose state for parameters of 4096 elements or more is the tensor
  subclass ``OptimState8bit``, saved with stock ``dcp.save``: those chunks are ``torch.save`` archives of
  the subclass's 8-bit codes, fewer bytes than the float32 tensor the metadata describes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_saver import save

from optim_repair.records.dtypes import contiguous_strides
from tests.factories.built import Built, Site

TensorProperties = dcp_metadata.TensorProperties
HAS_STRIDES = "strides" in {field.name for field in dataclasses.fields(TensorProperties)}
"""Whether the installed torch's ``TensorProperties`` has 2.15's ``strides``."""


def _getstate(self: Any) -> tuple[Any, ...]:
    """torch 2.15's ``TensorProperties.__getstate__`` (the five fields of the torch before it for an object
    without ``strides``, for a test that mixes the two)."""
    encoding = dcp_metadata._MEM_FORMAT_ENCODING
    formats = {
        torch.contiguous_format: encoding.TORCH_CONTIGUOUS_FORMAT,
        torch.channels_last: encoding.TORCH_CHANNELS_LAST,
        torch.preserve_format: encoding.TORCH_PRESERVE_FORMAT,
    }
    five = (self.dtype, self.layout, self.requires_grad, formats[self.memory_format], self.pin_memory)
    return (*five, self.strides) if hasattr(self, "strides") else five


def _setstate(self: Any, state: tuple[Any, ...]) -> None:
    """torch 2.15's ``TensorProperties.__setstate__``: five fields (``strides`` None) or six."""
    if len(state) == 5:
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        self.strides = None
    else:
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory, self.strides = state
    codes = dcp_metadata._MEM_FORMAT_ENCODING
    self.memory_format = {
        codes.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
        codes.TORCH_CHANNELS_LAST: torch.channels_last,
        codes.TORCH_PRESERVE_FORMAT: torch.preserve_format,
    }[encoding]


@contextlib.contextmanager
def torch_215_properties() -> Iterator[None]:
    """Within it, the installed torch pickles and unpickles ``TensorProperties`` as torch 2.15 does."""
    if HAS_STRIDES:
        yield
        return
    saved = TensorProperties.__getstate__, TensorProperties.__setstate__
    TensorProperties.__getstate__, TensorProperties.__setstate__ = _getstate, _setstate
    try:
        yield
    finally:
        TensorProperties.__getstate__, TensorProperties.__setstate__ = saved


def as_torch_215(path: Path) -> Path:
    """The DCP checkpoint at ``path`` with its ``.metadata`` as torch 2.15 writes it: every ``TensorProperties``
    with the strides of the (contiguous) tensor that was saved."""
    if HAS_STRIDES:
        return path
    with (path / ".metadata").open("rb") as stream:
        metadata = pickle.load(stream)
    for item in metadata.state_dict_metadata.values():
        if isinstance(item, dcp_metadata.TensorStorageMetadata):
            item.properties.strides = contiguous_strides(tuple(item.size))
    with torch_215_properties(), (path / ".metadata").open("wb") as stream:
        pickle.dump(metadata, stream)
    return path


def property_states(path: Path) -> dict[str, tuple[Any, ...]]:
    """Each tensor entry's ``TensorProperties`` state, as the ``.metadata`` at ``path`` pickled it."""
    pickled: dict[int, tuple[Any, ...]] = {}

    def record(self: Any, state: tuple[Any, ...]) -> None:
        pickled[id(self)] = state
        _setstate(self, state)

    saved = TensorProperties.__setstate__
    TensorProperties.__setstate__ = record
    try:
        with (path / ".metadata").open("rb") as stream:
            metadata = pickle.load(stream)
    finally:
        TensorProperties.__setstate__ = saved
    items = metadata.state_dict_metadata.items()
    return {
        key: pickled[id(item.properties)] for key, item in items if isinstance(item, dcp_metadata.TensorStorageMetadata)
    }


class QuantizedNet(nn.Module):
    """A ``Linear(64, 128)`` (8192 elements: torchao keeps 8-bit state for it) and a small ``head`` that gets no
    gradient before the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.body = nn.Linear(64, 128)
            self.head = nn.Linear(128, 2)

    def forward(self, x: torch.Tensor, use_all: bool = False) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(self.body(x))
        return self.head(out) if use_all else out


def torchao_dcp(root: Path) -> Built:
    """``model`` and ``optim`` after two steps of torchao's ``AdamW8bit`` with ``head`` unused, by ``dcp.save``."""
    from torchao.optim import AdamW8bit

    model = QuantizedNet()
    optimizer = AdamW8bit(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(3, 64, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    path = root / "checkpoint-2"
    save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
        checkpoint_id=path,
    )
    return Built(path, {Site("", ("optim",)): ("head.weight", "head.bias")})
