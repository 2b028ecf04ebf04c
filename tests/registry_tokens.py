"""A token server of the tests' own for the registry's bearer-token flow (the distribution spec's ``auth: token``):
it signs JWTs with a key whose self-signed certificate the registry trusts, sends the certificate in each token's
``x5c`` header, and can hand out tokens that expire early, to test a token expiring mid-load."""

from __future__ import annotations

import base64
import datetime
import http.server
import json
import secrets
import time
import urllib.parse
from pathlib import Path

from typing_extensions import Self

from tests.rangeserver import LoopbackServer, QuietHandler

SERVICE = "weightstream-tests"
ISSUER = "weightstream-test-issuer"
LEEWAY_S = 60
"""The registry accepts a token this long past its expiry."""


class TokenServer:
    """``with TokenServer(directory) as tokens:``; ``tokens.auth_yaml`` configures the registry, ``tokens.issued``
    counts the tokens handed out, ``tokens.valid_for_s`` sets how long the next ones live (counting the registry's
    leeway), ``tokens.users`` the accepted basic credentials (empty: anonymous pulls allowed)."""

    def __init__(self, directory: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = datetime.datetime.now(datetime.timezone.utc)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(self._key, hashes.SHA256())
        )
        self.certificate = directory / "token-ca.pem"
        self.certificate.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        self._x5c = base64.b64encode(certificate.public_bytes(serialization.Encoding.DER)).decode()
        self.issued = 0
        self.valid_for_s = 300.0
        self.users: dict[str, str] = {}
        self._server = LoopbackServer(self._handler(), "127.0.0.1", "token-server")

    @property
    def realm(self) -> str:
        return f"{self._server.url}/token"

    @property
    def auth_yaml(self) -> str:
        return (
            f"auth:\n  token:\n    realm: {self.realm}\n    service: {SERVICE}\n    issuer: {ISSUER}\n"
            f"    rootcertbundle: {self.certificate}\n"
        )

    def __enter__(self) -> Self:
        self._server.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.__exit__(*exc_info)

    def token(self, scope: str) -> str:
        import jwt

        _, name, actions = scope.split(":", 2)
        now = int(time.time())
        claims = {
            "iss": ISSUER,
            "sub": "tester",
            "aud": SERVICE,
            "iat": now,
            "nbf": now - 10,
            "exp": now + int(self.valid_for_s) - LEEWAY_S,
            "jti": secrets.token_hex(8),
            "access": [{"type": "repository", "name": name, "actions": actions.split(",")}],
        }
        self.issued += 1
        return jwt.encode(claims, self._key, algorithm="RS256", headers={"x5c": [self._x5c]})

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                if server.users:
                    given = self.headers.get("Authorization", "")
                    expected = {
                        "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
                        for user, password in server.users.items()
                    }
                    if given not in expected:
                        self.send_response(401)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                body = json.dumps({"token": server.token(query["scope"][0]), "expires_in": 60}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler
