"""optim-repair on checkpoints the real training libraries write, resumed through each library's own resume path.

transformers' ``Trainer`` (``checkpoint-<n>/``), accelerate's ``Accelerator.save_state`` and pytorch-lightning's
``ModelCheckpoint`` (one optimizer, and two with manual optimization) write their checkpoints through their public
APIs, from a tiny model whose ``aux`` head joins the loss only after the checkpoint and whose ``never`` head never
does: AdamW has no state for either when the checkpoint is written. Each checkpoint is index-keyed, so ``inspect``
must call it healthy (``optimizer.load_state_dict`` resumes absent entries exactly) and ``--strict`` repairable;
``fix`` must write a verified copy that differs only by the added entries; and resuming from that copy through the
library (``train(resume_from_checkpoint=)``, ``load_state``, ``fit(ckpt_path=)``) must end bit-identical to
resuming from the original and to the run that was never interrupted. Dropout in the HF and accelerate runs makes
the comparison depend on each library restoring its RNG files from the copy too.

A missing library skips its tests with the reason; nothing is mocked. Install them with ``pip install
transformers accelerate pytorch-lightning`` (with torch pinned: ``-c`` a file holding ``torch==<version>``).
"""

from __future__ import annotations

import functools
import importlib
import json
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from typer.testing import Result

import optim_repair
from optim_repair.errors import RepairRefused
from tests.factories.built import Built, Site
from tests.factories.models import ParamKey
from tests.factories.support import assert_fixed_copy, assert_nothing_written, fix, load, untouched

UNUSED_AT_SAVE = ("aux.weight", "aux.bias", "never.weight", "never.bias")
"""The parameters no optimizer has state for when the checkpoint is written (``AuxNet`` names)."""
NEVER = ("never.weight", "never.bias")

pytestmark = [
    # pytorch-lightning 2.6 against torch 2.13's pytree, and resuming into a fresh directory: the libraries' own noise
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed"),
]

Weights = dict[str, Tensor]

# --------------------------------------------------------------------------- shared pieces


class AuxNet(nn.Module):
    """A trunk and a head; ``aux`` joins the output only once ``use_aux`` is set, ``never`` never does."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.trunk = nn.Linear(4, 8)
            self.head = nn.Linear(8, 2)
            self.aux = nn.Linear(8, 2)
            self.never = nn.Linear(8, 2)
        self.dropout = nn.Dropout(dropout)
        self.use_aux = False

    def predict(self, x: Tensor) -> Tensor:
        h = self.dropout(torch.relu(self.trunk(x)))
        out: Tensor = self.head(h)
        return out + self.aux(h) if self.use_aux else out

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        return (self.predict(x) - y).square().mean()

    def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
        """What HF's ``Trainer`` calls: the batch's columns as keywords, the loss under ``"loss"``."""
        out = self.predict(x)
        return {"loss": (out - labels).square().mean(), "logits": out}


def data(n: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=generator), torch.randn(n, 2, generator=generator)


def weights(module: nn.Module, prefix: str = "") -> Weights:
    """The module's parameters, cloned, keyed by ``AuxNet`` names (``prefix`` removed)."""
    return {name.removeprefix(prefix): p.detach().clone() for name, p in module.named_parameters()}


def assert_bit_identical(actual: Weights, expected: Weights, what: str) -> None:
    assert list(actual) == list(expected)
    differ = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert differ == [], f"{what}: {differ} differ"


def absent_indices(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> tuple[int, ...]:
    """The indices ``optimizer.state_dict()`` gives ``params``: positions across its param groups, in order."""
    wanted = {id(p) for p in params}
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    return tuple(index for index, p in enumerate(ordered) if id(p) in wanted)


def named(module: nn.Module, names: tuple[str, ...], prefix: str = "") -> list[nn.Parameter]:
    params = dict(module.named_parameters())
    return [params[prefix + name] for name in names]


def library(module: str, distribution: str) -> Any:
    """The library, or a skip that says why it could not be imported."""
    try:
        imported: ModuleType = importlib.import_module(module)
    except ImportError as error:
        pytest.skip(f"{distribution} cannot be imported ({error}): pip install {distribution} (the 'test' extra)")
    return imported


@contextmanager
def isolated() -> Iterator[None]:
    """Leave the global RNGs (torch's, Python's, numpy's), torch's determinism flag and the environment as they
    were; keep transformers off the network."""
    numpy_random: Any
    try:
        import numpy

        numpy_random = numpy.random
    except ImportError:  # the libraries need numpy; without it, their tests skip
        numpy_random = None
    python_state = random.getstate()
    numpy_state = None if numpy_random is None else numpy_random.get_state()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        with pytest.MonkeyPatch.context() as env, torch.random.fork_rng(devices=[]):
            for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
                env.setenv(name, "1")  # the PL_ ones: restored, after seed_everything sets them
            torch.use_deterministic_algorithms(True)
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        random.setstate(python_state)
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    with isolated():
        yield


@dataclass(frozen=True)
class Written:
    """One library's uninterrupted run: the checkpoint it wrote mid-way, what is absent there, its final weights."""

    built: Built
    final: Weights
    saved: Weights
    """The weights at the checkpoint."""
    kind: str = ""
    """Which model the run trained, where a library's tests run on more than one (``HF_KINDS``)."""

    @property
    def path(self) -> Path:
        return self.built.path


def assert_inspected(written: Written) -> None:
    """Healthy as written (index keys, ``optimizer.load_state_dict``); repairable under ``strict``."""
    diagnosis = optim_repair.inspect(written.path)
    assert diagnosis.verdict == "healthy"
    found = {Site(opt.file, opt.optimizer.address): opt for opt in diagnosis.optimizers}
    assert set(found) == set(written.built.missing)
    for site, missing in written.built.missing.items():
        opt = found[site]
        assert (opt.key_style, opt.loader, opt.resumes_as_is) == ("index", "load_state_dict", True)
        assert opt.missing == missing
        assert (opt.empty, opt.malformed) == ((), ())
        codes = ["cold"] if opt.states == 0 else []  # none of its parameters had a gradient yet
        codes.append("sparse-ok-for-load-state-dict")
        assert [(n.code, n.severity) for n in opt.notices] == [(code, "info") for code in codes]
    strict = optim_repair.inspect(written.path, strict=True)
    assert strict.verdict == "repairable"
    assert [opt.missing for opt in strict.optimizers] == [opt.missing for opt in diagnosis.optimizers]


def fixed_copy(written: Written, tmp_path: Path) -> Path:
    """``fix`` with its default fill: exactly the absent entries added as ``{}``, every other byte and file as it
    was (verified); healthy, even under ``strict``, afterwards."""
    out = tmp_path / f"fixed{written.path.suffix}"
    result = fix(written.path, out)
    assert result.fill == "empty"
    added = {(Site(a.file, a.address), a.param) for a in result.added}
    assert added == {(site, param) for site, missing in written.built.missing.items() for param in missing}
    assert result.verification.tensors > 0
    assert_fixed_copy(written.built, out)
    again = optim_repair.inspect(out, strict=True)
    assert again.verdict == "healthy"
    assert all(opt.missing == () for opt in again.optimizers)
    return out


def assert_resumes_exactly(written: Written, resume: Callable[[Path], Weights], fixed: Path) -> None:
    """Resuming from ``fixed`` ends where resuming from the original and the uninterrupted run end; ``aux``
    trained after the checkpoint (its state was created on resume), ``never`` did not move."""
    with untouched(written.path):
        original = resume(written.path)
    repaired = resume(fixed)
    assert_bit_identical(original, written.final, "resumed from the original vs uninterrupted")
    assert_bit_identical(repaired, written.final, "resumed from the repaired copy vs uninterrupted")
    assert not torch.equal(repaired["aux.weight"], written.saved["aux.weight"]), "aux never trained after resume"
    assert all(torch.equal(repaired[name], written.saved[name]) for name in NEVER)


def assert_fresh_refused(written: Written, tmp_path: Path) -> None:
    """Index keys name no parameters, so the fresh fill has no shapes to build state from: refused, nothing
    written, the empty fill named as the remedy."""
    out = tmp_path / "fresh"
    with pytest.raises(RepairRefused, match=r"index-keyed optimizer .* names no parameters") as refused:
        fix(written.path, out, fill="fresh")
    assert "fill='empty'" in str(refused.value)
    assert_nothing_written(out)


# --------------------------------------------------------------------------- transformers Trainer

HF_SAVE, HF_STEPS = 2, 6  # 16 samples in batches of 4: checkpoint-2 is mid-epoch, the run ends in epoch 2
HF_KINDS = ("module", "pretrained")
"""The model the Trainer gets: ``AuxNet`` itself (saved as its state dict), or a ``PreTrainedModel`` holding it as
``net`` (saved by ``save_pretrained``: ``config.json`` beside the weights)."""


@dataclass(frozen=True)
class HF:
    trainer: type[Any]
    arguments: type[Any]
    aux_from: type[Any]
    """A callback switching ``aux`` on from step ``HF_SAVE``."""
    pretrained: Callable[[], nn.Module]
    """A new ``PreTrainedModel`` holding an ``AuxNet`` as ``net``."""


@functools.cache
def hf() -> HF:
    library("accelerate", "accelerate")  # the Trainer requires it (transformers[torch])
    transformers = library("transformers", "transformers")

    callback: Any = transformers.TrainerCallback
    config: Any = transformers.PretrainedConfig
    pretrained: Any = transformers.PreTrainedModel

    class AuxFrom(callback):  # type: ignore[misc]
        def __init__(self, net: AuxNet) -> None:
            self.net = net

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.net.use_aux = state.global_step >= HF_SAVE

    class AuxConfig(config):  # type: ignore[misc]
        model_type = "optim-repair-aux-net"

    class AuxModel(pretrained):  # type: ignore[misc]
        config_class = AuxConfig

        def __init__(self, config: AuxConfig) -> None:
            super().__init__(config)
            self.net = AuxNet(dropout=0.1)
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:
            """``AuxNet`` seeds its own weights."""

        def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
            out: dict[str, Tensor] = self.net(x, labels)
            return out

    return HF(transformers.Trainer, transformers.TrainingArguments, AuxFrom, lambda: AuxModel(AuxConfig()))


class PairData(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self) -> None:
        self.x, self.y = data(16)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


def hf_prefix(kind: str) -> str:
    return "net." if kind == "pretrained" else ""


def hf_trainer(kind: str, output_dir: Path) -> Any:
    """A ``Trainer`` with its defaults (``adamw_torch_fused``, linear decay, decay / no-decay param groups)."""
    lib = hf()
    args = lib.arguments(
        output_dir=str(output_dir),
        max_steps=HF_STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        weight_decay=0.1,
        save_strategy="steps",
        save_steps=HF_SAVE,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    model = lib.pretrained() if kind == "pretrained" else AuxNet(dropout=0.1)
    net = model.net if kind == "pretrained" else model
    return lib.trainer(model=model, args=args, train_dataset=PairData(), callbacks=[lib.aux_from(net)])


def hf_resume(kind: str, tmp_path: Path, checkpoint: Path) -> Weights:
    trainer = hf_trainer(kind, tmp_path / f"resumed-from-{checkpoint.name}")
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == HF_STEPS
    return weights(trainer.model, hf_prefix(kind))


@pytest.fixture(scope="module", params=HF_KINDS)
def hf_written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Written:
    kind: str = request.param
    prefix = hf_prefix(kind)
    with isolated():
        trainer = hf_trainer(kind, tmp_path_factory.mktemp(f"hf-{kind}") / "run")
        trainer.train()
    directory = Path(trainer.args.output_dir) / f"checkpoint-{HF_SAVE}"
    missing = absent_indices(trainer.optimizer, named(trainer.model, UNUSED_AT_SAVE, prefix))
    from safetensors.torch import load_file

    saved = {name.removeprefix(prefix): t for name, t in load_file(directory / "model.safetensors").items()}
    built = Built(directory, {Site("optimizer.pt"): missing})
    return Written(built, weights(trainer.model, prefix), saved, kind)


def test_hf_trainer_checkpoint_is_healthy_as_written_and_strictly_repairable(
    hf_written: Written, tmp_path: Path
) -> None:
    config = ["config.json"] if hf_written.kind == "pretrained" else []
    assert sorted(p.name for p in hf_written.path.iterdir()) == [
        *config,
        "model.safetensors",
        "optimizer.pt",
        "rng_state.pth",
        "scheduler.pt",
        "trainer_state.json",
        "training_args.bin",
    ]
    assert_inspected(hf_written)
    (opt,) = optim_repair.inspect(hf_written.path).optimizers
    assert (opt.file, opt.location, opt.groups) == ("optimizer.pt", "", 2)  # HF's decay / no-decay groups
    assert_fresh_refused(hf_written, tmp_path)


def test_hf_trainer_companion_files_are_reported_for_what_they_are(
    hf_written: Written, cli: Callable[..., Result]
) -> None:
    """``rng_state.pth`` pickles numpy arrays (data: HF loads it with ``weights_only``), ``training_args.bin``
    a ``TrainingArguments`` (code: never loaded on resume, and no security warning on every checkpoint); neither
    holds optimizer state."""
    report = json.loads(cli(["inspect", hf_written.path, "--json"]).stdout)
    assert report["verdict"] == "healthy"
    skipped = {entry["file"]: (entry["kind"], entry["reason"]) for entry in report["skipped"]}
    assert skipped == {
        "rng_state.pth": ("other", "holds no optimizer state"),
        "scheduler.pt": ("other", "holds no optimizer state"),
        "training_args.bin": (
            "other",
            "the HF Trainer's arguments (transformers.training_args.TrainingArguments): not optimizer state, and "
            "never read",
        ),
    }
    assert report["notices"] == []
    cli(["inspect", hf_written.path, "--strict"], code=1)


def test_hf_trainer_resumes_exactly_from_the_repaired_copy(hf_written: Written, tmp_path: Path) -> None:
    fixed = fixed_copy(hf_written, tmp_path)
    assert_resumes_exactly(hf_written, functools.partial(hf_resume, hf_written.kind, tmp_path), fixed)


def test_hf_trainer_resumes_the_cli_repair(hf_written: Written, tmp_path: Path, cli: Callable[..., Result]) -> None:
    """The CLI's copy resumes exactly; ``--fill fresh`` is refused for index keys (exit 3), writing nothing."""
    fixed, fresh = tmp_path / "fixed", tmp_path / "fresh"
    with untouched(hf_written.path):
        refused = cli(["fix", hf_written.path, "--out", fresh, "--fill", "fresh"], code=3)
        cli(["fix", hf_written.path, "--out", fixed, "--quiet"])
    assert "names no parameters" in refused.stderr
    assert "--fill empty" in refused.stderr
    assert_nothing_written(fresh)
    cli(["inspect", fixed, "--strict"])
    sd = load(fixed / "optimizer.pt")
    assert all(sd["state"][index] == {} for index in hf_written.built.missing[Site("optimizer.pt")])
    resumed = hf_resume(hf_written.kind, tmp_path, fixed)
    assert_bit_identical(resumed, hf_written.final, "resumed from the CLI's copy vs uninterrupted")


# --------------------------------------------------------------------------- accelerate

ACC_SAVE, ACC_STEPS = 2, 6
ACC_MISSING = (4, 5, 6, 7)  # one param group, in AuxNet's order: trunk, head, aux, never


def accelerate_run(save: Path | None = None, resume: Path | None = None) -> Weights:
    """AdamW and a LinearLR through ``Accelerator.prepare``; ``save_state(save)`` after ``ACC_SAVE`` steps, or
    ``load_state(resume)`` and the remaining steps. Returns the final weights."""
    accelerate = library("accelerate", "accelerate")
    state = library("accelerate.state", "accelerate")
    state.AcceleratorState._reset_state(True)  # as accelerate's own tests do: one Accelerator per run
    state.GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)
    accelerate.utils.set_seed(0)
    net = AuxNet(dropout=0.1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=ACC_STEPS)
    model, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)
    x, y = data(4 * ACC_STEPS)
    start = 0
    if resume is not None:
        accelerator.load_state(str(resume))
        start = ACC_SAVE
    for step in range(start, ACC_STEPS):
        if step == ACC_SAVE and save is not None:
            accelerator.save_state(str(save))
        net.use_aux = step >= ACC_SAVE
        optimizer.zero_grad(set_to_none=True)
        batch = slice(4 * step, 4 * step + 4)
        accelerator.backward(net.loss(x[batch], y[batch]))
        optimizer.step()
        scheduler.step()
    assert absent_indices(optimizer, named(net, UNUSED_AT_SAVE)) == ACC_MISSING
    return weights(accelerator.unwrap_model(model))


@pytest.fixture(scope="module")
def accelerate_written(tmp_path_factory: pytest.TempPathFactory) -> Written:
    directory = tmp_path_factory.mktemp("accelerate") / "state"
    with isolated():
        final = accelerate_run(save=directory)
    from safetensors.torch import load_file

    saved = load_file(directory / "model.safetensors")
    return Written(Built(directory, {Site("optimizer.bin"): ACC_MISSING}), final, saved)


def test_accelerate_state_is_healthy_as_written_and_strictly_repairable(
    accelerate_written: Written, tmp_path: Path
) -> None:
    assert sorted(p.name for p in accelerate_written.path.iterdir()) == [
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "scheduler.bin",
    ]
    assert_inspected(accelerate_written)
    assert_fresh_refused(accelerate_written, tmp_path)


def test_accelerate_resumes_exactly_from_the_repaired_copy(accelerate_written: Written, tmp_path: Path) -> None:
    fixed = fixed_copy(accelerate_written, tmp_path)
    # load_state ignores an unreadable random_states_0.pkl ("Could not load random states"): the dropout
    # makes the comparison below fail unless the copy carried it over intact
    rng = "random_states_0.pkl"
    assert (fixed / rng).read_bytes() == (accelerate_written.path / rng).read_bytes()
    assert_resumes_exactly(accelerate_written, lambda path: accelerate_run(resume=path), fixed)


# --------------------------------------------------------------------------- pytorch-lightning

PL_EPOCHS = 3  # 8 samples in batches of 4, unshuffled: the epoch-0 checkpoint is written after 2 batches


@functools.cache
def lightning_classes() -> tuple[type[Any], type[Any]]:
    """A LightningModule with one optimizer (automatic optimization) and one with two (manual optimization);
    ``aux`` joins the loss from epoch 1."""
    pl = library("pytorch_lightning", "pytorch-lightning")

    module: Any = pl.LightningModule

    class OneOptimizer(module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = AuxNet()

        def training_step(self, batch: list[Tensor], batch_index: int) -> Tensor:
            self.net.use_aux = self.current_epoch >= 1
            return self.net.loss(*batch)

        def configure_optimizers(self) -> dict[str, Any]:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=6)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class TwoOptimizers(module):  # type: ignore[misc]
        """AdamW for trunk, head and ``never``; Adam for ``aux`` alone, so it has no state at all at epoch 0."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = AuxNet()

        def training_step(self, batch: list[Tensor], batch_index: int) -> None:
            self.net.use_aux = self.current_epoch >= 1
            optimizers = self.optimizers()
            self.manual_backward(self.net.loss(*batch))
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            net = self.net
            main = [*net.trunk.parameters(), *net.head.parameters(), *net.never.parameters()]
            return [
                torch.optim.AdamW(main, lr=1e-2, weight_decay=0.1),
                torch.optim.Adam(net.aux.parameters(), lr=1e-2),
            ]

    return OneOptimizer, TwoOptimizers


def lightning_fit(module_class: type[Any], root: Path, checkpoint: Path | None = None) -> Weights:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        max_epochs=PL_EPOCHS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[ModelCheckpoint(dirpath=str(root / "checkpoints"), every_n_epochs=1, save_top_k=-1)],
    )
    x, y = data(8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)
    module = module_class()
    trainer.fit(module, loader, ckpt_path=None if checkpoint is None else str(checkpoint))
    assert trainer.current_epoch == PL_EPOCHS
    return weights(module, prefix="net.")


def lightning_written(module_class: type[Any], root: Path, missing: Mapping[Site, tuple[ParamKey, ...]]) -> Written:
    with isolated():
        final = lightning_fit(module_class, root)
    (path,) = (root / "checkpoints").glob("epoch=0-*.ckpt")
    saved = {k.removeprefix("net."): v for k, v in load(path)["state_dict"].items()}
    return Written(Built(path, missing), final, saved)


@pytest.fixture(scope="module")
def lightning_one(tmp_path_factory: pytest.TempPathFactory) -> Written:
    one, _ = lightning_classes()
    missing = {Site("", ("optimizer_states", 0)): (4, 5, 6, 7)}
    return lightning_written(one, tmp_path_factory.mktemp("lightning-one"), missing)


@pytest.fixture(scope="module")
def lightning_two(tmp_path_factory: pytest.TempPathFactory) -> Written:
    _, two = lightning_classes()
    missing = {Site("", ("optimizer_states", 0)): (4, 5), Site("", ("optimizer_states", 1)): (0, 1)}
    return lightning_written(two, tmp_path_factory.mktemp("lightning-two"), missing)


def test_lightning_checkpoint_is_healthy_as_written_and_strictly_repairable(
    lightning_one: Written, tmp_path: Path
) -> None:
    assert_inspected(lightning_one)
    assert_fresh_refused(lightning_one, tmp_path)
    (opt,) = optim_repair.inspect(lightning_one.path).optimizers
    assert (opt.file, opt.location, opt.cold) == ("", "optimizer_states[0]", False)


def test_lightning_two_optimizers_are_healthy_as_written_and_strictly_repairable(lightning_two: Written) -> None:
    assert_inspected(lightning_two)
    found = [(opt.location, opt.states, opt.cold) for opt in optim_repair.inspect(lightning_two.path).optimizers]
    assert found == [("optimizer_states[0]", 4, False), ("optimizer_states[1]", 0, True)]


def test_lightning_resumes_exactly_from_the_repaired_copy(lightning_one: Written, tmp_path: Path) -> None:
    one, _ = lightning_classes()
    fixed = fixed_copy(lightning_one, tmp_path)
    assert_resumes_exactly(lightning_one, lambda path: lightning_fit(one, tmp_path / path.stem, path), fixed)


def test_lightning_two_optimizers_resume_exactly_from_the_repaired_copy(lightning_two: Written, tmp_path: Path) -> None:
    _, two = lightning_classes()
    fixed = fixed_copy(lightning_two, tmp_path)
    assert_resumes_exactly(lightning_two, lambda path: lightning_fit(two, tmp_path / path.stem, path), fixed)
