"""The S3 store (``s3://``): one bucket through boto3, read by range, written never over an object that exists."""

from __future__ import annotations

from optim_repair.errors import UsageError
from optim_repair.storage.s3.store import S3Store
from optim_repair.storage.schemes import StoreOptions

__all__ = ["S3Store", "open_store"]


def open_store(bucket: str, options: StoreOptions) -> S3Store:
    """The bucket ``bucket``, through boto3 (``options``: an AWS profile and an endpoint)."""
    if options.account is not None:
        raise UsageError("--account names an Azure storage account; s3:// takes an AWS profile (--profile)")
    return S3Store(bucket, profile=options.profile, endpoint_url=options.endpoint_url)
