"""Findings about inventories (``decisions.diagnose``): on real checkpoints and on hand-made inventories."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import optim_repair
from optim_repair.decisions.diagnose import diagnose_optimizer
from optim_repair.records.inventory import OptimizerInventory, ParamGroup, ParamKey, StateEntry, TensorMeta, WeightMap
from tests import factories
from tests.factories import defects, models, trainers
from tests.factories.built import Built
from tests.factories.support import group_of

# ---------------------------------------------------------------- real checkpoints


def by_site(built: Built) -> dict[tuple[str, str], tuple[ParamKey, ...]]:
    diagnosis = optim_repair.inspect(built.path)
    return {(opt.optimizer.file, opt.optimizer.location): opt.missing for opt in diagnosis.optimizers}


def test_the_bug_report_reproducer(bug_report_checkpoint: Built) -> None:
    diagnosis = optim_repair.inspect(bug_report_checkpoint.path)
    assert diagnosis.verdict == "repairable"
    (opt,) = diagnosis.optimizers
    assert (opt.optimizer.file, opt.optimizer.location, opt.optimizer.key_style) == (
        "checkpoint.pt",
        "optimizer_state_dict",
        "name",
    )
    assert opt.missing == models.BUG_REPORT_MISSING
    assert (len(opt.optimizer.groups), opt.params, len(opt.optimizer.entries)) == (1, 40, 36)
    assert opt.empty == () and opt.malformed == () and not opt.cold
    assert "cold" not in [w.code for w in opt.notices] and "phantom-step" not in [w.code for w in opt.notices]


@pytest.mark.parametrize(
    "factory",
    [
        "unirl_torch",
        "petrainer",
        "hf_trainer",
        "accelerate",
        "lightning",
        "multi_optimizer",
        "legacy_format",
        "tricky_tensors",
    ],
)
def test_each_layout_finds_exactly_the_missing_entries(root: Path, factory: str) -> None:
    built = factories.FACTORIES[factory](root)
    assert by_site(built) == {(site.file, site.location): missing for site, missing in built.missing.items()}
    diagnosis = optim_repair.inspect(built.path)
    index = factory in ("hf_trainer", "accelerate", "lightning")  # optimizer.load_state_dict takes absent entries
    assert diagnosis.verdict == ("healthy" if index else "repairable")
    assert optim_repair.inspect(built.path, strict=True).verdict == "repairable"
    assert all(opt.malformed == () for opt in diagnosis.optimizers), "no false malformed findings"


def test_multi_optimizer_models_of_other_shapes_are_no_shape_reference(multi_optimizer_checkpoint: Built) -> None:
    # models.actor and models.critic both name trunk.weight, with (8, 4) and (5, 4)
    diagnosis = optim_repair.inspect(multi_optimizer_checkpoint.path)
    assert [opt.malformed for opt in diagnosis.optimizers] == [(), ()]
    assert diagnosis.verdict == "repairable"


def test_both_key_styles(root: Path) -> None:
    names = optim_repair.inspect(trainers.unirl_torch(root / "n").path).optimizers[0]
    indices = optim_repair.inspect(trainers.hf_trainer(root / "i").path).optimizers[0]
    assert names.optimizer.key_style == "name" and names.missing == ("head_unused.weight", "head_unused.bias")
    assert indices.optimizer.key_style == "index" and indices.missing == (4, 5)


def test_healthy(healthy_checkpoint: Built) -> None:
    diagnosis = optim_repair.inspect(healthy_checkpoint.path)
    assert diagnosis.verdict == "healthy"
    (opt,) = diagnosis.optimizers
    assert opt.missing == () and opt.empty == () and opt.malformed == () and opt.notices == ()


def test_empty_entries_are_valid_not_missing(empty_entries_checkpoint: Built) -> None:
    built = empty_entries_checkpoint
    diagnosis = optim_repair.inspect(built.path)
    (opt,) = diagnosis.optimizers
    assert opt.missing == ()
    assert opt.empty == built.defects[built.site]
    assert opt.malformed == ()
    assert diagnosis.verdict == "healthy"


def test_cold_optimizer(cold_checkpoint: Built) -> None:
    diagnosis = optim_repair.inspect(cold_checkpoint.path)
    (opt,) = diagnosis.optimizers
    assert opt.cold and opt.missing == (0, 1, 2, 3, 4, 5) and len(opt.optimizer.entries) == 0
    assert [(n.code, n.severity) for n in opt.notices] == [("cold", "info"), ("sparse-ok-for-load-state-dict", "info")]
    assert diagnosis.verdict == "healthy" and opt.resumes_as_is and opt.loader == "load_state_dict"


def test_phantom_step(phantom_checkpoint: Built) -> None:
    diagnosis = optim_repair.inspect(phantom_checkpoint.path)
    (opt,) = diagnosis.optimizers
    assert "phantom-step" in [w.code for w in opt.notices]
    assert not opt.cold and opt.missing == () and diagnosis.verdict == "healthy"


def test_phantom_step_needs_zero_moments_not_just_step_one(root: Path) -> None:
    # one real step: step == 1 everywhere, but the moments are not zero
    built = trainers.unirl_torch(root, steps=1)
    (opt,) = optim_repair.inspect(built.path).optimizers
    assert all(isinstance(e.get("step"), TensorMeta) and e.get("step").value == 1 for e in opt.optimizer.entries)
    assert "phantom-step" not in [w.code for w in opt.notices]


MALFORMED_CODES = {
    "partial_state": ("partial-state", "trunk.bias"),
    "orphan_state": ("orphan-state", "ghost.weight"),
    "duplicate_param": ("duplicate-param", "trunk.weight"),
    "bad_entry_not_mapping_list": ("bad-entry", "trunk.bias"),
    "bad_entry_not_mapping_float": ("bad-entry", "trunk.bias"),
    "bad_entry_moment_not_tensor": ("bad-entry", "trunk.weight"),
    "shape_mismatch": ("shape-mismatch", "trunk.weight"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_CODES))
def test_every_malformed_code(root: Path, name: str) -> None:
    built = defects.MALFORMED[name](root)
    diagnosis = optim_repair.inspect(built.path)
    assert diagnosis.verdict == "malformed"
    (opt,) = diagnosis.optimizers
    code, param = MALFORMED_CODES[name]
    assert {(m.code, m.param) for m in opt.malformed} == {(code, param)}
    assert all(m.detail for m in opt.malformed)
    assert opt.missing == built.missing[built.site]


def test_shape_mismatch_detail_names_both_shapes(root: Path) -> None:
    (opt,) = optim_repair.inspect(defects.shape_mismatch(root).path).optimizers
    (finding,) = opt.malformed
    assert finding.detail == "exp_avg_sq has shape [3, 3] but the parameter has [8, 4]"


# ---------------------------------------------------------------- hand-made inventories


def tensor(shape: tuple[int, ...], *, value: float | None = None, zero: bool | None = None) -> TensorMeta:
    stride = tuple(1 for _ in shape)
    nbytes = 4 * math.prod(shape)
    return TensorMeta("float32", shape, stride, f"s{shape}{value}", 0, nbytes, value=value, zero_head=zero)


def adam_entry(param: ParamKey, shape: tuple[int, ...], step: float = 3.0, zero: bool = False) -> StateEntry:
    return StateEntry(
        param,
        (
            ("step", tensor((), value=step)),
            ("exp_avg", tensor(shape, zero=zero)),
            ("exp_avg_sq", tensor(shape, zero=zero)),
        ),
    )


def optimizer(
    groups: list[list[ParamKey]], entries: list[StateEntry], like: type[torch.optim.Optimizer] | None = None
) -> OptimizerInventory:
    """An optimizer's inventory; its groups hold ``lr`` alone, or the option keys the installed torch's ``like``
    writes."""
    style = "name" if any(isinstance(p, str) for g in groups for p in g) else "index"
    options: tuple[tuple[str, object], ...] = (("lr", 0.1),)
    if like is not None:
        written = like([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
        options = tuple((key, value) for key, value in written.items() if key != "params")
    return OptimizerInventory(
        "",
        "opt",
        ("opt",),
        style,  # type: ignore[arg-type]
        tuple(ParamGroup(tuple(g), options) for g in groups),  # type: ignore[arg-type]
        tuple(entries),
    )


def test_missing_keeps_param_group_order_and_deduplicates() -> None:
    opt = optimizer([["b", "a"], ["c", "a"]], [adam_entry("a", (2,))])
    diagnosis = diagnose_optimizer(opt)
    assert diagnosis.missing == ("b", "c")
    assert [(m.code, m.param) for m in diagnosis.malformed] == [("duplicate-param", "a")]
    assert diagnosis.params == 3


def test_partial_state_is_judged_per_group() -> None:
    sgd_like = StateEntry(2, (("momentum_buffer", None),))
    opt = optimizer([[0, 1], [2]], [adam_entry(0, (2,)), adam_entry(1, (2,)), sgd_like], like=torch.optim.AdamW)
    assert diagnose_optimizer(opt).malformed == ()
    lacking = StateEntry(1, (("step", tensor((), value=3.0)), ("exp_avg", tensor((2,)))))
    opt = optimizer([[0, 1, 2]], [adam_entry(0, (2,)), lacking, adam_entry(2, (2,))], like=torch.optim.AdamW)
    (finding,) = diagnose_optimizer(opt).malformed
    assert (finding.code, finding.param) == ("partial-state", 1)
    assert "exp_avg_sq" in finding.detail


def test_entries_whose_keys_differ_by_rank_are_not_partial() -> None:
    """torch's Adafactor: row and column factors for a matrix, a full variance for a vector."""
    step = ("step", tensor((), value=3.0))
    matrix = StateEntry(0, (step, ("row_var", tensor((3, 1))), ("col_var", tensor((1, 4)))))
    vector = StateEntry(1, (step, ("variance", tensor((3,)))))
    adafactor = models.TorchAdafactor
    opt = optimizer([[0, 1, 2]], [matrix, vector, StateEntry(2, (step, ("variance", tensor((2,)))))], like=adafactor)
    assert diagnose_optimizer(opt).malformed == ()
    lacking = StateEntry(3, (step, ("row_var", tensor((3, 1)))))
    entries = [matrix, vector, StateEntry(2, (step, ("variance", tensor((2,))))), lacking]
    (finding,) = diagnose_optimizer(optimizer([[0, 1, 2, 3]], entries, like=adafactor)).malformed
    assert (finding.code, finding.param) == ("partial-state", 3)
    assert finding.detail == "lacks col_var, which other entries of group 0 have"


def test_momentum_buffer_none_is_not_a_bad_entry() -> None:
    no_buffer = (("momentum_buffer", None),)
    opt = optimizer([[0, 1]], [StateEntry(0, no_buffer), StateEntry(1, no_buffer)])
    assert diagnose_optimizer(opt).malformed == ()
    bad = optimizer([[0]], [StateEntry(0, (("exp_avg", None),))])
    assert [m.code for m in diagnose_optimizer(bad).malformed] == ["bad-entry"]


def test_shape_reference_comes_from_weights_when_unambiguous() -> None:
    opt = optimizer([["w"]], [adam_entry("w", (3, 2))])
    agreeing = WeightMap("m", (("w", tensor((3, 2))),))
    wrong = WeightMap("m", (("w", tensor((2, 3))),))
    assert diagnose_optimizer(opt, [agreeing]).malformed == ()
    assert {m.code for m in diagnose_optimizer(opt, [wrong]).malformed} == {"shape-mismatch"}
    # two models disagree on "w": neither is a reference
    assert diagnose_optimizer(opt, [wrong, agreeing]).malformed == ()


def test_cold_and_phantom_are_exclusive_warnings() -> None:
    cold = optimizer([[0, 1]], [])
    assert [w.code for w in diagnose_optimizer(cold).notices] == ["cold", "sparse-ok-for-load-state-dict"]
    all_empty = optimizer([[0, 1]], [StateEntry(0, ()), StateEntry(1, ())])
    d = diagnose_optimizer(all_empty)
    assert d.cold and d.empty == (0, 1) and "cold" in [w.code for w in d.notices]
    phantom = optimizer([[0, 1]], [adam_entry(0, (2,), step=1.0, zero=True), adam_entry(1, (2,), step=1.0, zero=True)])
    codes = [w.code for w in diagnose_optimizer(phantom).notices]
    assert "phantom-step" in codes and "cold" not in codes
    real = optimizer([[0, 1]], [adam_entry(0, (2,), step=1.0, zero=True), adam_entry(1, (2,), step=1.0, zero=False)])
    assert "phantom-step" not in [w.code for w in diagnose_optimizer(real).notices]


def test_index_keys_say_that_load_state_dict_accepts_absent_entries(hf_checkpoint: Built) -> None:
    (opt,) = optim_repair.inspect(hf_checkpoint.path).optimizers
    assert opt.optimizer.key_style == "index" and opt.missing
    assert [w.code for w in opt.notices] == ["sparse-ok-for-load-state-dict"]


def test_the_phantom_step_remedy_fits_absent_and_empty_entries(
    unirl_checkpoint: Built, empty_entries_checkpoint: Built
) -> None:
    def remedy(built: Built) -> str:
        (opt,) = optim_repair.inspect(built.path).optimizers
        return next(w.detail for w in opt.notices if w.code == "stock-loader-phantom-step")

    both = "optim-repair fix --fill fresh, or load with optim_repair.set_optimizer_state_dict"
    assert both in remedy(unirl_checkpoint)
    empty = remedy(empty_entries_checkpoint)
    assert empty.startswith("2 parameter(s) without state") and "--fill fresh fills absent entries only" in empty


def test_the_phantom_step_notice_says_which_torch_and_which_options_give_it(
    unirl_checkpoint: Built, empty_entries_checkpoint: Built
) -> None:
    """torch refuses absent entries ("Missing optimizer state" from 2.10, a KeyError before); ``{}`` entries
    get the phantom step only with ``full_state_dict=True``, from torch 2.6 (tests/faces/test_torch_loader.py
    shows both loaders on the installed torch)."""

    def notice(built: Built) -> str:
        (opt,) = optim_repair.inspect(built.path).optimizers
        return next(w.detail for w in opt.notices if w.code == "stock-loader-phantom-step")

    absent = notice(unirl_checkpoint)
    assert '("Missing optimizer state" from torch 2.10, a KeyError before)' in absent
    assert (
        "exactly with the default full_state_dict=False, but with full_state_dict=True (torch 2.6 and later)" in absent
    )
    empty = notice(empty_entries_checkpoint)
    assert "set_optimizer_state_dict with full_state_dict=True (torch 2.6 and later)" in empty
    assert "with the default full_state_dict=False, {} entries resume exactly" in empty


def test_the_phantom_step_notice_calls_an_adamw_from_before_torch_2_8_adam_or_adamw() -> None:
    group = dict(torch.optim.AdamW(models.TwoHeadNet().parameters()).state_dict()["param_groups"][0])
    del group["decoupled_weight_decay"]  # what torch before 2.8 wrote
    group["params"] = ["w", "b"]
    opt = OptimizerInventory("", "opt", ("opt",), "name", (group_of(group),), (adam_entry("w", (2,)),))
    diagnosis = diagnose_optimizer(opt, loader="set_optimizer_state_dict")
    (notice,) = [w for w in diagnosis.notices if w.code == "stock-loader-phantom-step"]
    assert "they would get a phantom step=1 and train differently (adam or adamw); remedies:" in notice.detail


def test_python_names_are_the_json_names(unirl_checkpoint: Built) -> None:
    from optim_repair import render

    diagnosis = optim_repair.inspect(unirl_checkpoint.path)
    (document,) = render.inspect_document(diagnosis)["optimizers"]
    (opt,) = diagnosis.optimizers
    for name, value in document.items():
        python = getattr(opt, name)
        if name == "model":
            found = python
            python = {key: getattr(found, key) for key in value}
            python = {
                **python,
                "sources": list(found.sources),
                "shape_mismatches": list(found.shape_mismatches),
                "not_in_model": list(found.not_in_model),
                "not_in_optimizer": list(found.not_in_optimizer),
            }
        if name == "census":  # the same fields, each pair as JSON writes it
            found = python
            python = {
                "largest": found.largest,
                "distribution": [list(pair) for pair in found.distribution],
                "steps": [{"param": param, "step": step} for param, step in found.steps],
                "lagging": [{"param": param, "step": step} for param, step in found.lagging],
            }
        if name in ("malformed", "notices"):
            python = [{key: getattr(item, key) for key in value[0]} for item in python] if value else list(python)
        assert (list(python) if isinstance(python, tuple) else python) == value, name


def test_top_level_python_names_are_the_json_names(unirl_checkpoint: Built, tmp_path: Path) -> None:
    from optim_repair import render

    diagnosis = optim_repair.inspect(unirl_checkpoint.path)
    document = render.inspect_document(diagnosis)
    for name in ("path", "format", "verdict", "strict"):
        assert getattr(diagnosis, name) == document[name], name  # type: ignore[literal-required]
    assert [(s.file, s.kind, s.reason) for s in diagnosis.skipped] == [
        (s["file"], s["kind"], s["reason"]) for s in document["skipped"]
    ]
    result = optim_repair.fix(diagnosis, tmp_path / "fixed")
    fixed = render.fix_document(result)
    assert (str(result.out), result.fill) == (fixed["out"], fixed["fill"])
    assert [(a.file, a.location, a.param, list(a.keys), dict(a.dtypes), a.replaces) for a in result.added] == [
        (a["file"], a["location"], a["param"], a["keys"], a["dtypes"], a["replaced"]) for a in fixed["added"]
    ]


def test_an_optimizer_not_known_by_its_options_keeps_differing_state_without_being_malformed() -> None:
    """bitsandbytes' 8-bit AdamW keeps 32-bit state without its quantization keys for a parameter under its size
    threshold: for an optimizer the registry does not know, differing key sets are a notice, never malformed."""
    quantized = StateEntry(
        0,
        (("step", tensor((), value=3.0)), ("state1", tensor((64,))), ("absmax1", tensor((1,)))),
    )
    small = StateEntry(1, (("step", tensor((), value=3.0)), ("state1", tensor((2,)))))
    found = diagnose_optimizer(optimizer([[0, 1]], [quantized, small]))
    assert found.malformed == ()
    (notice,) = [notice for notice in found.notices if notice.code == "differing-state-keys"]
    assert notice.severity == "info" and notice.detail.startswith("1 entries lack keys other entries of their group")
