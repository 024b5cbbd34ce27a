"""``--model DIR``: a directory of model weights is read as a checkpoint directory is, through discovery.

The model is a real transformers model saved by ``save_pretrained(..., max_shard_size=...)``: several
``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json``, as large models are saved.
The checkpoint is a real AdamW run over it, keyed by parameter names, with one parameter never stepped.
A missing transformers skips the tests that need it, with the reason; nothing is mocked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import optim_repair
from optim_repair.errors import InputError
from tests.conftest import run_cli
from tests.factories import models, trainers

NEVER_STEPPED = "transformer.wpe.weight"


@dataclass(frozen=True)
class Saved:
    checkpoint: Path
    """``optimizer.pt``: the run's AdamW state, keyed by parameter names."""
    shards: Path
    """``save_pretrained`` with a small ``max_shard_size``: several shards and the index."""
    single: Path
    """The same model in one ``model.safetensors``."""
    params: int


def _model() -> Any:
    """A small GPT-2 (untied head, so every parameter is saved), or a skip that says why there is none."""
    try:
        import transformers
    except ImportError as error:
        pytest.skip(f"transformers cannot be imported ({error}): pip install transformers (the 'test' extra)")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture
def saved(tmp_path: Path) -> Saved:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        for name, param in model.named_parameters():
            param.grad = None if name == NEVER_STEPPED else torch.randn_like(param)
        opt.step()
    checkpoint = tmp_path / "optimizer.pt"
    torch.save({"optimizer_state_dict": get_optimizer_state_dict(model, opt)}, checkpoint)
    shards, single = tmp_path / "shards", tmp_path / "single"
    model.save_pretrained(shards, max_shard_size="40KB")
    model.save_pretrained(single)
    assert (
        len(list(shards.glob("model-*-of-*.safetensors"))) > 1 and (shards / "model.safetensors.index.json").is_file()
    )
    return Saved(checkpoint, shards, single / "model.safetensors", len(list(model.parameters())))


def _compared(checkpoint: Path, model: Path, code: int) -> dict[str, Any]:
    """The JSON ``model`` comparison of ``inspect CHECKPOINT --model MODEL``, which must exit with ``code``."""
    document = json.loads(run_cli(["inspect", checkpoint, "--model", model, "--json"], code=code).stdout)
    (optimizer,) = document["optimizers"]
    found: dict[str, Any] = optimizer["model"]
    return found


def _one_error_line(result: Any, *fragments: str) -> None:
    """stderr is one ``optim-repair: error:`` line holding every fragment."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("optim-repair: error:"), result.stderr
    assert all(fragment in lines[0] for fragment in fragments), lines[0]


def test_a_directory_of_shards_is_compared_as_one_file_is(saved: Saved) -> None:
    arguments = trainers.TrainingArguments(output_dir=str(saved.shards))
    torch.save(arguments, saved.shards / "training_args.bin")  # passed over
    single = _compared(saved.checkpoint, saved.single, code=1)  # the never-stepped parameter's absent entry: repairable
    sharded = _compared(saved.checkpoint, saved.shards, code=1)
    shard_files = sorted(saved.shards.glob("*.safetensors"))
    assert sharded["sources"] == [str(path) for path in shard_files]
    assert (sharded["model_params"], sharded["optimizer_params"]) == (saved.params, saved.params)
    assert sharded["not_in_model"] == [] and sharded["not_in_optimizer"] == [] and sharded["shape_mismatches"] == []
    assert {**sharded, "sources": single["sources"]} == single


def test_the_library_compares_with_a_directory_of_shards(saved: Saved) -> None:
    diagnosis = optim_repair.inspect(saved.checkpoint, model=saved.shards)
    (optimizer,) = diagnosis.optimizers
    assert optimizer.model is not None and optimizer.model.matches
    assert optimizer.model.model_params == saved.params
    assert all(source.startswith(str(saved.shards)) for source in optimizer.model.sources)
    assert optim_repair.compare(saved.checkpoint, saved.shards).optimizers[0].model == optimizer.model
    assert diagnosis.verdict == "repairable"


def test_fix_takes_its_fresh_shapes_from_a_directory_of_shards(saved: Saved, tmp_path: Path) -> None:
    out = tmp_path / "fixed.pt"
    run_cli(["fix", saved.checkpoint, "--out", out, "--fill", "fresh", "--model", saved.shards])
    assert _compared(out, saved.shards, code=0)["not_in_model"] == []
    state = torch.load(out, weights_only=True)["optimizer_state_dict"]["state"][NEVER_STEPPED]
    assert state["exp_avg"].shape == (16, 32)


def test_a_directory_holding_a_torch_file_of_weights_is_its_model(saved: Saved, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    directory = tmp_path / "torch-weights"
    directory.mkdir()
    torch.save(load_file(saved.single), directory / "pytorch_model.bin")
    found = _compared(saved.checkpoint, directory, code=1)
    assert found["sources"] == [str(directory / "pytorch_model.bin")] and found["model_params"] == saved.params


def test_a_damaged_shard_is_an_error_that_names_it(saved: Saved) -> None:
    damaged = sorted(saved.shards.glob("model-*.safetensors"))[-1]
    damaged.write_bytes(damaged.read_bytes()[:-64])
    result = run_cli(["inspect", saved.checkpoint, "--model", saved.shards], code=4)
    _one_error_line(result, str(damaged), "not a safetensors file")
    with pytest.raises(InputError, match="not a safetensors file") as raised:
        optim_repair.inspect(saved.checkpoint, model=saved.shards)
    assert raised.value.path == str(damaged)


def test_a_directory_without_weights_is_an_error(tmp_path: Path) -> None:
    built = trainers.unirl_torch(tmp_path / "run")
    empty = tmp_path / "config-only"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    (empty / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    result = run_cli(["inspect", built.path, "--model", empty], code=4)
    _one_error_line(result, str(empty), "holds no model weights")


def test_a_model_saved_by_rank_through_dcps_huggingface_writer_gives_whole_shapes(tmp_path: Path) -> None:
    """DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` writes each rank's shards in a safetensors file of
    its own, saying in ``DCP_SHARDING_INFO`` where each shard begins. Written here as its ``_write_files_from_queue``
    writes them (torch 2.13), two ranks sharding every tensor by rows as FSDP2 does: ``--model`` gives the whole
    tensors' shapes, not a shard's."""
    model = models.TwoHeadNet()
    opt = models.make_optimizer(model)
    models.train(model, opt, 2)
    path = tmp_path / "checkpoint.pt"
    torch.save({"optimizer": get_optimizer_state_dict(model, opt)}, path)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for rank in range(2):
        tensors, info = {}, {}
        for name, tensor in model.state_dict().items():
            rows = -(-tensor.shape[0] // 2)
            tensors[name] = tensor[rank * rows : (rank + 1) * rows].contiguous()
            info[name] = {"saved_offsets": [rank * rows, *([0] * (tensor.dim() - 1))]}
        metadata = {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}
        save_file(tensors, sharded / f"shard-0000{rank}-model-00001-of-00001.safetensors", metadata=metadata)
    result = optim_repair.fix(path, tmp_path / "fixed.pt", model=sharded)
    assert result.plan.fill == "fresh"
    added = torch.load(tmp_path / "fixed.pt", weights_only=True)["optimizer"]["state"]
    assert added["head_unused.weight"]["exp_avg"].shape == model.head_unused.weight.shape == (2, 8)
    assert added["head_unused.bias"]["exp_avg_sq"].shape == (2,)
    (opt_diagnosis,) = optim_repair.inspect(path, model=sharded).optimizers
    assert opt_diagnosis.model is not None and opt_diagnosis.model.shape_mismatches == ()
