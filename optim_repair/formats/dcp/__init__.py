"""torch.distributed.checkpoint (DCP) directories, split as torch splits them.

``metadata`` (what a ``.metadata`` says, as plain data), ``metadata_reader`` (reading it safely),
``metadata_writer`` (extending it), ``layout`` (where optimizers and weights sit among the keys),
``storage`` (shard bytes and stream transforms), ``reader`` (the inventory) and ``writer`` (a
repaired copy). None of them imports torch.
"""

from optim_repair.formats.dcp.metadata import (
    METADATA_FILE,
    REPAIR_SHARD_PREFIX,
    SHARD_SUFFIX,
    DcpBytes,
    DcpChunk,
    DcpMetadata,
    DcpTensor,
    display_path,
    is_dcp_directory,
    is_rank_metadata,
    metadata_names,
    view_key,
)
from optim_repair.formats.dcp.metadata_reader import read_metadata
from optim_repair.formats.dcp.planning import PlannedEntries, plan_dcp
from optim_repair.formats.dcp.reader import read_dcp

__all__ = [
    "METADATA_FILE",
    "REPAIR_SHARD_PREFIX",
    "SHARD_SUFFIX",
    "DcpBytes",
    "DcpChunk",
    "DcpMetadata",
    "DcpTensor",
    "PlannedEntries",
    "display_path",
    "is_dcp_directory",
    "is_rank_metadata",
    "metadata_names",
    "plan_dcp",
    "read_dcp",
    "read_metadata",
    "view_key",
]
