"""How a trigger authenticates (TRIGGER_AUTH): the schemes, tried in the configured order, the
first that accepts wins; none accepting is a 401 whose `WWW-Authenticate` names every scheme
accepted. Fail closed: a header repeated, a token over `MAX_TOKEN` bytes, anything that does not
parse is refused, never an error of ours; and no token, key or signature is ever logged.

- `bearer`: CRON_SECRET (or its previous value), compared in constant time (`Tokens`).
- `oidc`: a Google-signed ID token (cronlock/web/oidc.py).
- `qstash`: Upstash's `Upstash-Signature`, an HS256 JWT over the exact body, checked with
  QSTASH_CURRENT_SIGNING_KEY, then QSTASH_NEXT_SIGNING_KEY (rotation); its `Upstash-Message-Id`
  is recorded with the run, which makes a redelivery of a message whose run succeeded
  "already done" (cronlock/core/runner.py `message_done`).

The scheme that accepted is the run's `source` (`http` for the Bearer secret, as before;
`oidc`; `qstash`). The token's audience (oidc) and the signature's subject (qstash) are the
trigger's URL as the scheduler called it: scheme and host from X-Forwarded-Proto and
X-Forwarded-Host only when the peer is one FORWARDED_ALLOW_IPS trusts.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from starlette.types import Scope

from cronlock.errors import KeysUnavailable
from cronlock.settings import Settings, SettingsError
from cronlock.web.auth import Access, Tokens, bearer_token
from cronlock.web.oidc import GoogleCerts, OidcScheme, require_google_auth

# A Google ID token is about 1 KiB, a QStash signature less: anything over this is refused
# unread.
MAX_TOKEN = 8192
# Upstash's message ids are short (`msg_...`); a longer one is not recorded but refused.
MAX_MESSAGE_ID = 256
# Seconds of clock difference tolerated on a QStash signature's `exp` and `nbf`.
QSTASH_LEEWAY = 30

AUTHORIZATION = b"authorization"
SIGNATURE = b"upstash-signature"
MESSAGE_ID = b"upstash-message-id"


@dataclass(frozen=True)
class Caller:
    """What a trigger request offers to be checked: its headers as received (repeats kept),
    the URL it was sent to when a scheme needs it (oidc, qstash; else empty), and its body
    when a scheme needs it (qstash)."""

    headers: Sequence[tuple[bytes, bytes]]
    url: str
    body: bytes | None

    def one(self, name: bytes) -> bytes | None:
        """The header's value when it is there exactly once; None when absent or repeated
        (two Authorization headers are an attempt to confuse, not a credential)."""
        found = [value for key, value in self.headers if key == name]
        return found[0] if len(found) == 1 else None


@dataclass(frozen=True)
class Accepted:
    source: str  # recorded as the run's source
    message_id: str | None = None


class Scheme(Protocol):
    name: str
    challenge: str

    async def check(self, caller: Caller) -> Accepted | None: ...


class BearerScheme:
    name = "bearer"
    challenge = "Bearer"

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    async def check(self, caller: Caller) -> Accepted | None:
        token = bearer_token(caller.one(AUTHORIZATION))
        if token is None or not self.tokens.accepts(Access.RUN, token):
            return None
        return Accepted("http")


class OidcTokenScheme:
    name = "oidc"
    challenge = OidcScheme.challenge

    def __init__(self, oidc: OidcScheme) -> None:
        self.oidc = oidc

    async def check(self, caller: Caller) -> Accepted | None:
        token = bearer_token(caller.one(AUTHORIZATION))
        if token is None or len(token) > MAX_TOKEN:
            return None
        return Accepted("oidc") if await self.oidc.accepts(token, caller.url) else None


class QStashScheme:
    name = "qstash"
    challenge = "Upstash-Signature"

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = tuple(keys)

    async def check(self, caller: Caller) -> Accepted | None:
        signature = caller.one(SIGNATURE)
        if signature is None or len(signature) > MAX_TOKEN or caller.body is None:
            return None
        if not self.verifies(signature, caller.body, caller.url):
            return None
        message = caller.one(MESSAGE_ID)
        message_id = message.decode("latin-1") if message is not None else None
        if message_id is not None and not (
            len(message_id) <= MAX_MESSAGE_ID and message_id.isascii() and message_id.isprintable()
        ):
            return None
        return Accepted("qstash", message_id)

    def verifies(self, signature: bytes, body: bytes, url: str) -> bool:
        """Upstash's format, as its SDK's `Receiver` checks it: HS256 with either key, issuer
        `Upstash`, `sub` the URL, `body` the base64url SHA-256 of the exact body, `exp` and
        `nbf`. Both keys are always tried, so timing does not tell which one signed."""
        import jwt

        digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=")
        found = False
        for key in self.keys:
            try:
                with warnings.catch_warnings():
                    # A key shorter than 32 bytes is Upstash's choice, not a caller's mistake:
                    # no warning per request for it.
                    warnings.simplefilter("ignore", jwt.warnings.InsecureKeyLengthWarning)
                    claims = jwt.decode(
                        signature,
                        key,
                        algorithms=["HS256"],
                        issuer="Upstash",
                        leeway=QSTASH_LEEWAY,
                        options={"require": ["iss", "sub", "exp", "nbf", "body"]},
                    )
            except Exception:  # noqa: S112 - any refusal is a 401 (its text may quote the token)
                continue
            sub, claimed = claims.get("sub"), claims.get("body")
            if not isinstance(sub, str) or not isinstance(claimed, str):
                continue
            found |= hmac.compare_digest(sub.encode(), url.encode()) and hmac.compare_digest(
                claimed.rstrip("=").encode(), digest
            )
        return found


class TriggerAuth:
    """The schemes a trigger may use, built once at start from checked settings (as `Tokens`
    is): what the router's triggers and the standalone service's Bearer check ask."""

    def __init__(self, schemes: Sequence[Scheme], trusted: Sequence[str] = ("127.0.0.1",)) -> None:
        if not schemes:
            raise ValueError("no trigger scheme")
        self.schemes = tuple(schemes)
        self.names = tuple(s.name for s in schemes)
        self.challenge = ", ".join(s.challenge for s in schemes)
        self.trusted = Trusted(trusted)
        # The Bearer secret is not bound to a URL: with it alone, none is worked out.
        self.wants_url = any(s.name != "bearer" for s in schemes)
        oidc = [s for s in schemes if isinstance(s, OidcTokenScheme)]
        self.certs = oidc[0].oidc.certs if oidc else None

    @classmethod
    def from_settings(cls, settings: Settings, tokens: Tokens) -> TriggerAuth:
        """SettingsError when a scheme that is on cannot tell a caller apart, or its library is
        not installed."""
        settings.check_trigger_auth()
        schemes: list[Scheme] = []
        for name in settings.trigger_schemes:
            if name == "bearer":
                schemes.append(BearerScheme(tokens))
            elif name == "oidc":
                require_google_auth()
                certs = GoogleCerts(settings.oidc_certs_url, settings.oidc_fetch_timeout)
                oidc = OidcScheme(certs, settings.oidc_audience, settings.oidc_emails)
                schemes.append(OidcTokenScheme(oidc))
            else:
                require_pyjwt()
                keys = [settings.qstash_current_signing_key, settings.qstash_next_signing_key]
                schemes.append(
                    QStashScheme([k.get_secret_value().encode() for k in keys if k is not None])
                )
        return cls(schemes, [ip.strip() for ip in settings.forwarded_allow_ips.split(",")])

    @property
    def wants_body(self) -> bool:
        return "qstash" in self.names

    def offers_other(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """Whether a request carries the credential of a scheme other than the Bearer secret
        (the standalone service's Bearer check lets it on to the trigger, which decides)."""
        names = {key for key, _ in headers}
        return ("oidc" in self.names and AUTHORIZATION in names) or (
            "qstash" in self.names and SIGNATURE in names
        )

    async def check(self, scope: Scope, body: bytes | None) -> Accepted | None:
        """The first scheme that accepts the request, or None. KeysUnavailable (a 503) only
        when no scheme accepted and one could not decide for want of keys."""
        url = self.called_url(scope) if self.wants_url else ""
        caller = Caller(scope["headers"], url, body)
        unavailable: KeysUnavailable | None = None
        for scheme in self.schemes:
            try:
                accepted = await scheme.check(caller)
            except KeysUnavailable as exc:
                unavailable = exc
                continue
            if accepted is not None:
                return accepted
        if unavailable is not None:
            raise unavailable
        return None

    def called_url(self, scope: Scope) -> str:
        """The URL the scheduler sent the trigger to (see the module's docstring)."""
        headers = dict(reversed(scope["headers"]))  # the first of a repeated header
        scheme: str = scope.get("scheme", "http")
        host = headers.get(b"host", b"").decode("latin-1")
        client = scope.get("client")
        if client and self.trusted(client[0]):
            proto = headers.get(b"x-forwarded-proto", b"").decode("latin-1")
            forwarded = headers.get(b"x-forwarded-host", b"").decode("latin-1")
            scheme = proto.split(",")[0].strip() or scheme
            host = forwarded.split(",")[0].strip() or host
        path = scope.get("raw_path") or scope["path"].encode()
        url = f"{scheme}://{host}{path.decode('latin-1')}"
        query: bytes = scope.get("query_string", b"")
        return f"{url}?{query.decode('latin-1')}" if query else url


class Trusted:
    """FORWARDED_ALLOW_IPS: addresses and networks, or `*`."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.any = "*" in entries
        self.networks = []
        for entry in entries:
            if entry and entry != "*":
                try:
                    self.networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError as exc:
                    raise SettingsError(
                        f"FORWARDED_ALLOW_IPS: {entry!r} is no address or network"
                    ) from exc

    def __call__(self, peer: str) -> bool:
        if self.any:
            return True
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in network for network in self.networks)


def require_pyjwt() -> None:
    """PyJWT is the `qstash` extra's: without it, TRIGGER_AUTH=qstash cannot start."""
    try:
        import jwt  # noqa: F401
    except ImportError as exc:
        raise SettingsError(
            "TRIGGER_AUTH has qstash, which needs PyJWT: pip install 'cronlock[qstash]'"
        ) from exc
