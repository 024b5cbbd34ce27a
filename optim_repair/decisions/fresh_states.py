"""What each lazily-initialized torch optimizer creates on a parameter's first step: one builder per optimizer.

torch's Adam, AdamW, NAdam, RAdam, Adamax, RMSprop, SGD, Adadelta, ASGD, Rprop, Adafactor and
Muon create a parameter's ``state`` entry inside ``_init_group``, on the first ``step()`` in which that
parameter has a gradient. A parameter that never had one has no entry at all. This module
says, for each of them, exactly what that first ``_init_group`` creates, so that a missing
entry can be filled with a state that continues bit-identically:

* the same keys in the same order as ``_init_group`` inserts them;
* tensors as ``FreshTensor`` (dtype name, shape, one fill value), never tensor data: moments are
  zeros in the parameter's dtype and shape; ``step`` (and NAdam's ``mu_product``, ASGD's ``eta``
  and ``mu``) are 0-dim tensors in torch's *scalar dtype* (``_get_scalar_dtype()``: float32,
  or float64 when the run's default dtype is float64: pass ``scalar_dtype``);
* hyperparameter-dependent values from the parameter's group (Rprop ``step_size = lr``,
  ASGD ``eta = lr``), exactly as ``_init_group`` reads them;
* plain values where torch stores them: SGD with momentum stores ``momentum_buffer = None``
  until the first update, and ``None`` is *not* the same as zeros (see ``sgd``); Muon, whose
  ``momentum_buffer`` looks the same, creates zeros;
* shapes that are not the parameter's where torch factors a moment: Adafactor keeps a row and a
  column factor for a parameter of two or more dimensions, and a full ``variance`` below.

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

Everything here is plain data: no torch import, no I/O. The registry of
``optim_repair.decisions.optimizers`` names each builder and says how to recognize its optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def adam(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
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


def nadam(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    return (
        ("step", _step(scalar_dtype)),
        ("mu_product", FreshTensor(scalar_dtype, (), 1.0)),
        ("exp_avg", _zeros(param)),
        ("exp_avg_sq", _zeros(param)),
    )


def radam(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    return (
        ("step", _step(scalar_dtype)),
        ("exp_avg", _zeros(param)),
        ("exp_avg_sq", _zeros(param)),
    )


def adamax(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    return (
        ("step", _step(scalar_dtype)),
        ("exp_avg", _zeros(param)),
        ("exp_inf", _zeros(param)),
    )


def rmsprop(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    state: list[tuple[str, FreshValue]] = [
        ("step", _step(scalar_dtype)),
        ("square_avg", _zeros(param)),
    ]
    if _number(group, "momentum", "rmsprop", 0) > 0:
        state.append(("momentum_buffer", _zeros(param)))
    if _flag(group, "centered", "rmsprop", False):
        state.append(("grad_avg", _zeros(param)))
    return tuple(state)


def sgd(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
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


def adadelta(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    return (
        ("step", _step(scalar_dtype)),
        ("square_avg", _zeros(param)),
        ("acc_delta", _zeros(param)),
    )


def asgd(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    # eta = torch.as_tensor(_to_scalar(lr), dtype=scalar dtype): lr rounded to that dtype.
    return (
        ("step", _step(scalar_dtype)),
        ("eta", FreshTensor(scalar_dtype, (), _number(group, "lr", "asgd"))),
        ("mu", FreshTensor(scalar_dtype, (), 1.0)),
        ("ax", _zeros(param)),
    )


def rprop(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    # step_size = full_like(grad, lr); complex params: full_like(grad, complex(lr, lr)).
    lr = _number(group, "lr", "rprop")
    fill: float | complex = complex(lr, lr) if param.dtype.startswith("complex") else lr
    return (
        ("step", _step(scalar_dtype)),
        ("prev", _zeros(param)),
        ("step_size", FreshTensor(param.dtype, param.shape, fill)),
    )


def adafactor(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    """Adafactor (``torch/optim/_adafactor.py``): ``step``, then the factors of ``p.grad.dim() > 1``.

    ``row_var = grad.new_zeros(shape with the last dim 1)``, ``col_var = grad.new_zeros(shape with
    the second-last dim 1)``; a parameter of one dimension or none gets ``variance = zeros_like``.
    """
    shape = param.shape
    if len(shape) > 1:
        return (
            ("step", _step(scalar_dtype)),
            ("row_var", FreshTensor(param.dtype, (*shape[:-1], 1), 0)),
            ("col_var", FreshTensor(param.dtype, (*shape[:-2], 1, shape[-1]), 0)),
        )
    return (("step", _step(scalar_dtype)), ("variance", _zeros(param)))


def muon(group: ParamGroup, param: ParamSpec, scalar_dtype: str) -> FreshState:
    """Muon (``torch/optim/_muon.py``): ``momentum_buffer = zeros_like(p.grad)``, and no ``step``."""
    return (("momentum_buffer", _zeros(param)),)
