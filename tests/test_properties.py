"""Properties, with hypothesis: fixing never changes a byte of an existing tensor, and fixing is idempotent."""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from optim_repair.formats.torchfile.verifier import verify_torch_file
from tests.factories import models
from tests.factories.support import assert_copy_faithful, fix, load

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.complex64,
    torch.int64,
    torch.uint8,
    torch.bool,
]
SPECIAL_FLOATS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-40, 65504.0, 3.0e38]

PROPERTY_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def _trained(key_style: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A real AdamW state (``head_unused.*`` absent) and its model's weights."""
    r = models.run(steps=2)
    sd = get_optimizer_state_dict(r.model, r.optimizer) if key_style == "name" else r.optimizer.state_dict()
    return sd, r.model.state_dict()


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any bit pattern: NaN payloads, signed zeros, subnormals; any layout."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    numel = 1
    for size in shape:
        numel *= size
    itemsize = torch.empty((), dtype=dtype).element_size()
    if draw(st.booleans()) and dtype.is_floating_point:
        values = draw(st.lists(st.sampled_from(SPECIAL_FLOATS), min_size=numel, max_size=numel))
        base = torch.tensor(values, dtype=torch.float64).to(dtype) if numel else torch.zeros(0, dtype=dtype)
    else:
        raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
        base = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.zeros(0, dtype=dtype)
        if dtype == torch.bool:
            base = base.view(torch.uint8).clamp(max=1).view(torch.bool)
    tensor = base.reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    if layout == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    elif layout == "sliced" and tensor.dim() >= 1 and tensor.shape[0] > 1:
        tensor = tensor[1:]
    return tensor


@st.composite
def checkpoints(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """A real optimizer state with random tensors beside it, inside it, and sharing storages."""
    key_style = draw(st.sampled_from(["name", "index"]))
    sd, weights = _trained(key_style)
    sd = copy.deepcopy(sd)
    extra = draw(st.dictionaries(st.text(min_size=1, max_size=6), tensors(), max_size=5))
    shared = draw(tensors())
    if shared.dim() >= 1 and shared.shape[0] > 1:
        extra["shared_a"], extra["shared_b"] = shared[:1], shared[1:]
    # random values in the optimizer's own entries, keeping the structure valid
    for entry in sd["state"].values():
        moment = entry["exp_avg"]
        if draw(st.booleans()):
            raw = draw(st.binary(min_size=moment.numel() * 4, max_size=moment.numel() * 4))
            entry["exp_avg"] = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(moment.shape).clone()
    payload = {
        "model": dict(weights),
        "optimizer": sd,
        "extra": extra,
        "meta": {"lr": draw(st.floats(allow_nan=True)), "betas": (0.9, draw(st.floats(allow_nan=False)))},
    }
    return payload, draw(st.booleans())


@PROPERTY_SETTINGS
@given(checkpoints())
def test_fixing_never_changes_a_byte_of_an_existing_tensor(example: tuple[dict[str, Any], bool]) -> None:
    payload, legacy = example
    with tempfile.TemporaryDirectory() as directory:
        src, out = Path(directory) / "in.pt", Path(directory) / "out.pt"
        torch.save(payload, src, _use_new_zipfile_serialization=not legacy)
        result = fix(src, out)
        added = {a.param for a in result.plan.additions}
        assert len(added) == 2, "head_unused.weight and .bias, by name or index"
        assert_copy_faithful(load(src), load(out), {("optimizer", "state"): added})


@PROPERTY_SETTINGS
@given(checkpoints())
def test_fix_is_idempotent(example: tuple[dict[str, Any], bool]) -> None:
    payload, legacy = example
    with tempfile.TemporaryDirectory() as directory:
        src, once, twice = (Path(directory) / name for name in ("in.pt", "once.pt", "twice.pt"))
        torch.save(payload, src, _use_new_zipfile_serialization=not legacy)
        fix(src, once)
        again = fix(once, twice)
        assert again.plan.additions == ()
        assert again.diagnosis.verdict == "healthy"
        verify_torch_file(once, twice, "once.pt", [])
        assert_copy_faithful(load(once), load(twice))


def test_the_comparison_catches_what_fix_must_not_do() -> None:
    """The checker the properties rely on fails on a single changed bit, layout or sharing."""
    import pytest

    base = torch.tensor([float("nan"), -0.0, 1.0, 2.0])
    original = {"a": base[:2], "b": base[2:], "t": torch.ones(2, 3).t(), "betas": (0.9, 0.99)}
    assert_copy_faithful(original, copy.deepcopy(original))
    payload = base.clone()
    payload.view(torch.int32)[0] += 1  # another NaN payload
    shared = base.clone()
    for changed in (
        {**original, "a": payload[:2], "b": payload[2:]},
        {**original, "a": torch.tensor([float("nan"), 0.0])},  # -0.0 became 0.0
        {**original, "b": base[2:].clone()},  # no longer shares the storage of "a"
        {**original, "a": shared[:2], "b": shared[2:], "t": original["t"].contiguous()},
        {**original, "betas": [0.9, 0.99]},
        {**original, "a": base[:2].to(torch.float64)},
    ):
        with pytest.raises(AssertionError):
            assert_copy_faithful(original, changed)
