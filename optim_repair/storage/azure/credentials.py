"""How a run reaches an Azure storage account: its endpoint, and what authorizes each request.

As Azure's own tools find them: a connection string in ``AZURE_STORAGE_CONNECTION_STRING`` (an account key, from
which an account SAS is made by Azure's SDK, ``generate_account_sas``; or a SAS it holds), else Azure AD through
``DefaultAzureCredential`` (a bearer token). The account is the one a URL names (``https://ACCOUNT.blob...``,
``abfs://CONTAINER@ACCOUNT...``), else ``--account``, else the connection string's, else ``AZURE_STORAGE_ACCOUNT``.
The endpoint is ``--endpoint-url`` (Azurite: ``http://127.0.0.1:10000/devstoreaccount1``), else the connection
string's ``BlobEndpoint``, else ``https://ACCOUNT.blob.core.windows.net``. A SAS rides in every request's query
and in a copy's source URL, so no URL is shown with its query (``without_queries``).
"""

from __future__ import annotations

import datetime
import importlib
import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

from optim_repair.errors import InputError, UsageError
from optim_repair.storage.names import checked_endpoint

SCOPE = "https://storage.azure.com/.default"
SAS_DAYS = 7
"""How long the account SAS a run makes from an account key is valid: longer than any copy it starts."""
_DEVELOPMENT = {
    "AccountName": "devstoreaccount1",
    "AccountKey": "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==",
    "BlobEndpoint": "http://127.0.0.1:10000/devstoreaccount1",
}
"""Azurite's account, by its well-known key (published by Microsoft), as ``UseDevelopmentStorage=true`` names it."""
_QUERY = re.compile(r"\?[^\s'\"<>]*")


@dataclass(frozen=True)
class Access:
    """An account's endpoint and what authorizes a request to it: a SAS query, a token source, or neither."""

    account: str
    endpoint: str
    sas: str | None
    token: Any
    """An azure-identity credential (``get_token``), or None."""

    def query(self) -> dict[str, str]:
        """The SAS's parameters, which every request carries where the SAS authorizes it."""
        return dict(urllib.parse.parse_qsl(self.sas)) if self.sas else {}

    def headers(self) -> dict[str, str]:
        """The bearer token, where Azure AD authorizes requests."""
        if self.token is None:
            return {}
        return {"Authorization": f"Bearer {self.token.get_token(SCOPE).token}"}

    def source(self, url: str) -> tuple[str, dict[str, str]]:
        """A copy's source URL and headers, authorized as this run's own reads are (SAS in the URL, or the token
        as ``x-ms-copy-source-authorization``, which a copy by range takes and an asynchronous Copy Blob does not:
        inside one account, its own request's token authorizes the source)."""
        if self.sas:
            return f"{url}?{self.sas}", {}
        if self.token is not None:
            return url, {"x-ms-copy-source-authorization": self.headers()["Authorization"]}
        return url, {}


def without_queries(text: str) -> str:
    """``text`` (a transport's message) with the query of every URL in it left out: it may hold a SAS."""
    return _QUERY.sub("?...", text)


def _connection_string() -> dict[str, str]:
    """``AZURE_STORAGE_CONNECTION_STRING`` by its fields; ``UseDevelopmentStorage=true`` is Azurite's account at its
    default address, as Azure's SDK reads it."""
    text = os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "")
    found: dict[str, str] = {}
    for part in text.split(";"):
        name, separator, value = part.strip().partition("=")
        if separator and name:
            found[name] = value
    if found.get("UseDevelopmentStorage", "").lower() == "true":
        return dict(_DEVELOPMENT)
    return found


def access(account: str | None, endpoint_url: str | None) -> Access:
    """How this run reaches ``account`` (None: the connection string's, or ``AZURE_STORAGE_ACCOUNT``) at
    ``endpoint_url`` (None: as the module says)."""
    try:
        blob = importlib.import_module("azure.storage.blob")
    except ImportError:
        raise UsageError("az:// checkpoints need Azure's SDK: pip install 'optim-repair[azure]'") from None
    connection = _connection_string()
    named = account or connection.get("AccountName") or os.environ.get("AZURE_STORAGE_ACCOUNT")
    if not named:
        raise UsageError(
            "az:// names no storage account: give https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX, "
            "--account, or AZURE_STORAGE_CONNECTION_STRING"
        )
    if connection and connection.get("AccountName", named) != named:
        connection = {}  # the connection string is another account's
    endpoint = checked_endpoint(endpoint_url or connection.get("BlobEndpoint")) or (
        f"https://{named}.blob.core.windows.net"
    )
    if "AccountKey" in connection:
        try:
            sas = blob.generate_account_sas(
                named, connection["AccountKey"],
                resource_types=blob.ResourceTypes(service=True, container=True, object=True),
                permission=blob.AccountSasPermissions(read=True, write=True, delete=True, list=True, add=True,
                                                      create=True),
                expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=SAS_DAYS),
            )  # fmt: skip
        except ValueError:  # binascii.Error: a key Azure never gave
            raise UsageError("AZURE_STORAGE_CONNECTION_STRING holds an AccountKey that is not base64") from None
        return Access(named, endpoint.rstrip("/"), sas, None)
    if "SharedAccessSignature" in connection:
        return Access(named, endpoint.rstrip("/"), connection["SharedAccessSignature"].lstrip("?"), None)
    return Access(named, endpoint.rstrip("/"), None, _token(endpoint_url is not None))


def _token(anonymous_allowed: bool) -> Any:
    """Azure AD's credential, as ``DefaultAzureCredential`` finds it; where it finds none, anonymous access to a
    named endpoint (a public container, an emulator), else an ``InputError``."""
    try:
        identity = importlib.import_module("azure.identity")
        core = importlib.import_module("azure.core.exceptions")
    except ImportError:
        raise UsageError(
            "az:// without a connection string needs azure-identity: pip install 'optim-repair[azure]'"
        ) from None
    credential = identity.DefaultAzureCredential()
    try:
        credential.get_token(SCOPE)
    except core.ClientAuthenticationError as exc:
        if anonymous_allowed:
            return None
        raise InputError(
            "no Azure credentials found (AZURE_STORAGE_CONNECTION_STRING, or Azure AD: az login, "
            "a managed identity, AZURE_CLIENT_ID and its secret)"
        ) from exc
    return credential
