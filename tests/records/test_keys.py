"""The key grammar (``records.keys``) against the keys torch itself writes, nested and flattened."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from optim_repair.records import keys


def _trained(flatten: bool) -> tuple[nn.Module, dict[str, object]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    return model, get_optimizer_state_dict(model, opt, options=options)


def test_a_nested_state_dict_is_nested_and_a_flattened_one_is_not() -> None:
    _, nested = _trained(False)
    _, flattened = _trained(True)
    assert keys.is_nested(nested)
    assert not keys.is_nested(flattened)


def test_every_flattened_key_torch_writes_splits_into_a_parameter_and_a_leaf() -> None:
    model, flattened = _trained(True)
    names = {name for name, _ in model.named_parameters()}
    for key in flattened:
        section, name, leaf = keys.split_flat(key)
        assert name in names and "." not in leaf
        assert keys.flat_key(section, name, leaf) == key
        assert keys.leaf_of(key, section, name) == leaf
    assert {keys.split_flat(key)[2] for key in flattened if keys.section_of(key) == keys.STATE} == {
        "step",
        "exp_avg",
        "exp_avg_sq",
    }
    assert "lr" in {keys.split_flat(key)[2] for key in flattened if keys.section_of(key) == keys.PARAM_GROUPS}


def test_a_leaf_is_the_last_part_only() -> None:
    """``state.<name>.x.y`` is no leaf of ``<name>``: the leaf never holds a dot, a name may."""
    assert keys.leaf_of("state.0.weight.exp_avg", keys.STATE, "0.weight") == "exp_avg"
    assert keys.leaf_of("state.0.weight.exp_avg", keys.STATE, "0") is None
    assert keys.leaf_of("param_groups.0.weight.lr", keys.STATE, "0.weight") is None


def test_renaming_and_dropping_a_flattened_key() -> None:
    mapping = {"0.weight": "encoder.0.weight", "1.bias": None}
    assert keys.renamed_flat("state.0.weight.exp_avg", mapping) == "state.encoder.0.weight.exp_avg"
    assert keys.renamed_flat("param_groups.0.weight.lr", mapping) == "param_groups.encoder.0.weight.lr"
    assert keys.renamed_flat("state.1.bias.step", mapping) is None
    assert keys.renamed_flat("state.1.weight.step", mapping) == "state.1.weight.step"


def test_a_key_of_neither_section_is_refused() -> None:
    assert keys.section_of("model.weight") is None
    with pytest.raises(ValueError, match="no flattened optimizer key"):
        keys.split_flat("model.weight")


def test_dotted_joins_a_dcp_key_path() -> None:
    assert keys.dotted(("optim", "state", "0.weight", "exp_avg")) == "optim.state.0.weight.exp_avg"
    assert keys.dotted(("optim", "param_groups", 0, "lr")) == "optim.param_groups.0.lr"


def test_unwrapped_strips_what_torchs_wrappers_insert_as_get_fqns_does() -> None:
    assert keys.unwrapped("module.encoder.weight") == "encoder.weight"
    assert keys.unwrapped("_orig_mod.module.encoder.weight") == "encoder.weight"
    assert keys.unwrapped("layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.w") == "layers.0.w"
    assert keys.unwrapped("encoder.module.weight") == "encoder.module.weight"  # a submodule named module
    assert keys.unwrapped("module") == "module"
