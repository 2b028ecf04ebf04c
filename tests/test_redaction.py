"""No secret in any message or log line: SAS signatures, presigned-URL signatures and credentials, tokens, account
keys, ``Authorization`` headers are redacted wherever weightstream quotes a URL or an option: properties over
generated secrets, and the error and log paths. Real loads of Azure SAS URLs that fail: tests/test_azure.py."""

from __future__ import annotations

import logging
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

import weightstream
from weightstream.errors import REDACTED, SourceError, logger, redact

SECRET = st.text(alphabet=string.ascii_letters + string.digits + "+/%=-_.~", min_size=8, max_size=80).map(
    lambda text: "Zq" + text
)
"""What signatures, keys and tokens are made of (URL-encoded base64, JWTs), marked so as to be found."""
PLACES = [
    "https://acct.blob.core.windows.net/c/model.safetensors?sv=2022-11-02&sr=b&sig={}",
    "https://bucket.s3.amazonaws.com/m.safetensors?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={}&X-Amz-Date=1",
    "https://bucket.s3.amazonaws.com/m.safetensors?X-Amz-Security-Token={}&X-Amz-Signature=abc",
    "https://storage.googleapis.com/b/m.safetensors?X-Goog-Signature={}",
    "https://example.com/m.safetensors?token={}",
    "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={};EndpointSuffix=core.windows.net",
    "BlobEndpoint=https://acct.blob.core.windows.net/;SharedAccessSignature=sv=2022-11-02&sig={}",
    "{{'headers': {{'Authorization': 'Bearer {}'}}}}",
    "Authorization: Basic {}",
    "storage_options={{'account_key': '{}', 'account_name': 'acct'}}",
    "storage_options={{'sas_token': 'sv=2022-11-02&sig={}'}}",
]


@pytest.mark.parametrize("place", PLACES)
@given(secret=SECRET)
def test_a_secret_never_survives_redaction_and_the_rest_does(place: str, secret: str):
    text = f"{place.format(secret)}: HTTP 403 AuthenticationFailed"
    redacted = redact(text)
    assert secret not in redacted
    assert REDACTED in redacted
    assert redacted.endswith(": HTTP 403 AuthenticationFailed"), "what follows the secret is kept"
    assert redacted[:12] == text[:12], "and what precedes it"
    assert redact(redacted) == redacted


@given(text=st.text(alphabet=string.ascii_letters + string.digits + "/._-", max_size=120))
def test_text_without_secrets_is_unchanged(text: str):
    assert redact(text) == text


def test_every_error_and_log_line_is_redacted(caplog):
    url = "https://acct.blob.core.windows.net/c/model.safetensors?sv=1&sig=TOPSECRET%3D"
    assert "TOPSECRET" not in str(SourceError(f"{url}: access denied"))
    assert "TOPSECRET" not in str(weightstream.NotFound(url))
    with caplog.at_level(logging.INFO, logger="weightstream.sources.test"):
        logger("weightstream.sources.test").info("retrying %s after %s", url, "Authorization: Bearer TOPSECRET")
    assert "TOPSECRET" not in caplog.text and f"sig={REDACTED}" in caplog.text
