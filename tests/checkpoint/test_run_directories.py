"""Run directories: ``--latest`` takes the newest complete step, and each step's optimizer is compared with its own
step's model, never another step's."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import optim_repair
from optim_repair.errors import ExitCode, InputError
from tests.conftest import run_cli
from tests.factories import dcp as dk
from tests.factories.trainers import save_safetensors


def _step(directory: Path, widths: tuple[int, ...]) -> None:
    """A name-keyed step: ``checkpoint.pt`` (AdamW state, the last layer never stepped) and its model's weights."""
    directory.mkdir(parents=True)
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters())
    model[:-1](torch.randn(2, widths[0])).sum().backward()
    opt.step()
    torch.save({"optimizer": get_optimizer_state_dict(model, opt)}, directory / "checkpoint.pt")
    save_safetensors(get_model_state_dict(model), directory / "model.safetensors")


def test_the_newest_complete_step_is_taken_by_its_number(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for name in ("checkpoint-9", "checkpoint-10"):
        _step(run / name, (3, 4, 2))
    (run / "checkpoint-11").mkdir()  # nothing written yet
    dk.unirl_dcp(run / "dcp")
    unfinished = run / "checkpoint-12"
    (run / "dcp").rename(unfinished)
    for metadata in unfinished.rglob(".metadata"):
        metadata.unlink()  # torch's writer commits it last: a step without it is still being written
    (run / "checkpoint-100-fixed").mkdir()  # no step name
    assert optim_repair.latest_checkpoint(run) == run / "checkpoint-10"
    result = run_cli(["inspect", run, "--latest", "--json"], code=ExitCode.REPAIRABLE)
    assert json.loads(result.stdout)["path"] == str(run / "checkpoint-10")
    assert f"newest complete step: {run / 'checkpoint-10'}" in result.stderr


@pytest.mark.parametrize(
    ("names", "newest"),
    [
        (["step-5", "step-40"], "step-40"),
        (["global_step8", "global_step12"], "global_step12"),
        (["epoch=0-step=900.ckpt", "epoch=1-step=1000.ckpt", "last.ckpt"], "epoch=1-step=1000.ckpt"),
    ],
)
def test_every_library_s_step_names_are_ordered(tmp_path: Path, names: list[str], newest: str) -> None:
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert optim_repair.latest_checkpoint(tmp_path) == tmp_path / newest


@pytest.mark.parametrize(
    "other",
    [
        "checkpoint-\u0663\u0660\u0660",  # Arabic-Indic digits, which int() reads as 300
        "step-\uff13\uff10\uff10",  # fullwidth digits
        "global_step\u00b3",  # a superscript: isdigit() but not int()
        "checkpoint-300\n",  # a name ending in a newline, which a regular expression's $ lets through
    ],
)
def test_a_step_s_number_is_in_ascii_digits(tmp_path: Path, other: str) -> None:
    _step(tmp_path / "checkpoint-100", (3, 4, 2))
    _step(tmp_path / other, (3, 4, 2))
    assert optim_repair.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-100"


def test_a_megatron_tracker_in_other_digits_names_no_step(tmp_path: Path) -> None:
    _step(tmp_path / "iter_0000100", (3, 4, 2))
    for text in ("\u0662\u0660\u0660", "\u00b2"):  # 200 in Arabic-Indic digits; a superscript two
        (tmp_path / "latest_checkpointed_iteration.txt").write_text(text)
        notices: list[str] = []
        assert optim_repair.latest_checkpoint(tmp_path, notice=notices.append) == tmp_path / "iter_0000100"
        assert notices == []


def test_an_hf_trainer_step_without_its_trainer_state_is_still_being_saved(tmp_path: Path) -> None:
    """The HF Trainer writes ``training_args.bin`` with the model first and ``trainer_state.json`` last."""
    from tests.factories import trainers

    run = tmp_path / "run"
    saved = trainers.hf_trainer(run, steps=3).path
    assert (saved / "trainer_state.json").is_file() and (saved / "training_args.bin").is_file()
    saving = trainers.hf_trainer(run, steps=5).path
    (saving / "trainer_state.json").unlink()
    assert optim_repair.latest_checkpoint(run) == saved
    (saving / "training_args.bin").unlink()  # a step of another library, which has no such mark
    assert optim_repair.latest_checkpoint(run) == saving


def test_a_run_without_a_complete_step_is_an_input_error(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(InputError, match="holds no complete checkpoint step"):
        optim_repair.latest_checkpoint(tmp_path)
    result = run_cli(["fix", tmp_path, "--latest", "--out", tmp_path.parent / "fixed"], code=ExitCode.INPUT)
    assert "holds no complete checkpoint step" in result.stderr


def test_each_step_s_optimizer_is_compared_with_its_own_step_s_model(tmp_path: Path) -> None:
    """``checkpoint-100``'s 4-parameter optimizer does not "fit" ``checkpoint-200``'s 6-parameter model."""
    _step(tmp_path / "checkpoint-100", (3, 4, 2))
    _step(tmp_path / "checkpoint-200", (3, 4, 4, 2))
    diagnosis = optim_repair.inspect(tmp_path)
    by_file = {opt.optimizer.file: opt.model for opt in diagnosis.optimizers}
    for name, params in (("checkpoint-100", 4), ("checkpoint-200", 6)):
        model = by_file[f"{name}/checkpoint.pt"]
        assert model is not None and model.sources == (f"{name}/model.safetensors",)
        assert (model.optimizer_params, model.model_params) == (params, params) and model.matches


def test_a_tracker_that_names_another_step_is_said(tmp_path: Path) -> None:
    """DeepSpeed's ``latest`` names a step still being written; Megatron's ``latest_checkpointed_iteration.txt`` names
    the step taken (``iter_0000100``, which ``--latest`` orders with the others), then one that is gone."""
    run = tmp_path / "deepspeed"
    _step(run / "global_step100", (3, 4, 2))
    (run / "global_step200").mkdir()
    (run / "latest").write_text("global_step200")
    result = run_cli(["inspect", run, "--latest", "--json"], code=ExitCode.REPAIRABLE)
    assert json.loads(result.stdout)["path"] == str(run / "global_step100")
    said = "the run's tracker latest names global_step200, which is not complete: taking global_step100, the newest"
    assert said in result.stderr
    megatron = tmp_path / "megatron"
    _step(megatron / "iter_0000100", (3, 4, 2))
    (megatron / "latest_checkpointed_iteration.txt").write_text("100\n")
    result = run_cli(["inspect", megatron, "--latest"], code=ExitCode.REPAIRABLE)
    assert "the run's tracker" not in result.stderr
    assert f"newest complete step: {megatron / 'iter_0000100'}" in result.stderr
    (megatron / "latest_checkpointed_iteration.txt").write_text("200")
    notices: list[str] = []
    assert optim_repair.latest_checkpoint(megatron, notice=notices.append) == megatron / "iter_0000100"
    assert notices == [
        "the run's tracker latest_checkpointed_iteration.txt names iter_0000200, which is missing: taking "
        "iter_0000100, the newest complete step"
    ]
