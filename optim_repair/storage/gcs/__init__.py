"""The GCS store (``gs://``): one bucket over the JSON API, read by range, written never over an object that exists."""

from __future__ import annotations

from optim_repair.errors import UsageError
from optim_repair.storage.gcs.store import GcsStore
from optim_repair.storage.schemes import StoreOptions

__all__ = ["GcsStore", "open_store"]


def open_store(bucket: str, options: StoreOptions) -> GcsStore:
    """The bucket ``bucket``, reached at ``options.endpoint_url`` (else ``STORAGE_EMULATOR_HOST``, else Google's)."""
    if options.profile is not None:
        raise UsageError("--profile names an AWS profile; gs:// takes application default credentials")
    if options.account is not None:
        raise UsageError("--account names an Azure storage account; gs:// takes application default credentials")
    return GcsStore(bucket, endpoint_url=options.endpoint_url)
