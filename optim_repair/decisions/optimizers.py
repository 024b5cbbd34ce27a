"""The registry of lazily-initialized torch optimizers: how to recognize each, and the state it creates.

Each ``OptimizerSpec`` names its class in ``torch.optim``, the exact option keys torch writes for it,
the key sets of its populated state entries, and its builder in ``optim_repair.decisions.fresh_states``
(what its ``_init_group`` creates on a parameter's first step; read that module for the rules every
builder follows). Which optimizer wrote a state dict is told apart from these specs by
``optim_repair.decisions.identify``. Plain data: no torch import, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from optim_repair.decisions import fresh_states
from optim_repair.decisions.fresh_states import SCALAR_DTYPES, FreshState, FreshValue, ParamSpec
from optim_repair.errors import RepairRefused, shown
from optim_repair.records.inventory import ParamGroup, Scalar
from optim_repair.records.repair_plan import FreshTensor

__all__ = [
    "ADDED_OPTIONS",
    "LATEST_RELEASE",
    "NOT_OPTIMIZER_OPTIONS",
    "OPTIMIZERS",
    "PARAM_SHAPED_KEYS",
    "SCALAR_DTYPES",
    "SPECS",
    "WHOLE_OPTIMIZER_STATE",
    "Builder",
    "FreshState",
    "FreshValue",
    "OptimizerSpec",
    "ParamSpec",
    "fresh_state",
    "options_asked",
]

# --- the registry ---------------------------------------------------------------------------

Builder = Callable[[ParamGroup, ParamSpec, str], FreshState]


def _sets(*key_sets: tuple[str, ...]) -> frozenset[frozenset[str]]:
    return frozenset(frozenset(keys) for keys in key_sets)


@dataclass(frozen=True)
class OptimizerSpec:
    """One lazily-initializing torch optimizer: how to recognize it and what it creates."""

    name: str
    torch_class: str
    """Its class in ``torch.optim``."""
    option_sets: frozenset[frozenset[str]]
    """The exact option keys of its param groups, one set per torch version that changed them."""
    state_key_sets: frozenset[frozenset[str]]
    """The key sets its populated entries can have (one per combination of flags, or of ranks)."""
    build: Builder = field(repr=False, compare=False)

    @property
    def options(self) -> frozenset[str]:
        """Every option key some torch version writes for it."""
        return frozenset().union(*self.option_sets)

    def fresh(self, group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
        return self.build(group, param, scalar_dtype)


_COMMON = frozenset({"lr", "foreach", "maximize", "differentiable", "capturable"})
_ADAM = _COMMON | {"betas", "eps", "weight_decay", "amsgrad", "fused"}
# torch before 2.8 wrote no decoupled_weight_decay for Adam or AdamW; from 2.8 both write it.
_ADAM_SETS = _sets(tuple(_ADAM), (*_ADAM, "decoupled_weight_decay"))
_ADAM_STATE = _sets(("step", "exp_avg", "exp_avg_sq"), ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))

SPECS = (
    OptimizerSpec("adam", "Adam", _ADAM_SETS, _ADAM_STATE, fresh_states.adam),
    OptimizerSpec("adamw", "AdamW", _ADAM_SETS, _ADAM_STATE, fresh_states.adam),
    OptimizerSpec(
        "nadam", "NAdam",
        _sets((*_COMMON, "betas", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay")),
        _sets(("step", "mu_product", "exp_avg", "exp_avg_sq")),
        fresh_states.nadam,
    ),
    OptimizerSpec(
        "radam", "RAdam",
        _sets((*_COMMON, "betas", "eps", "weight_decay", "decoupled_weight_decay")),
        _sets(("step", "exp_avg", "exp_avg_sq")),
        fresh_states.radam,
    ),
    OptimizerSpec(
        "adamax", "Adamax",
        _sets((*_COMMON, "betas", "eps", "weight_decay")),
        _sets(("step", "exp_avg", "exp_inf")),
        fresh_states.adamax,
    ),
    OptimizerSpec(
        "rmsprop", "RMSprop",
        _sets((*_COMMON, "alpha", "eps", "weight_decay", "momentum", "centered")),
        _sets(
            ("step", "square_avg"),
            ("step", "square_avg", "momentum_buffer"),
            ("step", "square_avg", "grad_avg"),
            ("step", "square_avg", "momentum_buffer", "grad_avg"),
        ),
        fresh_states.rmsprop,
    ),
    OptimizerSpec(
        "sgd", "SGD",
        _sets(("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize", "foreach", "differentiable",
               "fused")),
        _sets(("momentum_buffer",)),
        fresh_states.sgd,
    ),
    OptimizerSpec(
        "adadelta", "Adadelta",
        _sets((*_COMMON, "rho", "eps", "weight_decay")),
        _sets(("step", "square_avg", "acc_delta")),
        fresh_states.adadelta,
    ),
    OptimizerSpec(
        "asgd", "ASGD",
        _sets((*_COMMON, "lambd", "alpha", "t0", "weight_decay")),
        _sets(("step", "eta", "mu", "ax")),
        fresh_states.asgd,
    ),
    OptimizerSpec(
        "rprop", "Rprop",
        _sets((*_COMMON, "etas", "step_sizes")),
        _sets(("step", "prev", "step_size")),
        fresh_states.rprop,
    ),
    OptimizerSpec(
        "adafactor", "Adafactor",
        _sets(("lr", "beta2_decay", "eps", "d", "weight_decay", "foreach", "maximize")),
        _sets(("step", "row_var", "col_var"), ("step", "variance")),
        fresh_states.adafactor,
    ),
    OptimizerSpec(
        "muon", "Muon",
        _sets(("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")),
        _sets(("momentum_buffer",)),
        fresh_states.muon,
    ),
)  # fmt: skip

OPTIMIZERS: Mapping[str, OptimizerSpec] = MappingProxyType({spec.name: spec for spec in SPECS})
"""The lazily-initializing optimizers, by the name ``--optimizer`` takes.

============ ========================================================================
name         fresh entry, in key order (p = the parameter's dtype and shape;
             s = the scalar dtype, float32 unless the default dtype is float64)
============ ========================================================================
adam, adamw  step s[]=0, exp_avg p=0, exp_avg_sq p=0 (+ max_exp_avg_sq p=0 if amsgrad;
             fused: step float32[])
nadam        step s[]=0, mu_product s[]=1, exp_avg p=0, exp_avg_sq p=0
radam        step s[]=0, exp_avg p=0, exp_avg_sq p=0
adamax       step s[]=0, exp_avg p=0, exp_inf p=0
rmsprop      step s[]=0, square_avg p=0 (+ momentum_buffer p=0 if momentum > 0)
             (+ grad_avg p=0 if centered)
sgd          momentum_buffer None if momentum != 0, else nothing at all
adadelta     step s[]=0, square_avg p=0, acc_delta p=0
asgd         step s[]=0, eta s[]=lr, mu s[]=1, ax p=0
rprop        step s[]=0, prev p=0, step_size p=lr (complex p: lr+lr·j)
adafactor    step s[]=0, then for p of 2+ dims row_var p[..., 1]=0 and
             col_var p[..., 1, n]=0 (n = p's last dim); else variance p=0
muon         momentum_buffer p=0
============ ========================================================================
"""

ADDED_OPTIONS: Mapping[str, Mapping[str, tuple[tuple[int, int], Scalar]]] = MappingProxyType(
    {
        "adam": {"decoupled_weight_decay": ((2, 8), False)},
        "adamw": {"decoupled_weight_decay": ((2, 8), False)},
    }
)
"""Option keys torch added to an optimizer's param groups: the release that added each, and the value a group
without it gets on loading there (Adam's ``__setstate__`` sets an absent ``decoupled_weight_decay`` to False;
AdamW's sets it to True whatever was loaded). ``dcp.load`` asks a checkpoint for every key of its template's
groups, so a checkpoint written before the release lacks it."""


LATEST_RELEASE = (99, 0)
"""A release after every one ``ADDED_OPTIONS`` names: asked for every option, with its value."""


def options_asked(names: Iterable[str], release: tuple[int, int]) -> dict[str, Scalar]:
    """The options torch ``release`` writes for each optimizer of ``names`` that an older torch did not, with the
    value a group without it gets there: those every one of ``names`` agrees on (Adam and AdamW, told apart by
    nothing before 2.8, agree)."""
    asked = [
        {key: value for key, (since, value) in ADDED_OPTIONS.get(name, {}).items() if since <= release}
        for name in names
    ]
    if not asked:
        return {}
    first = asked[0]
    return {key: value for key, value in first.items() if all(other.get(key, not value) == value for other in asked)}


WHOLE_OPTIMIZER_STATE = frozenset(
    {"lr", "max_iter", "max_eval", "tolerance_grad", "tolerance_change", "history_size", "line_search_fn"}
)
"""LBFGS's option keys: it keeps one state entry for the whole optimizer, under its first parameter."""
WHOLE_OPTIMIZER_STATE_ADDED = frozenset({"maximize"})
"""LBFGS's option keys that a later torch added (``maximize``: torch 2.15); a group may hold them or not."""

NOT_OPTIMIZER_OPTIONS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "param_names"})
"""Keys torch adds to a param group beside the optimizer's own: ``initial_lr`` (every LR scheduler),
``max_lr``, ``min_lr``, ``max_momentum``, ``base_momentum`` (``OneCycleLR``, ``CyclicLR``), and
``param_names`` (an optimizer built from ``named_parameters()``). They say nothing about the optimizer."""

_OTHER_OPTIMIZER_STATE = frozenset({"sum"})
"""Adagrad's accumulator (it creates its state eagerly, so it is not in the registry)."""


def _param_shaped(spec: OptimizerSpec) -> frozenset[str]:
    """The state keys ``spec`` creates shaped like the parameter, with every optional key switched on."""
    probe = ParamSpec("float32", (2, 3))
    group = ParamGroup((), (("amsgrad", True), ("momentum", 0.9), ("centered", True), ("lr", 1.0)))
    state = spec.fresh(group, probe, "float32")
    return frozenset(key for key, value in state if isinstance(value, FreshTensor) and value.shape == probe.shape)


PARAM_SHAPED_KEYS = frozenset().union(_OTHER_OPTIMIZER_STATE, *(_param_shaped(spec) for spec in SPECS))
"""State keys that hold a tensor shaped like the parameter (SGD's ``momentum_buffer`` may also be None)."""


def _spec_named(optimizer: str) -> OptimizerSpec:
    spec = OPTIMIZERS.get(optimizer.lower())
    if spec is None:
        raise RepairRefused(f"unknown optimizer {shown(optimizer)}; one of: {', '.join(OPTIMIZERS)}")
    return spec


def fresh_state(optimizer: str, group: ParamGroup, param: ParamSpec, *, scalar_dtype: str = "float32") -> FreshState:
    """The entry ``optimizer``'s ``_init_group`` creates for ``param`` on its first step.

    ``group`` is the parameter's param group (its hyperparameters decide optional keys and
    some values; a missing option takes the default torch's ``__setstate__`` gives it).
    ``scalar_dtype`` is torch's ``_get_scalar_dtype()`` of the run that will load the result:
    ``"float64"`` when it calls ``torch.set_default_dtype(torch.float64)``, else ``"float32"``.

    An empty result means the optimizer stores nothing for the parameter (SGD without
    momentum): the missing entry already is its fresh state, and nothing needs adding.

    Raises ``RepairRefused`` for an unknown optimizer name, or when a hyperparameter the entry
    depends on is missing (and torch has no default for it), is a tensor, or is not a number.
    """
    spec = _spec_named(optimizer)
    if scalar_dtype not in SCALAR_DTYPES:
        raise RepairRefused(
            f"scalar dtype {shown(scalar_dtype)} is not one torch uses for 'step'; one of: {', '.join(SCALAR_DTYPES)}"
        )
    return spec.fresh(group, param, scalar_dtype)
