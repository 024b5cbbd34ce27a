"""Reading every optimizer under a checkpoint argument: ``checkpoint.reading`` and ``checkpoint.discovery``."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

from optim_repair.errors import InputError, UnsafeInputError
from tests import factories
from tests.factories import hostile, models, trainers
from tests.factories.built import Built
from tests.factories.support import read_checkpoint


def found(built: Built) -> dict[tuple[str, str], str]:
    inventory = read_checkpoint(built.path)
    return {(opt.file, opt.location): opt.key_style for opt in inventory.optimizers}


def expected(built: Built, style: str) -> dict[tuple[str, str], str]:
    return {(site.file, site.location): style for site in built.sites}


@pytest.mark.parametrize(
    ("factory", "style"),
    [
        ("unirl_torch", "name"),
        ("petrainer", "name"),
        ("hf_trainer", "index"),
        ("accelerate", "index"),
        ("lightning", "index"),
        ("multi_optimizer", "name"),
        ("legacy_format", "name"),
        ("bug_report", "name"),
        ("cold", "index"),
    ],
)
def test_each_layout_reports_file_location_and_key_style(root: Path, factory: str, style: str) -> None:
    built = factories.FACTORIES[factory](root)
    assert found(built) == expected(built, style)


def test_file_argument_is_file_empty_string(root: Path) -> None:
    built = trainers.lightning(root)
    inventory = read_checkpoint(built.path)
    assert not inventory.is_directory and inventory.path == str(built.path) and inventory.format == "torch"
    assert [opt.file for opt in inventory.optimizers] == [""]
    assert inventory.skipped == ()


def test_petrainer_files_are_relative_posix_paths(root: Path) -> None:
    built = trainers.petrainer(root)
    inventory = read_checkpoint(built.path)
    assert [f.file for f in inventory.files] == ["ar/checkpoint.pt", "diffusion/checkpoint.pt"]
    assert inventory.is_directory


def test_a_parent_directory_finds_nested_checkpoints(root: Path) -> None:
    trainers.unirl_torch(root / "run", steps=2)
    trainers.unirl_torch(root / "run", steps=3)
    inventory = read_checkpoint(root / "run")
    assert [opt.file for opt in inventory.optimizers] == ["checkpoint-2/checkpoint.pt", "checkpoint-3/checkpoint.pt"]


def test_hf_neighbours_are_skipped_with_reasons(root: Path) -> None:
    built = trainers.hf_trainer(root)
    inventory = read_checkpoint(built.path)
    skipped = {s.file: s.reason for s in inventory.skipped}
    assert skipped == {
        "rng_state.pth": "holds no optimizer state",  # numpy arrays: data, which weights_only reads
        "scheduler.pt": "holds no optimizer state",
        "training_args.bin": "refuses to load global tests.factories.trainers.TrainingArguments",
    }
    assert [w.source for w in inventory.weights] == ["model.safetensors"]


def test_accelerate_reads_bin_files_and_ignores_other_suffixes(root: Path) -> None:
    built = trainers.accelerate(root)
    inventory = read_checkpoint(built.path)
    assert [opt.file for opt in inventory.optimizers] == ["optimizer.bin", "optimizer_1.bin"]
    assert [s.file for s in inventory.skipped] == ["scheduler.bin"]  # random_states_0.pkl: not a torch suffix


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt"])
def test_every_torch_suffix_is_read(tmp_path: Path, suffix: str) -> None:
    model = models.TwoHeadNet()
    torch.save(models.make_optimizer(model).state_dict(), tmp_path / f"opt{suffix}")
    (tmp_path / "opt.txt").write_bytes((tmp_path / f"opt{suffix}").read_bytes())
    inventory = read_checkpoint(tmp_path)
    assert [opt.file for opt in inventory.optimizers] == [f"opt{suffix}"]


def test_foreign_and_unsafe_neighbours_do_not_change_the_verdict(root: Path, marker: Path) -> None:
    built = trainers.unirl_torch(root)
    (built.path / "garbage.pt").write_bytes(b"\x00not a pickle" + os.urandom(1000))
    hostile.unsafe_pickle(built.path / "sub", marker)
    (built.path / "bad.safetensors").write_bytes(b"\x01")
    inventory = read_checkpoint(built.path)
    assert [opt.file for opt in inventory.optimizers] == ["checkpoint.pt"]
    reasons = {s.file: s.reason for s in inventory.skipped}
    assert set(reasons) == {"garbage.pt", "sub/unsafe.pt", "bad.safetensors"}
    assert reasons["sub/unsafe.pt"] == f"refuses to load global {os.name}.system"
    assert all(not reason.startswith(file) for file, reason in reasons.items()), "reasons do not repeat the file"
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_torch_file_stops_a_directory_from_being_judged(root: Path, damage: str) -> None:
    """A damaged torch file may have been an optimizer: skipping it could call a broken checkpoint healthy."""
    built = trainers.accelerate(root)
    damaged = built.path / "optimizer_1.bin"
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    with pytest.raises(InputError, match=r"^optimizer_1\.bin: .*a damaged torch file may have held optimizer state"):
        read_checkpoint(built.path)


def test_directory_without_any_optimizer_is_an_input_error(root: Path) -> None:
    built = trainers.hf_trainer(root)
    (built.path / "optimizer.pt").unlink()
    with pytest.raises(InputError, match=r"no optimizer state found in any file \(3 file\(s\) skipped\)"):
        read_checkpoint(built.path)
    empty = root / "nothing"
    empty.mkdir()
    with pytest.raises(InputError, match=r"no optimizer state found in any file \(0 file\(s\) skipped\)"):
        read_checkpoint(empty)


def test_file_without_optimizer_and_missing_paths_are_input_errors(root: Path) -> None:
    path = root / "weights.pt"
    torch.save(models.TwoHeadNet().state_dict(), path)
    model_only = r"model weights, not optimizer state; the optimizer is usually in optimizer\.pt"
    with pytest.raises(InputError, match=model_only):
        read_checkpoint(path)
    torch.save({"step": 3}, path)
    with pytest.raises(InputError, match="holds no optimizer state"):
        read_checkpoint(path)
    with pytest.raises(InputError, match="no such file or directory"):
        read_checkpoint(root / "absent.pt")


def test_unsafe_file_argument_is_refused_naming_the_global(root: Path, marker: Path) -> None:
    built = trainers.hf_trainer(root)
    with pytest.raises(
        UnsafeInputError,
        match=r"training_args\.bin: refuses to load global "
        r"tests\.factories\.trainers\.TrainingArguments$",
    ):
        read_checkpoint(built.path / "training_args.bin")
    unsafe = hostile.unsafe_legacy_pickle(root / "u", marker)
    with pytest.raises(UnsafeInputError):
        read_checkpoint(unsafe.path)
    assert not marker.exists()


def test_numpy_arrays_are_data_not_code(root: Path) -> None:
    """HF Trainer's rng_state.pth pickles numpy's RNG state (``_reconstruct``, ``ndarray``, ``dtype``), which torch's
    weights-only loader reads with numpy's safe globals: skipped for holding no optimizer, never as unsafe."""
    path = root / "rng_state.pth"
    trainers.save_rng_state(path)
    data = zipfile.ZipFile(path).read("rng_state/data.pkl")
    assert b"numpy" in data and b"_reconstruct" in data and b"ndarray" in data
    with pytest.raises(InputError, match="holds no optimizer state"):
        read_checkpoint(path)
    beside = trainers.hf_trainer(root / "hf").path
    assert {s.file: s.kind for s in read_checkpoint(beside).skipped}["rng_state.pth"] == "other"


def test_a_deepspeed_zero_directory_is_recognised_not_refused(root: Path) -> None:
    built = trainers.deepspeed_zero(root)
    inventory = read_checkpoint(built.path)
    assert inventory.optimizers == ()
    kinds = {s.file: s.kind for s in inventory.skipped}
    assert kinds == {"global_step3/mp_rank_00_model_states.pt": "deepspeed-zero",
                     "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt": "deepspeed-zero",
                     "rng_state.pth": "other"}  # fmt: skip
    reason = next(s.reason for s in inventory.skipped if s.file.endswith("optim_states.pt"))
    assert reason.startswith("DeepSpeed ZeRO partitioned state (it names deepspeed.runtime.fp16.loss_scaler.")
    assert "per-parameter entries do not apply" in reason
    with pytest.raises(InputError, match=r"refuses to load global deepspeed\.runtime\.fp16\.loss_scaler\.LossScaler"):
        read_checkpoint(built.path / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
