"""Comparing an optimizer's parameters with a model's: names, shapes, and the rename that explains them.

Names that differ only by what torch's wrappers insert (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``)
match, as torch's own state-dict functions match them; another consistent change of names is found and
offered as the ``--rename`` that fixes it. Pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from optim_repair.decisions.optimizers import PARAM_SHAPED_KEYS
from optim_repair.records.inventory import (
    CheckpointInventory,
    FileInventory,
    OptimizerInventory,
    ParamKey,
    TensorMeta,
    WeightMap,
)
from optim_repair.records.keys import unwrapped
from optim_repair.records.steps import step_prefix

WRAPPERS = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
"""What wrappers insert into parameter names: torch.compile, DDP/DataParallel, FSDP1, activation checkpointing."""


@dataclass(frozen=True)
class ShapeMismatch:
    """A state tensor whose shape is not its parameter's in the model."""

    param: str
    key: str
    state_shape: tuple[int, ...]
    model_shape: tuple[int, ...]


@dataclass(frozen=True)
class Rename:
    """A regular expression and its replacement, as ``fix --rename OLD=NEW`` takes them."""

    old: str
    new: str

    def apply(self, name: str) -> str:
        return re.sub(self.old, self.new, name)

    def __str__(self) -> str:
        return f"{self.old}={self.new}"


@dataclass(frozen=True)
class ModelComparison:
    """One optimizer against a model: what each side has that the other lacks, and shapes that disagree."""

    sources: tuple[str, ...]
    """Where the model's names came from (weight maps' sources)."""
    by_index: bool
    """Index-keyed: compared by counts only (indices name no parameter)."""
    optimizer_params: int
    model_params: int
    not_in_model: tuple[ParamKey, ...]
    not_in_optimizer: tuple[str, ...]
    shape_mismatches: tuple[ShapeMismatch, ...]
    rename: Rename | None
    """The rename that maps every name ``not_in_model`` onto a model name, when one consistent change does."""

    @property
    def matches(self) -> bool:
        """Whether a resume into this model would find every parameter, with its shape."""
        if self.by_index:
            return self.optimizer_params <= self.model_params
        return not self.not_in_model and not self.shape_mismatches


def _rename_candidates(name: str, model: Iterable[str]) -> list[Rename]:
    """The consistent changes that would turn ``name`` into a model name: a prefix removed or added, or every
    occurrence of a wrapper's infix removed."""
    found = [Rename("^" + re.escape(name[: -len(m)]), "") for m in model if name.endswith(m) and m != name]
    found += [Rename("^", m[: -len(name)]) for m in model if m.endswith(name) and m != name]
    found += [Rename(re.escape(wrapper), "") for wrapper in WRAPPERS if wrapper in name]
    return found


def _explaining_rename(not_in_model: Sequence[str], model: set[str]) -> Rename | None:
    if not not_in_model:
        return None
    for rename in _rename_candidates(not_in_model[0], model):
        if all(rename.apply(name) in model for name in not_in_model):
            return rename
    return None


def compare(optimizer: OptimizerInventory, weights: Sequence[WeightMap]) -> ModelComparison:
    """``optimizer``'s parameters against the model the weight maps describe."""
    shapes: dict[str, TensorMeta] = {}
    ambiguous: set[str] = set()  # a name two maps give different shapes (two models in one file): no reference
    for weight_map in weights:
        for name, meta in weight_map.tensors:
            if shapes.setdefault(name, meta).shape != meta.shape:
                ambiguous.add(name)
    params = tuple(dict.fromkeys(optimizer.params))
    sources = tuple(weight_map.source for weight_map in weights)
    if optimizer.key_style == "index":
        return ModelComparison(sources, True, len(params), len(shapes), (), (), (), None)
    model_name = _model_names(params, shapes)
    not_in_model = tuple(param for param in params if param not in model_name)
    named = set(model_name.values())
    not_in_optimizer = tuple(name for name in shapes if name not in named)
    mismatches = tuple(
        ShapeMismatch(str(entry.param), key, value.shape, shapes[model_name[entry.param]].shape)
        for entry in optimizer.entries
        if entry.param in model_name and model_name[entry.param] not in ambiguous
        for key, value in entry.values or ()
        if key in PARAM_SHAPED_KEYS
        and isinstance(value, TensorMeta)
        and value.shape != shapes[model_name[entry.param]].shape
    )
    rename = _explaining_rename([str(p) for p in not_in_model], set(shapes))
    return ModelComparison(sources, False, len(params), len(shapes), not_in_model, not_in_optimizer, mismatches, rename)


def _model_names(params: Sequence[ParamKey], shapes: Mapping[str, TensorMeta]) -> dict[ParamKey, str]:
    """The model's name of each parameter it has: the same name, or else the model's name with what torch's wrappers
    insert (a DDP or compiled model's ``module.``/``_orig_mod.`` weights beside a clean-named optimizer, as
    ``get_optimizer_state_dict`` writes it and ``set_optimizer_state_dict`` loads it into the wrapper). A rename
    would break that resume, so none is suggested. An optimizer whose own names carry a wrapper's prefix the
    model lacks still gets the rename that explains them."""
    by_unwrapped: dict[str, str | None] = {}
    for name in shapes:
        key = unwrapped(name)
        by_unwrapped[key] = name if key not in by_unwrapped else None  # two model names unwrap alike: no match
    found: dict[ParamKey, str] = {}
    for param in params:
        if param in shapes:
            found[param] = str(param)
        elif isinstance(param, str) and (match := by_unwrapped.get(param)) is not None:
            found[param] = match
    return found


def model_of(optimizer: OptimizerInventory, weights: Sequence[WeightMap]) -> tuple[WeightMap, ...]:
    """The weight maps beside an optimizer that describe its model: those that name one of its parameters
    (all of them for index keys, which name none: HF's ``model.safetensors`` beside ``optimizer.pt``)."""
    if optimizer.key_style == "index":
        return tuple(weights)
    names = set(optimizer.params)
    sharing = tuple(
        weight_map for weight_map in weights if any(unwrapped(name) in names for name, _ in weight_map.tensors)
    )
    if sharing:
        return sharing
    # none names a parameter: the model of a run whose names a wrapper changed (``_orig_mod.``, ``module.``)
    params = [str(param) for param in dict.fromkeys(optimizer.params)]
    return tuple(
        weight_map
        for weight_map in weights
        if params and _explaining_rename(params, {name for name, _ in weight_map.tensors}) is not None
    )


def weights_beside(file: FileInventory, inventory: CheckpointInventory) -> tuple[WeightMap, ...]:
    """The weight maps beside the optimizers of ``file`` in the checkpoint, in the run step it lies in: its own,
    then those of every other file (a model saved beside its optimizer in another file or format: accelerate's
    ``pytorch_model_fsdp_0/`` beside ``optimizer_0/``, ``pytorch_model_fsdp.bin`` beside ``optimizer.bin``), then
    the safetensors files'."""
    others = (weight for other in inventory.files if other is not file for weight in other.weights)
    return own_step(file.file, (*file.weights, *others, *inventory.weights))


def own_step(file: str, weights: Sequence[WeightMap]) -> tuple[WeightMap, ...]:
    """The weight maps of the run step ``file`` (an optimizer's file) belongs to, when it lies in one
    (``checkpoint-100/optimizer.pt`` takes ``checkpoint-100``'s weights, never ``checkpoint-200``'s); all of them
    for a file in no step."""
    prefix = step_prefix(file)
    if prefix is None:
        return tuple(weights)
    inside = []
    for weight_map in weights:
        path = weight_map.source.split(":", 1)[0]  # a torch file's or DCP checkpoint's maps: PATH:where
        if path == prefix or path.startswith(f"{prefix}/"):
            inside.append(weight_map)
    return tuple(inside)
