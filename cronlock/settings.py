"""All configuration, from the environment (and `.env`); every setting is listed in `.env.example`.

Timers are float seconds so tests can make them short.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cronlock.errors import ConfigurationError
from cronlock.inputs import has_control, text_problem
from cronlock.sql import check_name

# The value `.env.example` ships with: a service started with it must refuse, never run.
PLACEHOLDER_SECRET = "change-me-to-a-random-string-of-32-or-more-characters"  # noqa: S105
MIN_SECRET_LENGTH = 32


class SettingsError(ConfigurationError, ValueError):
    """The configuration cannot run safely; the message says what to change."""


def _default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseSettings):
    # hide_input_in_errors: a ValidationError's text (a service's start-up log) never quotes a
    # value, which may be a password in DATABASE_URL or a secret.
    model_config = SettingsConfigDict(
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
        hide_input_in_errors=True,
    )

    # --- database -------------------------------------------------------------------------
    database_url: str | None = None
    # A direct (not pooled) URL for LISTEN, which does not work through PgBouncer in
    # transaction mode; defaults to database_url.
    database_direct_url: str | None = None
    # The PostgreSQL schema every cronlock object lives in (created by `migrate` if absent);
    # two deployments with different schemas in one database are fully separate.
    db_schema: str = "cronlock"
    # One more than the jobs that may run at once: a run also briefly needs a second
    # connection to record itself in the ledger.
    db_pool_max_size: int = Field(default=10, ge=2)
    db_acquire_timeout: float = Field(default=2.0, gt=0)
    # Per host of a multi-host DATABASE_URL (cronlock/db/primary.py), as libpq's connect_timeout.
    db_connect_timeout: float = Field(default=5.0, gt=0)
    # cronlock's own statements: around a run (probe, lock, ledger, commit), the read routes,
    # the outbox's claims and outcome writes, and the CLI's commands except `migrate`. Past
    # this the connection is closed (a trigger answers 503, the outbox retries later, the CLI
    # exits 3), for a database or pooler that stops answering without closing the socket.
    # Not the job's statements: its timeout bounds those.
    db_query_timeout: float = Field(default=10.0, gt=0)
    # PgBouncer < 1.21 cannot route prepared statements: keep 0 unless connecting directly.
    db_statement_cache_size: int = Field(default=0, ge=0)
    # Database-side timeouts are the job's timeout plus this margin, so the service's own
    # timeout answers first and the database still frees the lock of a frozen instance.
    db_timeout_margin: float = Field(default=5.0, gt=0)
    db_client_check_interval: float = Field(default=1.0, ge=0)
    migrate_on_start: bool = True
    # The first retry of a failed check or migration; it doubles per failure up to the max.
    migrate_retry_interval: float = Field(default=2.0, gt=0)
    migrate_retry_max: float = Field(default=60.0, gt=0)
    # A migration's statements wait at most this long for a lock the application holds
    # (PostgreSQL's lock_timeout), rather than queueing the application's queries behind them.
    migrate_lock_timeout: float = Field(default=10.0, gt=0)
    # Folder of the embedded PostgreSQL started by `python -m cronlock serve` without DATABASE_URL.
    embedded_pg_dir: Path = Path("var/pg")

    # --- auth -----------------------------------------------------------------------------
    cron_secret: SecretStr | None = None
    cron_secret_file: Path | None = None
    cron_secret_previous: SecretStr | None = None
    # A token that can read (jobs, runs, locks) but never run anything.
    cron_read_token: SecretStr | None = None
    metrics_token: SecretStr | None = None
    # How a trigger (`POST /cron/<job>`) may authenticate, a comma list tried in order, the
    # first that accepts wins: `bearer` (CRON_SECRET), `oidc` (a Google-signed ID token: Cloud
    # Scheduler), `qstash` (Upstash's signed deliveries). Reads and writes take the secret only.
    trigger_auth: str = "bearer"
    # oidc: where Google publishes its keys (PEM by kid, or a JWK set), read with this timeout
    # and kept as long as the answer's max-age says; the `aud` a token must carry (default: the
    # trigger's URL as the scheduler called it); the service accounts allowed, a comma list.
    oidc_certs_url: str = "https://www.googleapis.com/oauth2/v1/certs"
    oidc_fetch_timeout: float = Field(default=5.0, gt=0)
    oidc_audience: str | None = None
    oidc_allowed_emails: str = ""
    # Whose X-Forwarded-Proto and X-Forwarded-Host make the URL a token's audience (oidc) or a
    # signature's subject (qstash) is checked against: addresses or networks, a comma list,
    # `*` for any (the variable uvicorn reads for the same headers).
    forwarded_allow_ips: str = "127.0.0.1"
    # qstash: the signing keys from Upstash's console; the next one too, for rotation.
    qstash_current_signing_key: SecretStr | None = None
    qstash_next_signing_key: SecretStr | None = None

    # --- jobs -----------------------------------------------------------------------------
    cron_jobs: str = "cronlock.demo.digest,cronlock.housekeeping"
    lock_namespace: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    instance_name: str = Field(default_factory=_default_instance)
    cron_allow_get: bool = False
    max_body_bytes: int = Field(default=65536, ge=0)
    backfill_window: float = Field(default=7 * 86400.0, ge=0)
    # How often an instance looks for missed slots of jobs with a missed-slot policy
    # (`missed="latest"` or `"all"`, or `catch_up=True`).
    catch_up_interval: float = Field(default=60.0, gt=0)
    # A running job's holder looks at its ledger row this often for a cancel request
    # (`python -m cronlock cancel`, cronlock/core/cancel.py).
    cancel_poll_interval: float = Field(default=0.5, gt=0)
    # How long `cancel` waits for the holder to react before it cancels or terminates the
    # holder's backend from the database instead.
    cancel_grace: float = Field(default=5.0, ge=0)
    # How often each instance looks for due retries of jobs with `retries=`
    # (cronlock/core/retries.py).
    retry_poll_interval: float = Field(default=5.0, gt=0)
    # The built-in scheduler (cronlock/core/scheduler.py): every instance triggers every
    # scheduled job at each of its slots, on the database's clock; the lock and the ledger
    # make it one run.
    scheduler_enabled: bool = False
    # Each trigger waits a random 0..jitter seconds after its slot (at most a quarter of the
    # job's interval), so the instances do not all hit the database in the same millisecond.
    scheduler_jitter: float = Field(default=0.5, ge=0)
    # How often the offset between this instance's clock and the database's is measured again.
    scheduler_clock_interval: float = Field(default=60.0, gt=0)
    # Dynamic schedules (cronlock/core/schedules.py), dispatched by the built-in scheduler: the
    # most runs of them one instance has under way at once (due rows beyond wait in the table,
    # holding no connection), how often it looks for due rows, and how long a claimed row is
    # left to the instance that claimed it (one killed after its claim delays that run so long).
    scheduler_concurrency: int = Field(default=10, ge=1, le=1000)
    scheduler_poll_interval: float = Field(default=1.0, gt=0)
    scheduler_claim_timeout: float = Field(default=10.0, gt=0)
    # The most schedules the table may hold (a set beyond it is refused with a 422); 0: no limit.
    schedules_max: int = Field(default=0, ge=0)
    ledger_retention_days: float = Field(default=90.0, gt=0)
    # Lease jobs (`@job(..., lease=)`): how often each instance looks for runs whose lease ran
    # out, to take them over; and the part of a lease its holder keeps in hand, besides
    # DB_QUERY_TIMEOUT, when it decides its lease may have run out (cronlock/core/lease.py
    # `stop_at`).
    lease_poll_interval: float = Field(default=2.0, gt=0)
    lease_margin: float = Field(default=1.0, ge=0)
    # Fan-out jobs (`fanout=True`, cronlock/core/fanout.py): items each instance works at once
    # (each holds a pooled connection for its transaction: keep it below DB_POOL_MAX_SIZE);
    # how often idle workers look for items when no NOTIFY wakes them (PgBouncer in
    # transaction mode cannot carry LISTEN: set DATABASE_DIRECT_URL); the most items one run
    # may plan; the first backoff of a failed item, doubling per attempt.
    fanout_concurrency: int = Field(default=4, ge=1, le=1000)
    fanout_poll_interval: float = Field(default=1.0, gt=0)
    fanout_max_items: int = Field(default=1_000_000, ge=1)
    fanout_retry_delay: float = Field(default=1.0, ge=0)
    # uvicorn waits for ever for running requests by default; a job in flight at SIGTERM
    # gets this long, then is cancelled and rolled back.
    graceful_shutdown_timeout: float = Field(default=30.0, gt=0)
    # One log line per trigger, skips included. Off: "already running"/"already done" skips
    # go to DEBUG (still counted in /metrics), for deployments whose storms would flood logs.
    log_skips: bool = True
    log_format: Literal["auto", "json", "text"] = "auto"
    log_level: str = "INFO"
    # OpenTelemetry spans (docs/tracing.md): auto traces with the process's tracer provider
    # when one is set (a host app's, or the service's own from OTEL_TRACES_EXPORTER), off never.
    tracing: Literal["auto", "off"] = "auto"

    # --- alerts (cronlock/delivery/alerts.py) ----------------------------------------------
    # A webhook for every job without its own `webhook_url=`: failed, timed_out, overdue,
    # recovered, paused_too_long (and lease_lost) events, signed the Standard Webhooks way
    # with ALERT_WEBHOOK_SECRET (`whsec_` + base64 of the key; required with any webhook).
    alert_webhook_url: str | None = None
    alert_webhook_secret: SecretStr | None = None
    # A Healthchecks.io-style ping URL for every job without its own `ping_url=`; `{job}` is
    # replaced by the job's name (e.g. https://hc-ping.com/<ping-key>/{job}). Start pings go
    # to <url>/start, failures to <url>/fail, successes to <url>.
    alert_ping_url: str | None = None
    # How often each instance looks for new events and sends what is due.
    alert_poll_interval: float = Field(default=2.0, gt=0)
    # A paused job raises `paused_too_long` once it has been paused this long.
    alert_paused_too_long: float = Field(default=86400.0, gt=0)
    # Events this old are still raised by an instance that starts (after an outage of all).
    alert_lookback: float = Field(default=3600.0, gt=0)
    alert_send_timeout: float = Field(default=10.0, gt=0)
    # A claimed alert not marked sent within this is sent again by another instance.
    alert_lease: float = Field(default=30.0, gt=0)
    alert_max_attempts: int = Field(default=20, ge=1)
    alert_backoff_base: float = Field(default=1.0, gt=0)
    alert_backoff_max: float = Field(default=300.0, gt=0)
    # Webhooks are given up after this long (pings: after the job's grace).
    alert_retry_window: float = Field(default=86400.0, gt=0)

    # --- dashboard (/ui/, docs/dashboard.md) -----------------------------------------------
    ui_enabled: bool = True
    # The session cookie's `Secure` flag. Keep it on behind TLS termination (the app only sees
    # plain http there); `python -m cronlock serve` on loopback turns it off unless set, and
    # says so.
    ui_cookie_secure: bool = True
    # A session ends this long after login (logout, or rotating its token, ends it at once).
    ui_session_ttl: float = Field(default=12 * 3600.0, gt=0)
    # How often an open page refreshes its data (JavaScript; 0 = never).
    ui_refresh_interval: float = Field(default=5.0, ge=0)
    # In an app that registers `cron.metrics` in its own Prometheus registry: how often the
    # deployment-wide gauges (overdue jobs, pauses, the outbox) are read from the database.
    metrics_refresh_interval: float = Field(default=15.0, gt=0)

    # --- outbox delivery --------------------------------------------------------------------
    outbox_enabled: bool = True
    outbox_batch_size: int = Field(default=50, ge=1)
    outbox_concurrency: int = Field(default=8, ge=1)
    outbox_lease: float = Field(default=60.0, gt=0)
    outbox_poll_interval: float = Field(default=2.0, gt=0)
    outbox_send_timeout: float = Field(default=10.0, gt=0)
    outbox_max_attempts: int = Field(default=12, ge=1)
    # Shorter than the provider's idempotency window (24 h at Resend).
    outbox_retry_window: float = Field(default=23 * 3600.0, gt=0)
    outbox_backoff_base: float = Field(default=2.0, gt=0)
    outbox_backoff_max: float = Field(default=900.0, gt=0)
    # Provider requests per second shared by every sender (0 = unlimited).
    outbox_rate_limit: float = Field(default=2.0, ge=0)
    outbox_retention_days: float = Field(default=7.0, gt=0)
    outbox_shutdown_timeout: float = Field(default=10.0, gt=0)
    # Emails per provider request (POST /emails/batch; Resend takes up to 100). 1 sends one
    # email per request. Only the http backend batches; the rate limit counts requests.
    email_batch_size: int = Field(default=1, ge=1, le=100)

    email_backend: Literal["log", "http", "smtp"] = "log"
    email_from: str = "cronlock <digest@example.com>"
    email_api_url: str = "https://api.resend.com"
    email_api_key: SecretStr | None = None
    smtp_host: str = "localhost"
    smtp_port: int = 1025
    smtp_username: str | None = None
    smtp_password: SecretStr | None = None
    smtp_starttls: bool = False
    # One SMTP connection carries many messages (RSET between them), up to this many and for
    # at most this long; then it is closed and a new one opened.
    smtp_max_messages_per_connection: int = Field(default=100, ge=1)
    smtp_max_session_time: float = Field(default=300.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_default(cls, data: Any) -> Any:
        # `KEY=` in .env or the environment means "not set", as it does in .env.example.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (isinstance(v, str) and v == "")}
        return data

    @field_validator("db_schema")
    @classmethod
    def _schema_name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("database_url", "database_direct_url")
    @classmethod
    def _database_url(cls, v: str | None) -> str | None:
        # The message never quotes the URL: it may hold a password.
        problem = database_url_problem(v) if v is not None else None
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator(
        "cron_secret",
        "cron_secret_previous",
        "cron_read_token",
        "metrics_token",
        "alert_webhook_secret",
        "qstash_current_signing_key",
        "qstash_next_signing_key",
    )
    @classmethod
    def _blank_is_unset(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            return None
        if v is not None and not is_token(v.get_secret_value()):
            raise ValueError(TOKEN_RULE)
        return v

    @field_validator("trigger_auth")
    @classmethod
    def _trigger_auth(cls, v: str) -> str:
        schemes = [s.strip().lower() for s in v.split(",") if s.strip()]
        unknown = [s for s in schemes if s not in TRIGGER_SCHEMES]
        if unknown or not schemes or len(set(schemes)) != len(schemes):
            raise ValueError(f"a comma list of distinct schemes among {', '.join(TRIGGER_SCHEMES)}")
        return ",".join(schemes)

    @property
    def trigger_schemes(self) -> list[str]:
        return self.trigger_auth.split(",")

    @property
    def oidc_emails(self) -> frozenset[str]:
        return frozenset(
            e.strip().lower() for e in self.oidc_allowed_emails.split(",") if e.strip()
        )

    def check_trigger_auth(self) -> None:
        """Fail closed: a scheme that is on must be able to tell a caller apart."""
        schemes = self.trigger_schemes
        if "oidc" in schemes and not self.oidc_emails:
            raise SettingsError(
                "TRIGGER_AUTH has oidc: set OIDC_ALLOWED_EMAILS to the service accounts "
                "allowed to trigger (any Google account can get a Google-signed token)"
            )
        if "qstash" in schemes and self.qstash_current_signing_key is None:
            raise SettingsError(
                "TRIGGER_AUTH has qstash: set QSTASH_CURRENT_SIGNING_KEY (and "
                "QSTASH_NEXT_SIGNING_KEY) from Upstash's console"
            )

    @property
    def job_modules(self) -> list[str]:
        return [m.strip() for m in self.cron_jobs.split(",") if m.strip()]

    def secrets(self) -> list[bytes]:
        """The tokens that may trigger jobs: current first, then the previous one (rotation)."""
        current = self.cron_secret
        if current is None and self.cron_secret_file is not None:
            current = SecretStr(read_secret_file(self.cron_secret_file))
        found = [current, self.cron_secret_previous]
        return [s.get_secret_value().encode() for s in found if s is not None]

    def check_secrets(self) -> None:
        """Fail closed: no secret, a short one or the placeholder means nothing may start."""
        self.checked_tokens()

    def checked_tokens(self) -> dict[str, bytes]:
        """Every configured token by the setting it comes from, read once (CRON_SECRET_FILE
        too) and checked: what is checked is what is served, never a second read of the file.
        Raises SettingsError for no secret, a short token or the placeholder."""
        tokens = self.secrets()
        if not tokens:
            raise SettingsError(
                "CRON_SECRET is not set: cronlock refuses to start without one. "
                "Generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        named = {"CRON_SECRET": tokens[0]}
        if self.cron_secret_previous is not None:
            named["CRON_SECRET_PREVIOUS"] = tokens[-1]
        for extra in ("cron_read_token", "metrics_token"):
            value = getattr(self, extra)
            if value is not None:
                named[extra.upper()] = value.get_secret_value().encode()
        for name, token in named.items():
            where = name
            if name == "CRON_SECRET" and self.cron_secret is None:
                where = f"CRON_SECRET_FILE {self.cron_secret_file}"
            if token.decode(errors="replace").strip() == PLACEHOLDER_SECRET:
                raise SettingsError(f"{where} is the placeholder from .env.example: set a real one")
            if len(token) < MIN_SECRET_LENGTH:
                raise SettingsError(f"{where} is shorter than {MIN_SECRET_LENGTH} characters")
        return named

    def check_retention(self) -> None:
        """The ledger must outlive the backfill window: a slot whose succeeded row was pruned
        could be backfilled (?slot=, a missed-slot policy) and run a second time."""
        if self.ledger_retention_days * 86400 < self.backfill_window:
            raise SettingsError(
                f"LEDGER_RETENTION_DAYS ({self.ledger_retention_days:g} days) is shorter than "
                f"BACKFILL_WINDOW ({self.backfill_window:g} s): a slot whose run was pruned "
                "could be backfilled and run again; keep the ledger at least that long"
            )

    def check_email(self) -> None:
        """An HTTP backend without a key would fail every send; say so at start-up instead."""
        if self.outbox_enabled and self.email_backend == "http" and self.email_api_key is None:
            raise SettingsError("EMAIL_BACKEND=http needs EMAIL_API_KEY")

    @property
    def listen_url(self) -> str | None:
        return self.database_direct_url or self.database_url

    def secret_values(self) -> list[str]:
        """Every secret these settings hold, as text: the tokens (CRON_SECRET_FILE's too), the
        API and SMTP keys, the passwords of the database URLs (as given and decoded) and the
        whole alert webhook URL (a Slack-style URL is its own credential). What `scrub` hides
        in a failure's message and traceback before they are stored or logged."""
        found: list[str] = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                found.append(value.get_secret_value())
        if self.cron_secret_file is not None:
            # Unreadable now: then it was never a token this process used.
            with contextlib.suppress(SettingsError):
                found.append(read_secret_file(self.cron_secret_file))
        for url in (self.database_url, self.database_direct_url):
            password = urlsplit(url).password if url else None
            if password:
                found += [password, unquote(password)]
        if self.alert_webhook_url:
            found.append(self.alert_webhook_url)
        # Longest first: a secret that contains another is hidden whole. Very short values
        # (an empty password) would hide every occurrence of a letter.
        return sorted({v for v in found if len(v) >= 4}, key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    """`text` with every one of `secrets` replaced by `***`."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


TRIGGER_SCHEMES = ("bearer", "oidc", "qstash")

# A token goes into an HTTP header (`Authorization: Bearer ...`), which carries ASCII only.
TOKEN_RULE = "must be printable ASCII (letters, digits, punctuation)"  # noqa: S105


def is_token(value: str) -> bool:
    return all(" " <= c <= "~" for c in value)


def read_secret_file(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SettingsError(f"CRON_SECRET_FILE {path} cannot be read: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise SettingsError(f"CRON_SECRET_FILE {path} is not UTF-8 text") from None
    if not is_token(token):
        raise SettingsError(f"CRON_SECRET_FILE {path}: the secret {TOKEN_RULE}")
    return token


def split_hosts(url: str) -> list[tuple[str, int | None]]:
    """The hosts of a URL's authority, in order (`h1:5432,[::1]:5433,h3`); a single entry when
    there is one host or none (a unix socket given as `?host=`), which asyncpg handles alone."""
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    found: list[tuple[str, int | None]] = []
    for spec in netloc.split(","):
        if spec.startswith("["):
            host, _, rest = spec[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            host, _, port = spec.partition(":")
        found.append((unquote(host), int(port) if port else None))
    return found


def database_url_problem(url: str) -> str | None:
    """Why a DATABASE_URL cannot be one, or None; never quoting it (it may hold a password)."""
    problem = text_problem(url)
    if problem is None and has_control(url):
        problem = "contains a control character"
    if problem is not None:
        return problem
    example = "postgresql://user:password@host:5432/database"
    try:
        scheme = urlsplit(url).scheme
        ports = [port for _, port in split_hosts(url)]
    except ValueError:
        return f"is not a URL like {example}"
    if scheme not in ("postgresql", "postgres"):
        return f"must start with postgresql:// or postgres:// (e.g. {example})"
    if any(port is not None and not 1 <= port <= 65535 for port in ports):
        return "has a port outside 1-65535"
    return None
