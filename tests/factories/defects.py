"""Checkpoints with defects on purpose: sparse, cold, phantom-step, malformed and hard-to-copy optimizer states."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LinearLR

from tests.factories.built import Built, Site, StateDict
from tests.factories.models import (
    ParamKey,
    Run,
    TrickyNet,
    TwoHeadNet,
    absent_entries,
    all_keys,
    make_optimizer,
    run,
)
from tests.factories.trainers import OPT_SITE, single_file, unirl_payload

# --------------------------------------------------------------------------- optimizer states


def healthy(root: Path, optimizer: str = "adamw", groups: int = 1) -> Built:
    """``healthy.pt``: UniRL payload where every param was trained (nothing missing)."""
    r = run(optimizer=optimizer, groups=groups, use_all=True)
    path = single_file(root, "healthy.pt", unirl_payload(r))
    return Built(path, {Site("", OPT_SITE): absent_entries(r.model, r.optimizer, "name")})


def cold(root: Path, optimizer: str = "adamw") -> Built:
    """``cold.pt``: a never-stepped ``optimizer.state_dict()`` (``state == {}``), index-keyed."""
    model = TwoHeadNet()
    opt = make_optimizer(model, optimizer)
    path = single_file(root, "cold.pt", opt.state_dict())
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
    path = single_file(root, "phantom_step.pt", payload)
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
    path = single_file(root, "empty_entries.pt", payload)
    site = Site("", OPT_SITE)
    return Built(path, {site: ()}, {site: absent})


# --------------------------------------------------------------------------- malformed

Edit = Callable[[StateDict], tuple[ParamKey, ...]]


def _malformed(root: Path, name: str, edit: Edit, groups: int = 1) -> Built:
    r = run(groups=groups)
    payload = unirl_payload(r)
    payload["optimizer_state_dict"] = copy.deepcopy(payload["optimizer_state_dict"])
    defects = edit(payload["optimizer_state_dict"])
    path = single_file(root, f"{name}.pt", payload)
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
    path = single_file(root, "tricky_tensors.pt", payload)
    return Built(path, {Site("", OPT_SITE): absent_entries(model, r.optimizer, "name")})
