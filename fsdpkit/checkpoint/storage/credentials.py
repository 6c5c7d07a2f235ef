"""Each cloud's credentials and endpoint from its own standard environment and config files,
as its CLI reads them: for S3 the `AWS_*` variables (`AWS_ENDPOINT_URL` for S3-compatible
stores), else a profile (`AWS_PROFILE`, default `default`) of `~/.aws/credentials` and
`~/.aws/config`, else a web identity or container role; for GCS a service-account key or the
application-default login; for Azure a storage account with a key, a SAS token or a service
principal. What is missing is one UsageError naming what to set; no secret is ever printed."""

from __future__ import annotations

import configparser
import os
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import UsageError
from .location import ObjectUrl

_S3_FROM_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)
_GCS_FROM_ENV = ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_APPLICATION_CREDENTIALS")
_AZURE_SECRETS = (
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
)


def store_config(url: ObjectUrl) -> dict[str, Any]:
    """obstore's configuration for `url`'s store beyond what it reads from the environment
    itself; a UsageError when no credential can be found."""
    if url.scheme == "s3":
        return _s3(url)
    if url.scheme == "gs":
        return _gcs(url)
    return _azure(url)


def _s3(url: ObjectUrl) -> dict[str, Any]:
    config: dict[str, Any] = {}
    profile = _aws_profile()
    if not any(os.environ.get(name) for name in _S3_FROM_ENV):
        keys = {key: profile.get(f"aws_{key}") for key in ("access_key_id", "secret_access_key", "session_token")}
        if not keys["access_key_id"] or not keys["secret_access_key"]:
            raise UsageError(
                f"{url}: no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE naming a profile "
                "of ~/.aws/credentials (and AWS_ENDPOINT_URL for an S3-compatible store)"
            )
        config.update({key: value for key, value in keys.items() if value})
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or profile.get("region") or "us-east-1"
    config["region"] = region
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or profile.get("endpoint_url")
    if endpoint:
        config["endpoint"] = endpoint
    return config


def _aws_profile() -> dict[str, str]:
    """The keys of profile AWS_PROFILE (default `default`) in ~/.aws/credentials and ~/.aws/config
    (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE); the credentials file wins."""
    name = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path.home() / ".aws"
    found: dict[str, str] = {}
    files = [
        (Path(os.environ.get("AWS_CONFIG_FILE") or home / "config"), name if name == "default" else f"profile {name}"),
        (Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or home / "credentials"), name),
    ]
    for path, section in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except configparser.Error as error:
            raise UsageError(f"{path}: not a valid AWS config file ({type(error).__name__})") from None
        if parser.has_section(section):
            found.update(parser.items(section))
    if name != "default" and not found:
        raise UsageError(f"AWS_PROFILE={name}: no such profile in ~/.aws/credentials or ~/.aws/config")
    return found


def _gcs(url: ObjectUrl) -> dict[str, Any]:
    default_login = Path.home() / ".config" / "gcloud" / "application_default_credentials.json"
    if not any(os.environ.get(name) for name in _GCS_FROM_ENV) and not default_login.is_file():
        raise UsageError(
            f"{url}: no Google Cloud credentials found: set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, "
            "or run `gcloud auth application-default login`"
        )
    return {}


def _azure(url: ObjectUrl) -> dict[str, Any]:
    if os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in ("1", "true"):
        return {}
    account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") or os.environ.get("AZURE_STORAGE_ACCOUNT")
    if not account:
        raise UsageError(f"{url}: no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME (and a key, SAS token or service principal)")
    if not any(os.environ.get(name) for name in _AZURE_SECRETS) and os.environ.get("AZURE_USE_AZURE_CLI", "").lower() != "true":
        raise UsageError(
            f"{url}: no Azure credentials found: set AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, or AZURE_CLIENT_ID, "
            "AZURE_CLIENT_SECRET and AZURE_TENANT_ID, or AZURE_USE_AZURE_CLI=true"
        )
    return {"account_name": account}


class S3Access(NamedTuple):
    """What a request signed here (`sigv4.py`) needs: the keys, the region and the endpoint the
    face's obstore store gets from `store_config` and the environment. Its repr hides the keys."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None
    region: str
    endpoint: str | None  # an S3-compatible store's (path-style requests); None for AWS itself

    def __repr__(self) -> str:
        return f"S3Access(region={self.region!r}, endpoint={self.endpoint!r})"


def s3_access(url: ObjectUrl) -> S3Access | None:
    """The static keys for `url`'s S3 store (the environment's, else the profile's, as
    `store_config` picks them); None where the store signs with a web identity or a container
    role, which only obstore resolves."""
    config = _s3(url)
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        key, secret, token = (os.environ.get(name) for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"))
    else:
        key, secret, token = (config.get(name) for name in ("access_key_id", "secret_access_key", "session_token"))
    if not key or not secret:
        return None
    return S3Access(key, secret, token or None, config["region"], config.get("endpoint"))
