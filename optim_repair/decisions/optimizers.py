"""The registry of lazily-initialized torch optimizers: the state each creates on a parameter's first step.

torch's Adam, AdamW, NAdam, RAdam, Adamax, RMSprop, SGD, Adadelta, ASGD and Rprop create a
parameter's ``state`` entry inside ``_init_group``, on the first ``step()`` in which that
parameter has a gradient. A parameter that never had one has no entry at all. This module
says, for each of them, exactly what that first ``_init_group`` creates, so that a missing
entry can be filled with a state that continues bit-identically (see ``OPTIMIZERS``):

* the same keys in the same order as ``_init_group`` inserts them;
* tensors as ``FreshTensor`` (dtype name, shape, one fill value), never tensor data: moments are
  zeros in the parameter's dtype and shape; ``step`` (and NAdam's ``mu_product``, ASGD's ``eta``
  and ``mu``) are 0-dim tensors in torch's *scalar dtype* (``_get_scalar_dtype()``: float32,
  or float64 when the run's default dtype is float64: pass ``scalar_dtype``);
* hyperparameter-dependent values from the parameter's group (Rprop ``step_size = lr``,
  ASGD ``eta = lr``), exactly as ``_init_group`` reads them;
* plain values where torch stores them: SGD with momentum stores ``momentum_buffer = None``
  until the first update, and ``None`` is *not* the same as zeros (see ``_sgd``).

Devices: ``FreshTensor`` has none. With ``fused=True`` or ``capturable=True`` torch creates
``step`` on the parameter's device (fused Adam/AdamW: always float32); torch's own
``Optimizer.load_state_dict`` moves ``step`` to the parameter's device and casts it to float32
for such groups, and moves every other tensor to the parameter's device, so a CPU fill loads
into the very state ``_init_group`` would have made. We write fused Adam's ``step`` as float32.
One exception: ASGD creates ``step`` on the parameter's device even without ``capturable``, and
``load_state_dict`` leaves a non-capturable ``step`` where it is, so a CPU fill keeps a CPU
``step`` (as any ASGD checkpoint loaded with ``map_location="cpu"`` does; not checked on GPU).

Exactness has one limit that no fill can lift: Rprop's ``step_size`` and ASGD's ``eta`` take
the group's ``lr`` *at the parameter's first gradient*. A fill uses the ``lr`` saved in the
checkpoint; if a scheduler changes ``lr`` before the parameter's first gradient after the
resume, the uninterrupted run would have used that later value. Leaving the entry absent and
loading with ``optim_repair.torch_loader.set_optimizer_state_dict`` is exact in every case.

Everything here is plain data: no torch import, no I/O. Which optimizer wrote a state dict is
told apart from these specs by ``optim_repair.decisions.identify``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from optim_repair.errors import RepairRefused, shown
from optim_repair.records.inventory import ParamGroup, TensorMeta
from optim_repair.records.repair_plan import FreshTensor

FreshValue = FreshTensor | None | float | int | bool
"""One value of a fresh state entry: a tensor to build, or a plain value torch stores as is."""

FreshState = tuple[tuple[str, FreshValue], ...]
"""A fresh state entry: its keys and values in the order ``_init_group`` inserts them."""


@dataclass(frozen=True)
class ParamSpec:
    """The parameter a state entry belongs to: its dtype name (no ``torch.``) and shape."""

    dtype: str
    shape: tuple[int, ...]


SCALAR_DTYPES = ("float32", "float64")
"""What ``torch.optim.optimizer._get_scalar_dtype()`` can return."""


# --- reading hyperparameters the way torch does -------------------------------------------

_MISSING = object()


def _group_option(group: ParamGroup, key: str, optimizer: str, default: object) -> object:
    """``group[key]`` as the optimizer sees it after ``__setstate__`` filled its defaults."""
    if key not in group.option_keys:
        if default is _MISSING:
            raise RepairRefused(f"cannot build fresh {optimizer} state: its param group has no {shown(key)} option")
        return default
    value = group.option(key)
    if isinstance(value, TensorMeta):
        raise RepairRefused(
            f"cannot build fresh {optimizer} state: option {shown(key)} is a tensor "
            f"({value.dtype}{list(value.shape)}) whose value is not read; pass a plain number"
        )
    return value


def _flag(group: ParamGroup, key: str, optimizer: str, default: bool) -> bool:
    """A boolean option, tested for truth as ``_init_group`` does (``None`` is false)."""
    value = _group_option(group, key, optimizer, default)
    if value is None or isinstance(value, (bool, int, float)):
        return bool(value)
    raise RepairRefused(f"cannot build fresh {optimizer} state: option {shown(key)} is {shown(value)}, not a bool")


def _number(group: ParamGroup, key: str, optimizer: str, default: object = _MISSING) -> float:
    """A numeric option (``lr``, ``momentum``), as a Python number."""
    value = _group_option(group, key, optimizer, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RepairRefused(
            f"cannot build fresh {optimizer} state: option {shown(key)} is {shown(value)}, not a number"
        )
    return value


def _step(scalar_dtype: str) -> FreshTensor:
    return FreshTensor(scalar_dtype, (), 0.0)


def _zeros(param: ParamSpec) -> FreshTensor:
    """``torch.zeros_like(p, memory_format=torch.preserve_format)``."""
    return FreshTensor(param.dtype, param.shape, 0)


# --- one builder per optimizer: a transcription of its ``_init_group`` ---------------------


def _adam(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    """Adam and AdamW (``torch/optim/adam.py``; AdamW is a subclass with the same state)."""
    # fused: step = zeros((), dtype=_get_scalar_dtype(is_fused=True)) = float32, on p.device;
    # capturable: the scalar dtype on p.device; otherwise tensor(0.0, scalar dtype) on CPU.
    fused = _flag(group, "fused", "adam", False)
    state: list[tuple[str, FreshValue]] = [
        ("step", _step("float32" if fused else scalar_dtype)),
        ("exp_avg", _zeros(param)),
        ("exp_avg_sq", _zeros(param)),
    ]
    if _flag(group, "amsgrad", "adam", False):
        state.append(("max_exp_avg_sq", _zeros(param)))
    return tuple(state)


def _nadam(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    return (
        ("step", _step(scalar_dtype)),
        ("mu_product", FreshTensor(scalar_dtype, (), 1.0)),
        ("exp_avg", _zeros(param)),
        ("exp_avg_sq", _zeros(param)),
    )


def _radam(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    return (
        ("step", _step(scalar_dtype)),
        ("exp_avg", _zeros(param)),
        ("exp_avg_sq", _zeros(param)),
    )


def _adamax(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    return (
        ("step", _step(scalar_dtype)),
        ("exp_avg", _zeros(param)),
        ("exp_inf", _zeros(param)),
    )


def _rmsprop(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    state: list[tuple[str, FreshValue]] = [
        ("step", _step(scalar_dtype)),
        ("square_avg", _zeros(param)),
    ]
    if _number(group, "momentum", "rmsprop", 0) > 0:
        state.append(("momentum_buffer", _zeros(param)))
    if _flag(group, "centered", "rmsprop", False):
        state.append(("grad_avg", _zeros(param)))
    return tuple(state)


def _sgd(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    """SGD: nothing without momentum; ``momentum_buffer = None`` with it.

    ``SGD._init_group`` creates no tensor: it reads ``state.get("momentum_buffer")`` (None on
    a first step, so ``_single_tensor_sgd`` starts the buffer as ``clone(grad)``) and
    ``step()`` stores the buffer afterwards. A zeros buffer is *not* equivalent: the first
    update would be ``zeros * momentum + (1 - dampening) * grad``, which differs from
    ``grad`` whenever ``dampening != 0``. ``None`` and an absent key behave the same in
    ``Optimizer.load_state_dict`` (the state dict passes ``None`` through); an explicit ``None``
    also survives ``set_optimizer_state_dict(full_state_dict=True)``, which would otherwise
    keep the zeros buffer of its ``_init_optim_state`` fake step. Caveat (torch 2.13): while the
    parameter still has had no gradient, ``get_optimizer_state_dict(...,
    flatten_optimizer_state_dict=True)`` refuses the ``None`` (NotImplementedError); nested DCP
    saves it as a bytes entry. Without momentum SGD never stores state, so a missing entry
    already is the fresh state.
    """
    if _number(group, "momentum", "sgd") != 0:
        return (("momentum_buffer", None),)
    return ()


def _adadelta(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    return (
        ("step", _step(scalar_dtype)),
        ("square_avg", _zeros(param)),
        ("acc_delta", _zeros(param)),
    )


def _asgd(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    # eta = torch.as_tensor(_to_scalar(lr), dtype=scalar dtype): lr rounded to that dtype.
    return (
        ("step", _step(scalar_dtype)),
        ("eta", FreshTensor(scalar_dtype, (), _number(group, "lr", "asgd"))),
        ("mu", FreshTensor(scalar_dtype, (), 1.0)),
        ("ax", _zeros(param)),
    )


def _rprop(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    # step_size = full_like(grad, lr); complex params: full_like(grad, complex(lr, lr)).
    lr = _number(group, "lr", "rprop")
    fill: float | complex = complex(lr, lr) if param.dtype.startswith("complex") else lr
    return (
        ("step", _step(scalar_dtype)),
        ("prev", _zeros(param)),
        ("step_size", FreshTensor(param.dtype, param.shape, fill)),
    )


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
    required_options: frozenset[str]
    """Option keys every version of torch writes for it, some found in no lookalike."""
    allowed_options: frozenset[str]
    """Every option key any version of torch writes for it."""
    state_key_sets: frozenset[frozenset[str]]
    """The key sets its populated entries can have (one per combination of flags)."""
    build: Builder = field(repr=False, compare=False)

    def fresh(self, group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
        return self.build(group, param, scalar_dtype)


_COMMON = frozenset({"lr", "foreach", "maximize", "differentiable", "capturable"})
_ADAM_OPTIONS = _COMMON | {
    "betas", "eps", "weight_decay", "amsgrad", "fused", "decoupled_weight_decay",
}  # fmt: skip

SPECS = (
    OptimizerSpec(
        "adam", "Adam", frozenset({"betas", "amsgrad"}), _ADAM_OPTIONS,
        _sets(("step", "exp_avg", "exp_avg_sq"), ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
        _adam,
    ),
    OptimizerSpec(
        "adamw", "AdamW", frozenset({"betas", "amsgrad"}), _ADAM_OPTIONS,
        _sets(("step", "exp_avg", "exp_avg_sq"), ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
        _adam,
    ),
    OptimizerSpec(
        "nadam", "NAdam", frozenset({"betas", "momentum_decay"}),
        _COMMON | {"betas", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay"},
        _sets(("step", "mu_product", "exp_avg", "exp_avg_sq")),
        _nadam,
    ),
    OptimizerSpec(
        "radam", "RAdam", frozenset({"betas", "weight_decay"}),
        _COMMON | {"betas", "eps", "weight_decay", "decoupled_weight_decay"},
        _sets(("step", "exp_avg", "exp_avg_sq")),
        _radam,
    ),
    OptimizerSpec(
        "adamax", "Adamax", frozenset({"betas", "weight_decay"}),
        _COMMON | {"betas", "eps", "weight_decay"},
        _sets(("step", "exp_avg", "exp_inf")),
        _adamax,
    ),
    OptimizerSpec(
        "rmsprop", "RMSprop", frozenset({"alpha", "centered"}),
        _COMMON | {"alpha", "eps", "weight_decay", "momentum", "centered"},
        _sets(
            ("step", "square_avg"),
            ("step", "square_avg", "momentum_buffer"),
            ("step", "square_avg", "grad_avg"),
            ("step", "square_avg", "momentum_buffer", "grad_avg"),
        ),
        _rmsprop,
    ),
    OptimizerSpec(
        "sgd", "SGD", frozenset({"momentum", "dampening", "nesterov"}),
        _COMMON | {"momentum", "dampening", "nesterov", "weight_decay", "fused"},
        _sets(("momentum_buffer",)),
        _sgd,
    ),
    OptimizerSpec(
        "adadelta", "Adadelta", frozenset({"rho"}),
        _COMMON | {"rho", "eps", "weight_decay"},
        _sets(("step", "square_avg", "acc_delta")),
        _adadelta,
    ),
    OptimizerSpec(
        "asgd", "ASGD", frozenset({"lambd", "alpha", "t0"}),
        _COMMON | {"lambd", "alpha", "t0", "weight_decay"},
        _sets(("step", "eta", "mu", "ax")),
        _asgd,
    ),
    OptimizerSpec(
        "rprop", "Rprop", frozenset({"etas", "step_sizes"}),
        _COMMON | {"etas", "step_sizes"},
        _sets(("step", "prev", "step_size")),
        _rprop,
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
============ ========================================================================
"""

_OTHER_OPTIMIZER_OPTIONS = frozenset(
    {
        # Adagrad (creates its state eagerly in __init__), SparseAdam, LBFGS: not lazy here.
        "initial_accumulator_value", "lr_decay",
        "history_size", "line_search_fn", "max_eval", "max_iter",
        "tolerance_change", "tolerance_grad",
    }
)  # fmt: skip

KNOWN_OPTIONS = frozenset().union(_OTHER_OPTIMIZER_OPTIONS, *(spec.allowed_options for spec in SPECS))
"""Option keys some torch optimizer writes; any other key (``initial_lr`` from an LR scheduler,
a trainer's ``name``) says nothing about the optimizer and is ignored."""

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
