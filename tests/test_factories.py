"""The checkpoint factories write what they claim, checked with plain ``torch.load``."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from tests.factories import defects, hostile, models, trainers
from tests.factories.built import Built, Site
from tests.factories.models import ParamKey
from tests.factories.versions import MISSING_STATE_ERROR, missing_state_match


def load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def params_of(sd: dict[str, Any]) -> list[ParamKey]:
    return [p for group in sd["param_groups"] for p in group["params"]]


def bits32(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in t.contiguous().view(torch.int32).view(-1).tolist()]


def bits16(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFF for v in t.contiguous().view(torch.int16).view(-1).tolist()]


def test_site_location() -> None:
    assert Site().location == ""
    assert Site("", ("optimizer_states", 0)).location == "optimizer_states[0]"
    assert Site("", ("optimizers", "actor")).location == "optimizers.actor"
    assert Site("x.pt", ("a", 1, "b")).location == "a[1].b"


def test_every_factory_missing_is_absent_and_listed(any_checkpoint: Built) -> None:
    built = any_checkpoint
    assert built.path.exists()
    for site, missing in built.missing.items():
        sd = built.load(site)
        params = params_of(sd)
        assert set(missing) <= set(params)
        assert not set(missing) & set(sd["state"])
        keys = {type(p) for p in params}
        assert keys in ({str}, {int})
        if built.path.name in {f"{n}.pt" for n in defects.MALFORMED}:
            continue
        if site not in built.defects:
            # a stateful optimizer: every param has an entry, or is listed as missing
            assert set(sd["state"]) | set(missing) == set(params)


def test_factories_are_deterministic(tmp_path: Path) -> None:
    a, b = trainers.unirl_torch(tmp_path / "a"), trainers.unirl_torch(tmp_path / "b")
    sa, sb = a.load(), b.load()
    for name, entry in sa["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, sb["state"][name][key])


def test_unirl_layout(unirl_checkpoint: Built) -> None:
    built = unirl_checkpoint
    assert built.path.name == "checkpoint-2"
    payload = load(built.path / "checkpoint.pt")
    assert set(payload) == {
        "policy_state_dict",
        "optimizer_state_dict",
        "optimizer_step_count",
        "step",
        "save_mode",
        "lora_config",
        "scheduler_state_dict",
    }
    assert zipfile.is_zipfile(built.path / "checkpoint.pt")
    sd = payload["optimizer_state_dict"]
    assert params_of(sd) == list(payload["policy_state_dict"])  # names, in parameter order
    assert built.missing == {
        Site("checkpoint.pt", ("optimizer_state_dict",)): ("head_unused.weight", "head_unused.bias")
    }
    assert set(sd["state"]) == {"trunk.weight", "trunk.bias", "head_used.weight", "head_used.bias"}
    assert "initial_lr" in sd["param_groups"][0]  # the scheduler's key
    for name in ("trainer_state.json", "sft_data_state.json"):
        json.loads((built.path / name).read_text())


def test_unirl_reproduces_the_bug(unirl_checkpoint: Built) -> None:
    """The fixture's point: torch's own loader refuses it."""
    model = models.TwoHeadNet()
    opt = models.make_optimizer(model)
    with pytest.raises(MISSING_STATE_ERROR, match=missing_state_match("head_unused.weight")):
        set_optimizer_state_dict(model, opt, unirl_checkpoint.load())


@pytest.mark.parametrize("groups", [1, 2])
def test_every_optimizer(root: Path, optimizer_name: str, groups: int) -> None:
    built = trainers.unirl_torch(root, optimizer=optimizer_name, groups=groups)
    sd = built.load()
    assert len(sd["param_groups"]) == groups
    if optimizer_name in models.STATELESS_NAMES:
        assert built.all_missing == () and sd["state"] == {}
    else:
        assert built.all_missing == ("head_unused.weight", "head_unused.bias")
        assert len(sd["state"]) == 4
    if groups == 2:
        assert sd["param_groups"][0]["params"] == [
            "trunk.weight",
            "head_used.weight",
            "head_unused.weight",
        ]
        assert sd["param_groups"][1]["lr"] != sd["param_groups"][0]["lr"]


def test_petrainer(petrainer_checkpoint: Built) -> None:
    built = petrainer_checkpoint
    assert [s.file for s in built.sites] == ["diffusion/checkpoint.pt", "ar/checkpoint.pt"]
    for site in built.sites:
        assert built.missing[site] == ("head_unused.weight", "head_unused.bias")
        assert (built.file(site).parent / "trainer_state.json").is_file()
    assert len(built.load(Site("ar/checkpoint.pt", ("optimizer_state_dict",)))["param_groups"]) == 2


def test_hf_trainer(hf_checkpoint: Built) -> None:
    d = hf_checkpoint.path
    assert hf_checkpoint.missing == {Site("optimizer.pt"): (4, 5)}
    sd = load(d / "optimizer.pt")
    assert sorted(sd["state"]) == [0, 1, 2, 3] and params_of(sd) == [0, 1, 2, 3, 4, 5]
    assert "lr_lambdas" in load(d / "scheduler.pt")
    for name in ("rng_state.pth", "training_args.bin"):
        with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
            load(d / name)
        assert torch.load(d / name, weights_only=False) is not None  # our own file: loads unsafely
    assert isinstance(torch.load(d / "training_args.bin", weights_only=False), trainers.TrainingArguments)
    weights = load_file(str(d / "model.safetensors"))
    assert torch.equal(weights["trunk.weight"], models.TwoHeadNet().trunk.weight) is False  # trained
    assert list(weights) == sorted(models.TwoHeadNet().state_dict())
    assert json.loads((d / "trainer_state.json").read_text())["global_step"] == 3


def test_accelerate(accelerate_checkpoint: Built) -> None:
    d = accelerate_checkpoint.path
    assert accelerate_checkpoint.missing == {
        Site("optimizer.bin"): (2, 3),
        Site("optimizer_1.bin"): (1,),
    }
    assert sorted(load(d / "optimizer_1.bin")["state"]) == [0, 2]
    assert set(load_file(str(d / "model.safetensors"))) == set(models.TwoHeadNet().state_dict())
    load(d / "scheduler.bin")
    assert isinstance(load(d / "random_states_0.pkl")["torch_manual_seed"], torch.Tensor)


def test_lightning(lightning_checkpoint: Built) -> None:
    built = lightning_checkpoint
    assert built.path.name == "epoch=0-step=3.ckpt" and built.path.is_file()
    ckpt = load(built.path)
    assert next(iter(ckpt["state_dict"])) == "net.trunk.weight"
    assert built.missing == {Site("", ("optimizer_states", 0)): (4, 5)}
    assert sorted(ckpt["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert len(ckpt["lr_schedulers"]) == 1


def test_multi_optimizer(multi_optimizer_checkpoint: Built) -> None:
    built = multi_optimizer_checkpoint
    assert [s.location for s in built.sites] == ["optimizers.actor", "optimizers.critic"]
    critic = built.load(Site("", ("optimizers", "critic")))
    assert len(critic["param_groups"]) == 2
    assert built.all_missing == ("head_unused.weight", "head_unused.bias") * 2


def test_legacy_format(legacy_checkpoint: Built) -> None:
    assert not zipfile.is_zipfile(legacy_checkpoint.path)
    assert legacy_checkpoint.all_missing == ("head_unused.weight", "head_unused.bias")
    assert "head_unused.weight" not in legacy_checkpoint.load()["state"]


def test_bug_report(bug_report_checkpoint: Built) -> None:
    built = bug_report_checkpoint
    assert built.all_missing == models.BUG_REPORT_MISSING
    payload = load(built.path / "checkpoint.pt")
    sd = payload["optimizer_state_dict"]
    assert len(params_of(sd)) == 40 and len(sd["state"]) == 36
    assert payload["save_mode"] == "lora"
    assert list(payload["policy_state_dict"]) == params_of(sd)  # only the LoRA weights
    assert "transformer_blocks.0.attn.to_add_out.lora_A.default.weight" in sd["state"]


def test_healthy(healthy_checkpoint: Built) -> None:
    sd = healthy_checkpoint.load()
    assert healthy_checkpoint.all_missing == ()
    assert set(sd["state"]) == set(params_of(sd))


def test_cold(cold_checkpoint: Built) -> None:
    sd = cold_checkpoint.load()
    assert sd["state"] == {}
    assert cold_checkpoint.all_missing == (0, 1, 2, 3, 4, 5)


def test_phantom_step(phantom_checkpoint: Built) -> None:
    sd = phantom_checkpoint.load()
    assert set(sd["state"]) == set(params_of(sd)) == set(phantom_checkpoint.defects[phantom_checkpoint.site])
    for entry in sd["state"].values():
        assert entry["step"].item() == 1.0
        assert not entry["exp_avg"].any() and not entry["exp_avg_sq"].any()


def test_empty_entries(empty_entries_checkpoint: Built) -> None:
    sd = empty_entries_checkpoint.load()
    assert list(sd["state"]) == params_of(sd)
    assert sd["state"]["head_unused.weight"] == {} and sd["state"]["head_unused.bias"] == {}
    assert empty_entries_checkpoint.defects[empty_entries_checkpoint.site] == (
        "head_unused.weight",
        "head_unused.bias",
    )


def test_malformed(root: Path) -> None:
    state = defects.partial_state(root).load()["state"]
    assert "exp_avg_sq" not in state["trunk.bias"] and "exp_avg_sq" in state["trunk.weight"]
    sd = defects.orphan_state(root).load()
    assert "ghost.weight" in sd["state"] and "ghost.weight" not in params_of(sd)
    groups = defects.duplicate_param(root).load()["param_groups"]
    assert "trunk.weight" in groups[0]["params"] and "trunk.weight" in groups[1]["params"]
    assert isinstance(defects.bad_entry_not_mapping(root, "list").load()["state"]["trunk.bias"], list)
    assert isinstance(defects.bad_entry_not_mapping(root, "float").load()["state"]["trunk.bias"], float)
    assert defects.bad_entry_moment_not_tensor(root).load()["state"]["trunk.weight"]["exp_avg"] == 0.25
    assert defects.shape_mismatch(root).load()["state"]["trunk.weight"]["exp_avg_sq"].shape == (3, 3)


def test_malformed_keep_missing(malformed_checkpoint: Built) -> None:
    assert malformed_checkpoint.all_missing == ("head_unused.weight", "head_unused.bias")
    assert malformed_checkpoint.defects[malformed_checkpoint.site]


def test_tricky_tensors(tricky_checkpoint: Built) -> None:
    built = tricky_checkpoint
    payload = load(built.path)
    state = payload["optimizer_state_dict"]["state"]
    weights = payload["policy_state_dict"]
    assert built.all_missing == (
        "spectral_unused",
        "void_unused",
        "gain_bf16_unused",
        "head_unused.weight",
        "head_unused.bias",
    )
    assert weights["spectral_unused"].dtype == torch.complex64 and weights["void_unused"].shape == (0,)
    assert weights["gain_bf16_unused"].dtype == torch.bfloat16
    hw = state["head_used.weight"]
    assert bits32(hw["exp_avg"])[:3] == [*defects.NAN_BITS_F32, defects.NEG_ZERO_F32]
    assert bits32(hw["exp_avg_sq"])[0] == defects.NEG_ZERO_F32
    assert state["gain_bf16"]["exp_avg"].dtype == torch.bfloat16
    assert bits16(state["gain_bf16"]["exp_avg"])[:2] == [defects.NAN_BITS_BF16, 0x8000]
    assert state["gain_fp16"]["exp_avg_sq"].dtype == torch.float16
    assert bits16(state["gain_fp16"]["exp_avg"])[:2] == [defects.NAN_BITS_F16, 0x8000]
    assert state["spectral"]["exp_avg"].dtype == torch.complex64 and state["spectral"]["exp_avg"].any()
    assert state["void"]["exp_avg"].shape == (0, 4)
    tw = state["trunk.weight"]["exp_avg"]
    assert tw.shape == (8, 4) and not tw.is_contiguous() and tw.stride() == (1, 8)
    tb = state["trunk.bias"]
    assert tb["exp_avg"].untyped_storage().data_ptr() == tb["exp_avg_sq"].untyped_storage().data_ptr()
    assert tb["exp_avg_sq"].storage_offset() == 8
    for name, entry in state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert entry[key].shape == weights[name].shape


@pytest.mark.parametrize("legacy", [False, True])
def test_unsafe_pickles(root: Path, marker: Path, legacy: bool) -> None:
    built = hostile.unsafe_legacy_pickle(root, marker) if legacy else hostile.unsafe_pickle(root, marker)
    assert zipfile.is_zipfile(built.path) is not legacy
    with pytest.raises(pickle.UnpicklingError, match="system"):
        torch.load(built.path, weights_only=True)
    assert not marker.exists()
    torch.load(built.path, weights_only=False)  # proves the payload is live
    assert marker.exists()
