"""Real models and optimizers for tests: tiny torch modules, every lazily-initialized optimizer, real training."""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LinearLR, LRScheduler

from tests.factories.versions import HAS_ADAFACTOR, HAS_MUON, NO_ADAFACTOR, NO_MUON

ParamKey = str | int
"""A parameter's key in an optimizer state dict: its name, or its integer index."""

# --------------------------------------------------------------------------- models


class Net(nn.Module, abc.ABC):
    """A model ``train`` can drive: a fixed example input and ``forward(x, use_all)``."""

    @abc.abstractmethod
    def example_input(self, generator: torch.Generator) -> Tensor: ...

    @abc.abstractmethod
    def forward(self, x: Tensor, use_all: bool = False) -> Tensor: ...


class TwoHeadNet(Net):
    """A trunk and two heads; ``head_unused`` is computed but discarded unless ``use_all``."""

    def __init__(self, in_features: int = 4, hidden: int = 8, out: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.in_features = in_features
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.trunk = nn.Linear(in_features, hidden)
            self.head_used = nn.Linear(hidden, out)
            self.head_unused = nn.Linear(hidden, out)

    def example_input(self, generator: torch.Generator) -> Tensor:
        return torch.randn(3, self.in_features, generator=generator)

    def forward(self, x: Tensor, use_all: bool = False) -> Tensor:
        h = torch.relu(self.trunk(x))
        y: Tensor = self.head_used(h)
        z: Tensor = self.head_unused(h)  # computed either way, as in the bug report
        return y + z if use_all else y


class LitWrapper(Net):
    """What a LightningModule holding ``self.net`` looks like: weights keyed ``net.<name>``."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net

    def example_input(self, generator: torch.Generator) -> Tensor:
        return self.net.example_input(generator)

    def forward(self, x: Tensor, use_all: bool = False) -> Tensor:
        out: Tensor = self.net(x, use_all=use_all)
        return out


class TrickyNet(TwoHeadNet):
    """``TwoHeadNet`` plus complex, zero-size, bf16 and fp16 parameters, some never used."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed=seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            self.spectral = nn.Parameter(torch.randn(3, dtype=torch.complex64))
            self.spectral_unused = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
            self.void = nn.Parameter(torch.zeros(0, 4))
            self.void_unused = nn.Parameter(torch.zeros(0))
            self.gain_bf16 = nn.Parameter(torch.randn(2, 3).to(torch.bfloat16))
            self.gain_bf16_unused = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
            self.gain_fp16 = nn.Parameter(torch.randn(2).to(torch.float16))

    def forward(self, x: Tensor, use_all: bool = False) -> Tensor:
        y = super().forward(x, use_all)
        extra = (
            torch.view_as_real(self.spectral * (1 + 2j)).square().sum()
            + self.void.sum()
            + self.gain_bf16.float().square().sum()
            + self.gain_fp16.float().square().sum()
        )
        if use_all:
            extra = (
                extra
                + torch.view_as_real(self.spectral_unused).square().sum()
                + self.void_unused.sum()
                + self.gain_bf16_unused.float().square().sum()
            )
        return y + extra


class LoraLinear(nn.Module):
    """A frozen ``base`` Linear plus PEFT-style ``lora_A.default`` / ``lora_B.default``."""

    def __init__(self, in_features: int, out_features: int, rank: int = 2) -> None:
        super().__init__()
        self.base_layer = nn.Linear(in_features, out_features)
        self.base_layer.requires_grad_(False)
        lora_b = nn.Linear(rank, out_features, bias=False)
        nn.init.zeros_(lora_b.weight)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": lora_b})

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))
        return out


class GeluProj(nn.Module):
    """diffusers' ``GELU`` module: a (here untargeted, frozen) ``proj`` Linear then gelu."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.proj.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.gelu(self.proj(x))


class FeedForward(nn.Module):
    """diffusers' ``FeedForward``: ``net.0`` GELU(proj), ``net.1`` dropout, ``net.2`` Linear."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProj(dim, 2 * dim), nn.Dropout(0.0), LoraLinear(2 * dim, dim)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class JointAttention(nn.Module):
    """Joint image/text attention with LoRA on every projection."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.to_q = LoraLinear(dim, dim)
        self.to_k = LoraLinear(dim, dim)
        self.to_v = LoraLinear(dim, dim)
        self.add_q_proj = LoraLinear(dim, dim)
        self.add_k_proj = LoraLinear(dim, dim)
        self.add_v_proj = LoraLinear(dim, dim)
        self.to_out = nn.ModuleList([LoraLinear(dim, dim)])
        self.to_add_out = LoraLinear(dim, dim)

    def forward(self, img: Tensor, txt: Tensor) -> tuple[Tensor, Tensor]:
        n_img = img.shape[1]
        q = torch.cat([self.to_q(img), self.add_q_proj(txt)], dim=1)
        k = torch.cat([self.to_k(img), self.add_k_proj(txt)], dim=1)
        v = torch.cat([self.to_v(img), self.add_v_proj(txt)], dim=1)
        attn = torch.softmax(q @ k.transpose(1, 2) / self.dim**0.5, dim=-1) @ v
        return self.to_out[0](attn[:, :n_img]), self.to_add_out(attn[:, n_img:])


class DualStreamBlock(nn.Module):
    """A Qwen-Image-like transformer block: image and text streams, joint attention."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = JointAttention(dim)
        self.img_mlp = FeedForward(dim)
        self.txt_mlp = FeedForward(dim)

    def forward(self, img: Tensor, txt: Tensor) -> tuple[Tensor, Tensor]:
        img_attn, txt_attn = self.attn(img, txt)
        img = img + img_attn
        txt = txt + txt_attn
        return img + self.img_mlp(img), txt + self.txt_mlp(txt)


class BugReportNet(Net):
    """The FINDINGS case in miniature: the last block's text output is computed, then discarded."""

    def __init__(self, dim: int = 4, blocks: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.dim = dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.transformer_blocks = nn.ModuleList([DualStreamBlock(dim) for _ in range(blocks)])

    def example_input(self, generator: torch.Generator) -> Tensor:
        return torch.randn(2, 5, self.dim, generator=generator)  # 3 image + 2 text tokens

    def forward(self, x: Tensor, use_all: bool = False) -> Tensor:
        img, txt = x[:, :3], x[:, 3:]
        for block in self.transformer_blocks:
            img, txt = block(img, txt)
        return torch.cat([img, txt], dim=1) if use_all else img


BUG_REPORT_MISSING: tuple[str, ...] = (
    "transformer_blocks.1.attn.to_add_out.lora_A.default.weight",
    "transformer_blocks.1.attn.to_add_out.lora_B.default.weight",
    "transformer_blocks.1.txt_mlp.net.2.lora_A.default.weight",
    "transformer_blocks.1.txt_mlp.net.2.lora_B.default.weight",
)
"""The entries ``bug_report`` leaves out, in ``param_groups`` order."""


# --------------------------------------------------------------------------- optimizers

_OPTIMIZERS: dict[str, tuple[type[Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2}),
    "rmsprop_centered_momentum": (
        torch.optim.RMSprop,
        {"lr": 1e-2, "centered": True, "momentum": 0.9},
    ),
    "sgd_momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "sgd_dampening": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5}),
    "sgd_nesterov": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "sgd_plain": (torch.optim.SGD, {"lr": 1e-2}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}),
}

OPTIMIZER_NAMES: tuple[str, ...] = tuple(_OPTIMIZERS)
"""Every name ``make_optimizer`` accepts."""

STATELESS_NAMES: frozenset[str] = frozenset({"sgd_plain"})
"""Optimizers that never create state (SGD without momentum)."""


class BranchNet(nn.Module):
    """A trunk and head always used, and an ``extra`` branch used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.extra = nn.Linear(4, 3)

    def forward(self, x: Tensor, use_extra: bool) -> Tensor:
        hidden = torch.tanh(self.trunk(x))
        out: Tensor = self.head(hidden)
        return out + self.extra(hidden) if use_extra else out


def branch_inputs(count: int, seed: int) -> list[Tensor]:
    """``count`` fixed batches for ``BranchNet``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=generator) for _ in range(count)]


def train_branches(model: BranchNet, opt: Optimizer, xs: list[Tensor], use_extra: bool) -> None:
    """Real steps of ``opt`` on ``BranchNet`` over the batches ``xs``."""
    for x in xs:
        opt.zero_grad(set_to_none=True)
        model(x, use_extra).pow(2).mean().backward()
        opt.step()


def make_optimizer(model: nn.Module, name: str = "adamw", groups: int = 1, **kw: Any) -> Optimizer:
    """A real torch optimizer over ``model``'s trainable parameters.

    ``groups=2`` puts matrices (``ndim >= 2``) in group 0 and the rest in group 1 with half the lr
    (and no weight decay where the optimizer has it). ``kw`` overrides the defaults.
    """
    cls, defaults = _OPTIMIZERS[name]
    options = {**defaults, **kw}
    params = [p for p in model.parameters() if p.requires_grad]
    if groups == 1:
        return cls(params, **options)
    if groups != 2:
        raise ValueError("groups must be 1 or 2")
    second: dict[str, Any] = {"params": [p for p in params if p.ndim < 2], "lr": options["lr"] / 2}
    if "weight_decay" in inspect.signature(cls).parameters:
        second["weight_decay"] = 0.0
    return cls([{"params": [p for p in params if p.ndim >= 2]}, second], **options)


def train(
    model: Net,
    optimizer: Optimizer,
    steps: int,
    use_all: bool = False,
    seed: int = 0,
    scheduler: LRScheduler | None = None,
) -> list[float]:
    """Run ``steps`` deterministic real steps on a fixed input; returns the losses."""
    generator = torch.Generator().manual_seed(seed)
    x = model.example_input(generator)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, use_all=use_all).float().square().mean()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _ordered_params(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _stateless(optimizer: Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.SGD) and all(group["momentum"] == 0 for group in optimizer.param_groups)


def absent_entries(model: nn.Module, optimizer: Optimizer, keys: Literal["name", "index"]) -> tuple[ParamKey, ...]:
    """Params of the live ``optimizer`` with no ``state`` although a step would create one."""
    if _stateless(optimizer):
        return ()
    names = _names(model)
    return tuple(
        names[id(p)] if keys == "name" else index
        for index, p in enumerate(_ordered_params(optimizer))
        if p not in optimizer.state
    )


def all_keys(model: nn.Module, optimizer: Optimizer, keys: Literal["name", "index"]) -> tuple[ParamKey, ...]:
    """Every param key of ``optimizer`` in ``param_groups`` order."""
    names = _names(model)
    params = _ordered_params(optimizer)
    return tuple(names[id(p)] if keys == "name" else i for i, p in enumerate(params))


# --------------------------------------------------------------------------- shared pieces


@dataclass
class Run:
    """A trained model with its live optimizer and scheduler."""

    model: Net
    optimizer: Optimizer
    scheduler: LRScheduler
    steps: int


def run(
    model: Net | None = None,
    optimizer: str = "adamw",
    groups: int = 1,
    steps: int = 2,
    use_all: bool = False,
    seed: int = 0,
) -> Run:
    """Train ``model`` (default ``TwoHeadNet``) for ``steps`` with a ``LinearLR`` schedule."""
    model = TwoHeadNet(seed=seed) if model is None else model
    opt = make_optimizer(model, optimizer, groups=groups)
    scheduler = LinearLR(opt, start_factor=0.5, total_iters=4)
    train(model, opt, steps, use_all=use_all, seed=seed, scheduler=scheduler)
    return Run(model, opt, scheduler, steps)


if HAS_MUON or TYPE_CHECKING:

    class MatrixMuon(torch.optim.Muon):
        """torch's Muon over the parameters it supports: the matrices (the others are not trained)."""

        def __init__(self, params: Any, **kwargs: Any) -> None:
            super().__init__([p for p in params if p.ndim == 2], **kwargs)

else:

    class MatrixMuon(Optimizer):
        """Before torch 2.9 there is no Muon: a test that makes one skips, saying so."""

        def __init__(self, params: Any, **kwargs: Any) -> None:
            import pytest

            pytest.skip(NO_MUON)


if HAS_ADAFACTOR or TYPE_CHECKING:
    TorchAdafactor = torch.optim.Adafactor
else:

    class TorchAdafactor(Optimizer):
        """Before torch 2.5 there is no Adafactor: a test that makes one skips, saying so."""

        def __init__(self, params: Any, **kwargs: Any) -> None:
            import pytest

            pytest.skip(NO_ADAFACTOR)


# id -> (registry name, class, keyword arguments): every flag that changes the fresh state.
VARIANTS: dict[str, tuple[str, type[Optimizer], dict[str, Any]]] = {
    "adam": ("adam", torch.optim.Adam, {"lr": 1e-2}),
    "adam-amsgrad": ("adam", torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "adamw": ("adamw", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw-amsgrad": ("adamw", torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
    "nadam": ("nadam", torch.optim.NAdam, {"lr": 1e-2}),
    "radam": ("radam", torch.optim.RAdam, {"lr": 1e-2}),
    "adamax": ("adamax", torch.optim.Adamax, {"lr": 1e-2}),
    "rmsprop": ("rmsprop", torch.optim.RMSprop, {"lr": 1e-2}),
    "rmsprop-centered-momentum": (
        "rmsprop", torch.optim.RMSprop, {"lr": 1e-2, "centered": True, "momentum": 0.9},
    ),
    "sgd": ("sgd", torch.optim.SGD, {"lr": 1e-2}),
    "sgd-momentum": ("sgd", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "sgd-dampening": ("sgd", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5}),
    "sgd-nesterov": ("sgd", torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "adadelta": ("adadelta", torch.optim.Adadelta, {"lr": 0.5}),
    # t0=-1: averaging from the first step, so a wrong fresh mu would show in ax.
    "asgd": ("asgd", torch.optim.ASGD, {"lr": 1e-2, "t0": -1.0}),
    "rprop": ("rprop", torch.optim.Rprop, {"lr": 3e-3}),
    "adafactor": ("adafactor", TorchAdafactor, {"lr": 1e-2}),
    "muon": ("muon", MatrixMuon, {"lr": 1e-2}),
}  # fmt: skip
