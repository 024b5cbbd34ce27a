"""Model weights in ``.safetensors`` files: described by a bounded JSON header, read without tensor bytes."""

from optim_repair.formats.safetensors.adapter import joined_shards, placed_weights, read_weights
from optim_repair.formats.safetensors.header import SAFETENSORS_SUFFIX

__all__ = ["SAFETENSORS_SUFFIX", "joined_shards", "placed_weights", "read_weights"]
