"""``optim_repair.fix`` end to end through the library: plan, atomic write (``checkpoint.writing``), verify.

Every fix here goes through ``tests.factories.support.fix``, which asserts the input is unchanged afterwards
(content, mtime and mode of every file), whatever happened.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.optim.lr_scheduler import LinearLR

import optim_repair
from optim_repair.errors import RepairRefused
from optim_repair.formats.torchfile.verifier import verify_torch_file
from tests import factories
from tests.factories import defects, models, trainers
from tests.factories.built import Built
from tests.factories.support import (
    assert_copy_faithful,
    assert_fixed_copy,
    assert_nothing_written,
    fix,
    load,
)
from tests.factories.versions import MISSING_STATE_ERROR, missing_state_match

SAFE = sorted(set(factories.FACTORIES) - set(defects.MALFORMED))
OPT = trainers.OPT_SITE


def with_scheduler(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """As the trainer resumes: the scheduler adds ``initial_lr``, which the saved param groups hold."""
    LinearLR(opt, start_factor=0.5, total_iters=4)
    return opt


def out_for(built: Built, tmp_path: Path) -> Path:
    return tmp_path / ("fixed" + built.path.suffix)


@pytest.mark.parametrize("factory", SAFE)
def test_fix_adds_exactly_the_missing_entries_and_changes_nothing_else(
    root: Path, tmp_path: Path, factory: str
) -> None:
    built = factories.FACTORIES[factory](root)
    out = out_for(built, tmp_path)
    result = fix(built.path, out, fill="empty")
    assert result.plan.fill == "empty"
    added = {(a.file, a.location, a.param) for a in result.plan.additions}
    assert added == {(s.file, s.location, p) for s, missing in built.missing.items() for p in missing}
    assert all(a.state == () for a in result.plan.additions)
    assert_fixed_copy(built, out)
    assert (result.verification.tensors > 0, result.verification.bytes > 0) == (
        (False, False) if factory == "cold" else (True, True)
    )
    again = optim_repair.inspect(out)
    assert again.verdict == "healthy"
    assert [opt.missing for opt in again.optimizers] == [() for _ in again.optimizers]


def test_the_bug_report_is_repaired_and_resumes_through_the_stock_loader(
    bug_report_checkpoint: Built, tmp_path: Path
) -> None:
    built = bug_report_checkpoint
    out = tmp_path / "fixed"
    assert fix(built.path, out).plan.fill == "fresh", "the default: the weights beside give the shapes"
    model = models.BugReportNet()
    opt = with_scheduler(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    )
    with pytest.raises(MISSING_STATE_ERROR, match=missing_state_match()):
        set_optimizer_state_dict(model, opt, built.load())
    sd = load(out / "checkpoint.pt")["optimizer_state_dict"]
    fresh = [name for name in models.BUG_REPORT_MISSING if float(sd["state"][name]["step"]) == 0]
    assert fresh == list(models.BUG_REPORT_MISSING)
    set_optimizer_state_dict(model, opt, sd, options=StateDictOptions(full_state_dict=True))
    models.train(model, opt, 1, use_all=True)


@pytest.mark.parametrize("full", [True, False], ids=["full_state_dict", "sharded_state_dict"])
def test_name_keyed_copies_load_through_set_optimizer_state_dict(root: Path, tmp_path: Path, full: bool) -> None:
    options = StateDictOptions(full_state_dict=full)
    built = trainers.unirl_torch(root / "u")
    fix(built.path, tmp_path / "u")
    model = models.TwoHeadNet()
    opt = with_scheduler(models.make_optimizer(model))
    with pytest.raises(MISSING_STATE_ERROR, match=missing_state_match()):
        set_optimizer_state_dict(model, opt, built.load(), options=options)
    set_optimizer_state_dict(
        model, opt, load(tmp_path / "u" / "checkpoint.pt")["optimizer_state_dict"], options=options
    )
    models.train(model, opt, 1, use_all=True)
    assert len(opt.state) == 6

    multi = trainers.multi_optimizer(root / "m")
    fix(multi.path, tmp_path / "m.pt")
    payload = load(tmp_path / "m.pt")
    actor, critic = models.TwoHeadNet(seed=3), models.TwoHeadNet(hidden=5, seed=4)
    set_optimizer_state_dict(
        actor, with_scheduler(models.make_optimizer(actor)), payload["optimizers"]["actor"], options=options
    )
    set_optimizer_state_dict(
        critic,
        with_scheduler(models.make_optimizer(critic, "adam", groups=2)),
        payload["optimizers"]["critic"],
        options=options,
    )


def test_index_keyed_copies_load_through_optimizer_load_state_dict(root: Path, tmp_path: Path) -> None:
    hf = trainers.hf_trainer(root / "hf")
    fix(hf.path, tmp_path / "hf")
    model = models.TwoHeadNet()
    opt = models.make_optimizer(model)
    opt.load_state_dict(load(tmp_path / "hf" / "optimizer.pt"))
    assert [opt.state.get(p, None) for p in (model.head_unused.weight, model.head_unused.bias)] == [{}, {}]
    models.train(model, opt, 1, use_all=True)
    assert set(opt.state[model.head_unused.weight]) == {"step", "exp_avg", "exp_avg_sq"}

    lightning = trainers.lightning(root / "l")
    fix(lightning.path, tmp_path / "l.ckpt")
    module = models.LitWrapper(models.TwoHeadNet())
    opt = models.make_optimizer(module)
    opt.load_state_dict(load(tmp_path / "l.ckpt")["optimizer_states"][0])
    models.train(module, opt, 1, use_all=True)

    acc = trainers.accelerate(root / "a")
    fix(acc.path, tmp_path / "a")
    model = models.TwoHeadNet()
    first = torch.optim.AdamW([model.trunk.weight, model.trunk.bias, model.head_unused.weight, model.head_unused.bias])
    second = torch.optim.Adam([model.head_used.weight, model.head_unused.bias, model.head_used.bias])
    first.load_state_dict(load(tmp_path / "a" / "optimizer.bin"))
    second.load_state_dict(load(tmp_path / "a" / "optimizer_1.bin"))


def test_tricky_tensors_are_bit_identical(tricky_checkpoint: Built, tmp_path: Path) -> None:
    built = tricky_checkpoint
    out = tmp_path / "fixed.pt"
    fix(built.path, out, fill="empty")
    original, copy = load(built.path), load(out)
    comparison = assert_copy_faithful(original, copy, {(*OPT, "state"): set(built.all_missing)})
    assert comparison.tensors == len(original["policy_state_dict"]) + sum(
        len(e) for e in original["optimizer_state_dict"]["state"].values()
    )
    before, after = original["optimizer_state_dict"]["state"], copy["optimizer_state_dict"]["state"]
    # the documented hard cases, spelled out
    bits = after["head_used.weight"]["exp_avg"].view(torch.int32).view(-1)[:3].tolist()
    assert [b & 0xFFFFFFFF for b in bits] == [*defects.NAN_BITS_F32, defects.NEG_ZERO_F32]
    assert after["gain_bf16"]["exp_avg"].dtype == torch.bfloat16
    assert after["gain_bf16"]["exp_avg"].view(torch.int16).view(-1)[0].item() & 0xFFFF == defects.NAN_BITS_BF16
    assert after["gain_fp16"]["exp_avg"].view(torch.int16).view(-1)[0].item() & 0xFFFF == defects.NAN_BITS_F16
    assert after["spectral"]["exp_avg"].dtype == torch.complex64
    assert after["void"]["exp_avg"].shape == (0, 4)
    tw = after["trunk.weight"]["exp_avg"]
    assert not tw.is_contiguous() and tw.stride() == before["trunk.weight"]["exp_avg"].stride()
    tb = after["trunk.bias"]
    assert tb["exp_avg"].untyped_storage().data_ptr() == tb["exp_avg_sq"].untyped_storage().data_ptr()
    assert tb["exp_avg_sq"].storage_offset() == before["trunk.bias"]["exp_avg_sq"].storage_offset() > 0
    for name in ("head_unused.weight", "head_unused.bias", "spectral_unused", "void_unused", "gain_bf16_unused"):
        assert after[name] == {}


def test_cold_optimizer_stays_cold(cold_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "cold.pt"
    fix(cold_checkpoint.path, out)
    sd = load(out)
    assert sd["state"] == {i: {} for i in range(6)}
    assert sd["param_groups"] == load(cold_checkpoint.path)["param_groups"]


def test_healthy_checkpoint_still_gets_a_verified_copy(healthy_checkpoint: Built, tmp_path: Path) -> None:
    out = tmp_path / "h.pt"
    result = fix(healthy_checkpoint.path, out)
    assert result.plan.additions == ()
    payload = load(healthy_checkpoint.path)
    assert result.verification.tensors == len(payload["policy_state_dict"]) + sum(
        len(entry) for entry in payload["optimizer_state_dict"]["state"].values()
    )
    assert_copy_faithful(load(healthy_checkpoint.path), load(out))


def test_fix_is_idempotent(root: Path, tmp_path: Path) -> None:
    for built in (
        defects.tricky_tensors(root / "t"),
        trainers.legacy_format(root / "l"),
        trainers.petrainer(root / "p"),
    ):
        once, twice = tmp_path / f"once-{built.path.name}", tmp_path / f"twice-{built.path.name}"
        fix(built.path, once)
        result = fix(once, twice)
        assert result.plan.additions == ()
        assert optim_repair.inspect(twice).verdict == "healthy"
        for site in built.sites:
            a, b = (once / site.file, twice / site.file) if site.file else (once, twice)
            verify_torch_file(a, b, site.file or "f", [])  # graph-equal, every storage byte-equal
            assert_copy_faithful(load(a), load(b))


def test_fresh_fill_takes_each_optimizers_shapes_from_its_own_model(
    multi_optimizer_checkpoint: Built, tmp_path: Path
) -> None:
    """``models.actor`` and ``models.critic`` both name ``head_unused.weight``: (2, 8) and (2, 5).

    The critic's fresh moments must have the critic's shape (or the fill must be refused as ambiguous);
    moments shaped like the actor's parameter cannot be loaded into the critic.
    """
    out = tmp_path / "fresh.pt"
    try:
        fix(multi_optimizer_checkpoint.path, out, fill="fresh")
    except RepairRefused:
        assert_nothing_written(out)
        return
    payload = load(out)
    for side in ("actor", "critic"):
        weight = payload["models"][side]["head_unused.weight"]
        added = payload["optimizers"][side]["state"]["head_unused.weight"]
        assert added["exp_avg"].shape == weight.shape, side
