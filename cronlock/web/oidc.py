"""TRIGGER_AUTH=oidc: a Google-signed ID token (what Cloud Scheduler sends with
`--oidc-service-account-email`) in `Authorization: Bearer`.

The JOSE work (segments, signature, `exp`/`iat`, `aud`) is google-auth's (`google.auth.jwt`);
this module only keeps Google's keys and checks the claims Google leaves to the receiver:
`iss`, `email_verified`, and `email` among OIDC_ALLOWED_EMAILS.

The keys (OIDC_CERTS_URL, Google's PEM-by-kid document by default; a JWK set works too) are
fetched with a timeout when first needed, kept as long as the answer's `Cache-Control: max-age`
says, fetched again once when a token names a `kid` they lack (at most once per
`UNKNOWN_KID_INTERVAL`), and never per request: a fetch that fails is not tried again for
`RETRY_INTERVAL`. Keys fetched before keep working while the server is down; with none at
all, an OIDC token cannot be checked (`KeysUnavailable`: a 503 for it, nothing else).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from cronlock.errors import KeysUnavailable
from cronlock.settings import SettingsError

log = logging.getLogger("cronlock.auth")

GOOGLE_ISSUERS = ("accounts.google.com", "https://accounts.google.com")
# Seconds of clock difference tolerated on `iat` and `exp`.
LEEWAY = 30
# Keys kept this long when the answer names no max-age; at least MIN_TTL whatever it says.
DEFAULT_TTL = 300.0
MIN_TTL = 30.0
# After a failed fetch, none is tried for this long (a storm of triggers does not become a
# storm of fetches); and a token naming an unknown kid makes one fetch at most this often.
RETRY_INTERVAL = 10.0
UNKNOWN_KID_INTERVAL = 30.0

MAX_AGE = re.compile(r"max-age\s*=\s*(\d+)", re.IGNORECASE)


def require_google_auth() -> None:
    """google-auth is the `oidc` extra's: without it, TRIGGER_AUTH=oidc cannot start."""
    try:
        import google.auth.jwt  # noqa: F401
    except ImportError as exc:
        raise SettingsError(
            "TRIGGER_AUTH has oidc, which needs google-auth: pip install 'cronlock[oidc]'"
        ) from exc


class GoogleCerts:
    """Google's public keys, by kid (PEM), cached as the module docstring says."""

    def __init__(
        self, url: str, timeout: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.clock = clock
        self.keys: dict[str, str] | None = None
        self.expires = 0.0
        self.not_before = 0.0  # no fetch before this (after a failure)
        self.kid_refetched = -UNKNOWN_KID_INTERVAL
        self.fetches = 0  # counted: the tests prove there is no fetch per request
        self._lock = asyncio.Lock()

    async def for_kid(self, kid: str | None) -> dict[str, str]:
        """The keys to check a token naming `kid` against; KeysUnavailable when there are
        none (never fetched, or every fetch failed)."""
        now = self.clock()
        stale = self.keys is None or now >= self.expires
        unknown = kid is not None and self.keys is not None and kid not in self.keys
        if unknown and now - self.kid_refetched >= UNKNOWN_KID_INTERVAL:
            self.kid_refetched = now
            stale = True
        if stale and now >= self.not_before:
            await self._refresh(self.fetches)
        if self.keys is None:
            raise KeysUnavailable("Google's OIDC keys could not be fetched")
        return self.keys

    async def _refresh(self, seen: int) -> None:
        async with self._lock:
            if self.fetches != seen:
                return  # fetched (or tried) by another request while this one waited
            self.fetches += 1
            try:
                async with httpx.AsyncClient(timeout=self.timeout) as client:
                    response = await client.get(self.url)
                response.raise_for_status()
                keys = parse_certs(response.json())
            except (httpx.HTTPError, ValueError) as exc:
                self.not_before = self.clock() + RETRY_INTERVAL
                kept = "keeping the keys fetched before" if self.keys else "no keys yet"
                # The type of the failure only: the URL is configuration, never a secret, but
                # an exception's text can quote a response body.
                log.warning("OIDC keys: fetch failed (%s); %s", type(exc).__name__, kept)
                return
            self.keys = keys
            self.expires = self.clock() + max_age(response.headers.get("cache-control"))


def max_age(cache_control: str | None) -> float:
    found = MAX_AGE.search(cache_control or "")
    return max(MIN_TTL, float(found[1])) if found else DEFAULT_TTL


def parse_certs(document: Any) -> dict[str, str]:
    """Google's certs in either of its formats: `{kid: PEM}` (oauth2/v1/certs) or a JWK set
    (oauth2/v3/certs), as PEM by kid; ValueError for anything else."""
    if isinstance(document, Mapping) and "keys" in document:
        keys = document["keys"]
        if not isinstance(keys, list):
            raise ValueError("a JWK set without a list of keys")
        return {str(k["kid"]): jwk_to_pem(k) for k in keys if isinstance(k, Mapping) and "kid" in k}
    if isinstance(document, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in document.items()
    ):
        return dict(document)
    raise ValueError("neither PEM certificates by kid nor a JWK set")


def jwk_to_pem(jwk: Mapping[str, Any]) -> str:
    """An RSA JWK's public key as PEM, which google-auth's verifier reads (cryptography is
    google-auth's own dependency)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicNumbers

    if jwk.get("kty") != "RSA":
        raise ValueError("only RSA keys")

    def number(name: str) -> int:
        raw = str(jwk[name])
        return int.from_bytes(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)), "big")

    key = RSAPublicNumbers(number("e"), number("n")).public_key()
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return pem.decode()


def unverified_header(token: bytes) -> dict[str, Any] | None:
    """A JWT's header if `token` has the shape of one, else None (not an OIDC token at all)."""
    if token.count(b".") != 2:
        return None
    first = token.split(b".", 1)[0]
    try:
        header = json.loads(base64.urlsafe_b64decode(first + b"=" * (-len(first) % 4)))
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


class OidcScheme:
    name = "oidc"
    challenge = 'Bearer realm="oidc"'

    def __init__(self, certs: GoogleCerts, audience: str | None, emails: frozenset[str]) -> None:
        self.certs = certs
        self.audience = audience
        self.emails = emails

    async def accepts(self, token: bytes, url: str) -> bool:
        """Whether `token` is a Google-signed ID token for this service (see the module's
        docstring); KeysUnavailable when it has a JWT's shape but no keys can be had."""
        from google.auth import jwt as google_jwt

        header = unverified_header(token)
        if header is None or header.get("alg") != "RS256":
            return False  # `alg: none` and HS256 included: Google signs with RS256
        kid = header.get("kid")
        keys = await self.certs.for_kid(kid if isinstance(kid, str) else None)
        try:
            claims = google_jwt.decode(  # type: ignore[no-untyped-call]
                token,
                certs=keys,
                audience=self.audience or url,
                clock_skew_in_seconds=LEEWAY,
            )
        except Exception:  # any refusal is a 401 (its text quotes the token)
            return False
        email = claims.get("email")
        return (
            claims.get("iss") in GOOGLE_ISSUERS
            and claims.get("email_verified") in (True, "true")
            and isinstance(email, str)
            and email.lower() in self.emails
        )
