"""Whose credentials the daemon reads a remote source with.

For its owner (a client of the daemon's own uid), the daemon's own: its environment, its config files, its
instance role, as a load in that user's own process would. For any other client, only the credentials that
client sent in its ``storage_options``: never the daemon's environment, config files, Docker logins, tokens or
role, which would turn the daemon's rights into that client's. :func:`check_own_credentials` refuses options
that would let a store fall back to them, before any request is made.
"""

from __future__ import annotations

from collections.abc import Mapping

from weightstream.errors import CacheRefusedError

PLAIN_HTTP = ("http://", "https://")


def check_own_credentials(uri: str, options: Mapping[str, object]) -> None:
    """Raise :class:`CacheRefusedError` unless ``options`` carry every credential a read of ``uri`` would use (or
    say the source is public), so that no store falls back to credentials of the daemon's own.

    Example:
        >>> check_own_credentials("s3://bucket/m.safetensors", {"key": "AKIA...", "secret": "..."})
        >>> check_own_credentials("s3://bucket/m.safetensors", {})
        Traceback (most recent call last):
        ...
        weightstream.errors.CacheRefusedError: s3://bucket/m.safetensors: ...
    """
    needed = _missing(uri, options)
    if needed is not None:
        raise CacheRefusedError(
            f"{uri}: the cache daemon reads for a client of another user only with that client's own credentials, "
            f"never its own: {needed}"
        )


def _missing(uri: str, options: Mapping[str, object]) -> str | None:
    """What ``options`` lack for ``uri``, or None."""
    if uri.startswith(PLAIN_HTTP):
        return None  # headers are the only credentials of plain HTTP, and they come from the options alone
    if uri.startswith("s3://"):
        if options.get("profile"):
            return "a profile names the daemon's own AWS config; pass key and secret (or anon=True) in storage_options"
        if options.get("anon") or (options.get("key") and options.get("secret")):
            return None
        return "pass key and secret (and token, if temporary) or anon=True in storage_options"
    if uri.startswith(("gs://", "gcs://")):
        token = options.get("token")
        if token == "anon" or isinstance(token, dict):
            return None
        return (
            "pass token='anon' or the service account's key as a dict in storage_options (a token file, "
            "'google_default' or 'cloud' would read the daemon's own)"
        )
    if uri.startswith(("az://", "abfs://")):
        if options.get("connection_string") or (
            options.get("account_name")
            and (options.get("account_key") or options.get("sas_token") or options.get("anon"))
        ):
            return None
        return "pass connection_string, or account_name with account_key, sas_token or anon=True in storage_options"
    if uri.startswith("oci://"):
        if options.get("username") is not None or options.get("anonymous"):
            return None
        return "pass username and password, or anonymous=True, in storage_options (not the daemon's Docker logins)"
    return f"{uri.split('://', 1)[0]}:// sources are not read for other users"
