"""TRIGGER_AUTH besides the Bearer secret (cronlock/web/schemes.py, cronlock/web/oidc.py):
Google-signed ID tokens made by google-auth's own signer with a local key, whose certificate a
local HTTP server serves as Google does; QStash signatures made in Upstash's format and checked
by the official SDK's `Receiver` in the test itself; the message-id redelivery rule; the run's
source; the standalone service and a host app alike. Nothing is downloaded."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import asyncpg
import httpx
import jwt as pyjwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from fastapi import FastAPI
from google.auth import crypt
from google.auth import jwt as google_jwt
from qstash import Receiver
from qstash.errors import SignatureError

from cronlock import Cronlock, JobContext, Settings, SettingsError
from cronlock.errors import KeysUnavailable
from cronlock.web import oidc
from cronlock.web.auth import Tokens
from cronlock.web.schemes import Caller, QStashScheme, TriggerAuth
from tests.support import TEST_SECRET
from tests.support.asgi import Dispatch, StartApp, serve
from tests.util import AUTH

EMAIL = "scheduler@project.iam.gserviceaccount.com"
KID = "local-key-1"
CURRENT = "sig_current_0123456789abcdefghijklm"
NEXT = "sig_next_0123456789abcdefghijklmno"


def make_key(kid: str) -> tuple[crypt.RSASigner, str]:
    """A signer (google-auth's) and its certificate in PEM, as Google publishes them."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "local")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    signer = crypt.RSASigner.from_string(private, key_id=kid)  # type: ignore[no-untyped-call]
    return signer, cert.public_bytes(serialization.Encoding.PEM).decode()


SIGNER, CERT = make_key(KID)
OTHER_SIGNER, _ = make_key("local-key-2")


class CertsServer:
    """Google's certs endpoint on loopback: `{kid: PEM}` with a max-age; counts its fetches."""

    def __init__(self) -> None:
        self.certs = {KID: CERT}
        self.up = True
        self.fetches = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.fetches += 1
                if not outer.up:
                    self.send_response(503)
                    self.end_headers()
                    return
                body = json.dumps(outer.certs).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Cache-Control", "public, max-age=3600")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/oauth2/v1/certs"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def certs() -> Iterator[CertsServer]:
    server = CertsServer()
    yield server
    server.close()


def id_token(audience: str, signer: crypt.Signer = SIGNER, **claims: Any) -> str:
    now = int(time.time())
    payload = {
        "iss": "https://accounts.google.com",
        "aud": audience,
        "sub": "1234567890",
        "email": EMAIL,
        "email_verified": True,
        "iat": now,
        "exp": now + 3600,
        **claims,
    }
    token: bytes = google_jwt.encode(signer, payload)  # type: ignore[no-untyped-call]
    return token.decode()


def qstash_signature(url: str, body: bytes, key: str = CURRENT, **claims: Any) -> str:
    """Upstash's documented format: HS256, iss Upstash, sub the URL, body the base64url
    SHA-256 of the body."""
    now = int(time.time())
    digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).decode().rstrip("=")
    payload = {
        "iss": "Upstash",
        "sub": url,
        "exp": now + 300,
        "nbf": now,
        "iat": now,
        "jti": "jwt_1",
        "body": digest,
        **claims,
    }
    return pyjwt.encode(payload, key, algorithm="HS256")


def upstash_accepts(signature: str, body: bytes, url: str) -> bool:
    """The official SDK's verdict on the very signature the test sends."""
    try:
        Receiver(CURRENT, NEXT).verify(signature=signature, body=body.decode(), url=url)
    except SignatureError:
        return False
    return True


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def auth_settings(certs: CertsServer, **overrides: Any) -> dict[str, Any]:
    return {
        "trigger_auth": "bearer,oidc,qstash",
        "oidc_certs_url": certs.url,
        "oidc_fetch_timeout": 2.0,
        "oidc_allowed_emails": EMAIL,
        "qstash_current_signing_key": CURRENT,
        "qstash_next_signing_key": NEXT,
        **overrides,
    }


# --- the schemes on their own ------------------------------------------------------------


def test_settings_fail_closed() -> None:
    def settings(**values: Any) -> Settings:
        return Settings(_env_file=None, cron_secret=TEST_SECRET, **values)

    with pytest.raises(ValueError, match="distinct schemes"):
        settings(trigger_auth="bearer,basic")
    with pytest.raises(ValueError, match="distinct schemes"):
        settings(trigger_auth="oidc,oidc")
    with pytest.raises(SettingsError, match="OIDC_ALLOWED_EMAILS"):
        Cronlock(settings(trigger_auth="oidc"))
    with pytest.raises(SettingsError, match="QSTASH_CURRENT_SIGNING_KEY"):
        Cronlock(settings(trigger_auth="qstash"))
    with pytest.raises(SettingsError, match="FORWARDED_ALLOW_IPS"):
        Cronlock(settings(forwarded_allow_ips="proxy.local"))
    cron = Cronlock(settings(trigger_auth="qstash,bearer", qstash_current_signing_key=CURRENT))
    assert cron.trigger_auth.challenge == "Upstash-Signature, Bearer"


def test_qstash_signatures_as_the_sdk_checks_them() -> None:
    url, body = "https://jobs.example.com/cron/fast", b'{"a": 1}'
    scheme = QStashScheme([CURRENT.encode(), NEXT.encode()])
    cases = {
        "current key": (qstash_signature(url, body), body, url, True),
        "next key": (qstash_signature(url, body, key=NEXT), body, url, True),
        "another key": (
            qstash_signature(url, body, key="sig_other_0123456789abcdefghijklmnop"),
            body,
            url,
            False,
        ),
        "tampered body": (qstash_signature(url, body), b'{"a": 2}', url, False),
        "wrong url": (qstash_signature(url, body), body, url + "x", False),
        "expired": (qstash_signature(url, body, exp=int(time.time()) - 120), body, url, False),
        "not yet": (qstash_signature(url, body, nbf=int(time.time()) + 120), body, url, False),
        "other issuer": (qstash_signature(url, body, iss="Other"), body, url, False),
    }
    for case, (signature, sent, at, ok) in cases.items():
        assert upstash_accepts(signature, sent, at) is ok, case
        assert scheme.verifies(signature.encode(), sent, at) is ok, case


async def test_google_certs_cached_per_max_age_refetched_once_on_an_unknown_kid(
    certs: CertsServer,
) -> None:
    now = [1000.0]
    keys = oidc.GoogleCerts(certs.url, 2.0, clock=lambda: now[0])
    scheme = oidc.OidcScheme(keys, "https://a.example/cron/fast", frozenset({EMAIL}))
    token = id_token("https://a.example/cron/fast").encode()
    for _ in range(20):
        assert await scheme.accepts(token, "ignored: OIDC_AUDIENCE is set")
    assert certs.fetches == 1  # no fetch per request
    unknown = id_token("https://a.example/cron/fast", signer=OTHER_SIGNER).encode()
    assert not await scheme.accepts(unknown, "")
    assert certs.fetches == 2  # refetched once for the unknown kid...
    for _ in range(5):
        assert not await scheme.accepts(unknown, "")
    assert certs.fetches == 2  # ...and not again for a while
    # Expired (max-age 3600) with the server down: the keys kept keep working, and a failed
    # fetch is not tried again at once.
    certs.up = False
    now[0] += 3601
    assert await scheme.accepts(token, "")
    assert await scheme.accepts(token, "")
    assert certs.fetches == 3
    # A server down with nothing cached: the token cannot be checked (a 503), not a 401.
    empty = oidc.OidcScheme(oidc.GoogleCerts(certs.url, 2.0), None, frozenset({EMAIL}))
    with pytest.raises(KeysUnavailable):
        await empty.accepts(token, "https://a.example/cron/fast")
    # Google's other format, a JWK set, is read too.
    assert oidc.parse_certs({"keys": []}) == {}


async def test_oidc_claims(certs: CertsServer) -> None:
    url = "https://jobs.example.com/cron/fast"
    keys = oidc.GoogleCerts(certs.url, 2.0)
    scheme = oidc.OidcScheme(keys, None, frozenset({EMAIL}))
    past = int(time.time()) - 7200
    cases = {
        "valid": (id_token(url), True),
        "wrong audience": (id_token("https://elsewhere.example/cron/fast"), False),
        "expired": (id_token(url, iat=past, exp=past + 3600), False),
        "wrong issuer": (id_token(url, iss="https://evil.example"), False),
        "unverified email": (id_token(url, email_verified=False), False),
        "unlisted email": (id_token(url, email="someone@gmail.com"), False),
    }
    for case, (token, ok) in cases.items():
        assert await scheme.accepts(token.encode(), url) is ok, case


def bad_tokens(url: str) -> dict[str, str]:
    valid = id_token(url)
    head, payload, _ = valid.split(".")
    none = base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT"}').decode().rstrip("=")
    hs256 = pyjwt.encode({"iss": "https://accounts.google.com", "aud": url}, "k" * 40, "HS256")
    return {
        "garbage": "not-a-token-at-all-but-long-enough-xxxxxxxx",
        "binary": "%%%.%%%.%%%",
        "truncated": valid[: len(valid) // 2],
        "no signature": f"{head}.{payload}.",
        "alg none": f"{none}.{payload}.",
        "hs256": hs256,
        "oversized": "a" * 9000,
    }


# --- over HTTP: the standalone service and a host app --------------------------------------


async def runs_of(database_url: str, job: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(
            "SELECT id, status, source, message_id FROM cronlock.runs WHERE job = $1 ORDER BY id",
            job,
        )
    finally:
        await conn.close()


async def test_the_standalone_service_takes_each_scheme_and_records_it(
    start_app: StartApp,
    client: httpx.AsyncClient,
    certs: CertsServer,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = await start_app(**auth_settings(certs))
    url = f"{app.url}/cron/fast"
    assert (await client.post(url, headers=AUTH)).status_code == 200
    ran = await client.post(url, headers=bearer(id_token(url)))
    assert ran.status_code == 200, ran.text
    body = b"{}"
    signature = qstash_signature(url, body)
    assert upstash_accepts(signature, body, url)
    signed = {"Upstash-Signature": signature, "Upstash-Message-Id": "msg_1"}
    first = await client.post(url, content=body, headers=signed)
    assert first.status_code == 200, first.text
    again = await client.post(url, content=body, headers=signed)
    assert again.json() == {
        "job": "fast",
        "skipped": True,
        "reason": "already done",
        "run_id": first.json()["run_id"],
    }
    rows = await runs_of(database_url, "fast")
    assert [(r["source"], r["message_id"]) for r in rows] == [
        ("http", None),
        ("oidc", None),
        ("qstash", "msg_1"),
    ]
    # The run view and the dashboard show it.
    view = await client.get(f"{app.url}/cron/runs/{rows[1]['id']}", headers=AUTH)
    assert view.json()["source"] == "oidc"

    # A redelivery after a failed run is a retry: it runs again.
    failing = f"{app.url}/cron/fails"
    redelivery = {"Upstash-Signature": qstash_signature(failing, b""), "Upstash-Message-Id": "m2"}
    assert (await client.post(failing, headers=redelivery)).status_code == 500
    assert (await client.post(failing, headers=redelivery)).status_code == 500
    assert [r["status"] for r in await runs_of(database_url, "fails")] == ["failed", "failed"]

    # Bad input: 401 naming every scheme, never a 5xx, never a token in a log line.
    caplog.set_level(logging.DEBUG)
    challenge = 'Bearer, Bearer realm="oidc", Upstash-Signature'
    sent = []
    for case, token in bad_tokens(url).items():
        sent.append(token)
        refused = await client.post(url, headers=bearer(token))
        assert refused.status_code == 401, case
        assert refused.headers["www-authenticate"] == challenge
    other = {
        "tampered body": (b'{"x": 1}', {"Upstash-Signature": signature}),
        "another scheme's token": (body, bearer(signature)),
        "an id token as a signature": (body, {"Upstash-Signature": id_token(url)}),
        "oversized body": (b" " * 70000, {"Upstash-Signature": signature}),
    }
    for case, (content, headers) in other.items():
        sent.extend(headers.values())
        assert (await client.post(url, content=content, headers=headers)).status_code == 401, case
    repeated = [("Authorization", f"Bearer {id_token(url)}")] * 2
    assert (await client.post(url, headers=repeated)).status_code == 401
    signed_twice = [("Upstash-Signature", signature)] * 2
    assert (await client.post(url, content=body, headers=signed_twice)).status_code == 401
    logged = caplog.text + app.log()
    assert not any(token in logged for token in sent)
    assert CURRENT not in logged
    assert TEST_SECRET not in logged

    # Reads and writes stay the secret's: an ID token reads nothing, pauses nothing.
    assert (
        await client.get(f"{app.url}/cron/runs", headers=bearer(id_token(url)))
    ).status_code == 401
    # Unknown jobs answer as known ones do, to a caller without a credential.
    unknown = await client.post(f"{app.url}/cron/nope", headers=bearer(id_token(url)))
    assert (unknown.status_code, unknown.headers["www-authenticate"]) == (401, challenge)


async def test_certs_down_is_503_for_oidc_only(
    start_app: StartApp, client: httpx.AsyncClient, certs: CertsServer
) -> None:
    certs.up = False
    app = await start_app(**auth_settings(certs))
    url = f"{app.url}/cron/fast"
    down = await client.post(url, headers=bearer(id_token(url)))
    assert down.status_code == 503
    assert "retry-after" in down.headers
    assert (await client.post(url, headers=AUTH)).status_code == 200
    # Not a JWT at all: nothing to fetch keys for, a 401.
    assert (await client.post(url, headers=bearer("x" * 40))).status_code == 401
    assert certs.fetches == 1  # one try, not one per request


async def test_a_host_app_takes_the_same_schemes_behind_its_proxy(
    database_url: str, dispatch: Dispatch, client: httpx.AsyncClient, certs: CertsServer
) -> None:
    settings = Settings(
        _env_file=None,
        database_url=database_url,
        cron_secret=TEST_SECRET,
        outbox_enabled=False,
        migrate_retry_interval=0.2,
        instance_name="host",
        **auth_settings(certs, forwarded_allow_ips="127.0.0.1"),
    )
    cron = Cronlock(settings)

    @cron.job("hello")
    async def hello(ctx: JobContext) -> str:
        return "hi"

    app = FastAPI(lifespan=cron.lifespan)
    app.include_router(cron.router)
    async with serve(app, "host") as host:
        dispatch.add(host)
        deadline = time.monotonic() + 30
        while not await cron.ready():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        # The scheduler called the public URL; the proxy (trusted: the peer is 127.0.0.1)
        # says so in its headers.
        public = "https://jobs.example.com/cron/hello"
        proxied = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "jobs.example.com"}
        ran = await client.post(
            f"{host.url}/cron/hello", headers={**proxied, **bearer(id_token(public))}
        )
        assert ran.status_code == 200, ran.text
        body = b""
        signed = {**proxied, "Upstash-Signature": qstash_signature(public, body)}
        assert (await client.post(f"{host.url}/cron/hello", headers=signed)).status_code == 200
        # Without the proxy's word the URL is the one the app sees: not the token's audience.
        alone = await client.post(f"{host.url}/cron/hello", headers=bearer(id_token(public)))
        assert alone.status_code == 401
        assert [r["source"] for r in await runs_of(database_url, "hello")] == ["oidc", "qstash"]


def test_an_untrusted_peer_does_not_choose_the_url() -> None:
    auth = TriggerAuth.from_settings(
        Settings(_env_file=None, cron_secret=TEST_SECRET, forwarded_allow_ips="10.0.0.0/8"),
        Tokens([TEST_SECRET.encode()]),
    )
    scope: dict[str, Any] = {
        "scheme": "http",
        "path": "/cron/fast",
        "raw_path": b"/cron/fast",
        "query_string": b"a=1",
        "headers": [
            (b"host", b"app.internal:8000"),
            (b"x-forwarded-proto", b"https"),
            (b"x-forwarded-host", b"jobs.example.com"),
        ],
    }
    assert auth.called_url({**scope, "client": ("10.1.2.3", 5)}) == (
        "https://jobs.example.com/cron/fast?a=1"
    )
    assert auth.called_url({**scope, "client": ("192.0.2.1", 5)}) == (
        "http://app.internal:8000/cron/fast?a=1"
    )
    assert Caller([(b"a", b"1"), (b"a", b"2")], "", None).one(b"a") is None
