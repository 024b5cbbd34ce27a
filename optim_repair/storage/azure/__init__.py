"""The Azure Blob Storage store (``az://``): a container over the REST API, read by range, written never over.

Never over an object that exists, that is; ``abfs://`` and ``https://ACCOUNT.blob.core.windows.net/`` name it too.
"""

from __future__ import annotations

from optim_repair.errors import UsageError
from optim_repair.storage.azure.store import AzureStore
from optim_repair.storage.schemes import StoreOptions

__all__ = ["AzureStore", "open_store"]


def open_store(bucket: str, options: StoreOptions) -> AzureStore:
    """The container ``bucket`` of ``options.account`` (else the connection string's), at ``options.endpoint_url``
    (else the connection string's, else Azure's)."""
    if options.profile is not None:
        raise UsageError("--profile names an AWS profile; az:// takes a connection string or Azure AD credentials")
    return AzureStore(bucket, account=options.account, endpoint_url=options.endpoint_url)
