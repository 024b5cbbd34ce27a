"""The scheme table: which spellings name a store, and what a URL names (bucket, key, Azure account)."""

from __future__ import annotations

import pytest

from optim_repair.errors import UsageError
from optim_repair.storage.schemes import StoreOptions, StoreUrl, is_remote, open_store, parse_url


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("s3://b/run/step-1/", StoreUrl("s3", "b", "run/step-1/")),
        ("gs://b/x.pt", StoreUrl("gs", "b", "x.pt")),
        ("az://container/run/", StoreUrl("az", "container", "run/")),
        ("abfs://container/run/", StoreUrl("az", "container", "run/")),
        ("abfss://container@acct01.dfs.core.windows.net/run/", StoreUrl("az", "container", "run/", "acct01")),
        ("https://acct01.blob.core.windows.net/container/run/x.pt", StoreUrl("az", "container", "run/x.pt", "acct01")),
        ("https://acct01.blob.core.windows.net/container", StoreUrl("az", "container", "", "acct01")),
    ],
)
def test_each_spelling_names_its_store_bucket_key_and_account(text: str, expected: StoreUrl) -> None:
    assert is_remote(text)
    assert parse_url(text) == expected


@pytest.mark.parametrize(
    "text", ["https://example.com/container/x.pt", "https://acct.blob.core.windows.net.evil.com/c/x", "run/step-1/"]
)
def test_other_urls_and_paths_are_local_paths(text: str) -> None:
    """Only Azure's blob host makes an https URL a store's; any other is a local path (that does not exist)."""
    assert not is_remote(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("abfs://container@elsewhere.example.com/run/", "names no container and account"),
        ("https://acct01.blob.core.windows.net/", "names no bucket"),
        ("az://container/run/../x/", "empty, '.' or '..' segment"),
    ],
)
def test_a_url_that_names_no_container_or_a_dot_segment_is_exit_2(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_url(text)


def test_an_account_option_other_than_the_urls_is_refused_before_anything_is_reached() -> None:
    url = parse_url("https://acct01.blob.core.windows.net/container/run/")
    with pytest.raises(UsageError, match="lies in the account acct01, not the --account other"):
        open_store(url, StoreOptions(account="other"))


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_account_is_refused_by_the_stores_that_have_none(scheme: str) -> None:
    with pytest.raises(UsageError, match="--account names an Azure storage account"):
        open_store(parse_url(f"{scheme}://bucket/run/"), StoreOptions(account="acct01"))
