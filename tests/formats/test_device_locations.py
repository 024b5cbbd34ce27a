"""Checkpoints saved from an accelerator: storages tagged ``cuda:0`` are read, kept and mirrored.

No GPU is needed: the checkpoint is written by a child process that registers a torch
serialization tagger answering ``cuda:0``, so the file holds exactly the location tags a CUDA
run writes (``torch.serialization.register_package`` is global, hence the child process).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import torch

import optim_repair
from optim_repair.formats.pickled import load_graph

WRITER = textwrap.dedent(
    """
    import sys
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.serialization.register_package(0, lambda storage: "cuda:0", lambda storage, location: None)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 3), "unused": torch.nn.Linear(4, 3)})
    optimizer = torch.optim.AdamW(model.parameters())
    model["used"](torch.randn(2, 4)).sum().backward()
    optimizer.step()
    torch.save(
        {"policy_state_dict": model.state_dict(), "optimizer_state_dict": get_optimizer_state_dict(model, optimizer)},
        sys.argv[1],
    )
    """
)


def _locations(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    return {ref.location for ref in load_graph(data, path.name).storages.values()}


def test_a_checkpoint_written_from_cuda_is_inspected_and_fixed_on_cpu(tmp_path: Path) -> None:
    original = tmp_path / "checkpoint.pt"
    subprocess.run([sys.executable, "-c", WRITER, str(original)], check=True, capture_output=True)
    assert _locations(original) == {"cuda:0"}

    diagnosis = optim_repair.inspect(original)
    assert diagnosis.optimizers[0].missing == ("unused.weight", "unused.bias")

    for fill in ("empty", "fresh"):
        fixed = tmp_path / f"fixed-{fill}.pt"
        optim_repair.fix(original, fixed, fill=fill)  # type: ignore[arg-type]
        assert _locations(fixed) == {"cuda:0"}, "new state lives where the optimizer's other state lives"
        state = torch.load(fixed, map_location="cpu", weights_only=True)["optimizer_state_dict"]["state"]
        assert set(state) == {"used.weight", "used.bias", "unused.weight", "unused.bias"}
