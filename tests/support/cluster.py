"""A real cluster on one machine: PostgreSQL, PgBouncer (transaction mode), N uvicorn instances
and nginx in front, all on 127.0.0.1. `scripts/cluster --help`; the tests and bench/ use the
parts. Test and demo infrastructure: not part of the product's package.

Each server is a child process in its own process group, killed with its group, so nginx
workers or a job's subprocesses never outlive it; anything still running at exit is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import http.client
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from urllib.parse import quote, urlsplit

from cronlock.cli.embedded import (
    SUPERUSER,
    as_service_user,
    chown_to_service,
    free_port,
    prepare_dir,
    tail,
)
from cronlock.ops.sizing import sizing
from tests.support.postgres import ScratchPostgres

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_APP = "cronlock.service:create_app"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# Settings an instance must not inherit from whoever started it: the cluster decides them.
INHERIT_BLOCKLIST = ("DATABASE_", "CRON_")


class ServiceError(RuntimeError):
    """A cluster process failed to start, or died; the message carries its log tail."""


# --- a child process ------------------------------------------------------------------------


class Service:
    """A foreground server process with a log file, a readiness check and a bounded stop."""

    name = "service"
    # Drop root for servers that refuse it (PgBouncer) or should not have it.
    drop_root = True

    def __init__(self, dir: Path, port: int | None) -> None:
        self.dir = prepare_dir(Path(dir), mode=0o755) if self.drop_root else _mkdir(Path(dir))
        self._port_given = port is not None
        self.port = port if port is not None else free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_timeout = READY_TIMEOUT

    # --- what subclasses say ------------------------------------------------------------

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        return None

    def cwd(self) -> Path:
        # Servers get relative paths from here: subprocess enters it while still root, so a
        # dropped-privilege server never traverses the ancestors, which a concurrent pytest
        # session may chmod back to 0700 (/tmp/pytest-of-root) at any time.
        return self.dir

    def is_ready(self) -> bool:
        return _accepts(self.port)

    def configure(self) -> None:
        """Write configuration files for the current port."""

    @property
    def output_path(self) -> Path:
        return self.dir / f"{self.name}.out"

    def log(self) -> str:
        try:
            return self.output_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:]) or "(empty log)"

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self.process is None:
            raise ServiceError(f"{self.name} is not started")
        return self.process.pid

    def start(self) -> None:
        """Start and wait until ready; a port taken meanwhile is replaced (if we chose it)."""
        for _attempt in range(3):
            self.configure()
            self._spawn()
            try:
                self._wait_ready()
                return
            except ServiceError:
                in_use = "in use" in self.log()
                self._terminate_group(signal.SIGKILL, STOP_TIMEOUT)
                if self._port_given or not in_use:
                    raise
                self.port = free_port()
        raise ServiceError(f"{self.name}: no free port after 3 attempts")

    def _spawn(self) -> None:
        with self.output_path.open("ab") as out:
            if self.drop_root:
                chown_to_service(self.output_path)
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.cwd(),
                env=self.environment(),
                start_new_session=True,
                **(as_service_user() if self.drop_root else {}),
            )
        _live.add(self)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if not self.is_alive():
                raise ServiceError(
                    f"{self.name} exited ({self.returncode()}) while starting:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"{self.name} not ready on port {self.port} after {self.ready_timeout}s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.05)

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def check_alive(self) -> None:
        """Raise with the log tail if the process died (it is never restarted silently)."""
        if not self.is_alive():
            raise ServiceError(
                f"{self.name} is not running (exit code {self.returncode()}):\n{self.log_tail()}"
            )

    def signal(self, signum: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signum)

    def freeze(self) -> None:
        """SIGSTOP: the process keeps its sockets (and connections) open but does nothing."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def wait_exit(self, timeout: float) -> int:
        """The exit code, once the process exits; TimeoutError if it runs past `timeout`."""
        if self.process is None:
            raise ServiceError(f"{self.name} is not started")
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{self.name} still running after {timeout}s") from exc
        self._reap_group()
        return code

    def terminate(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit code."""
        return self._terminate_group(signal.SIGTERM, timeout)

    def kill(self) -> int | None:
        return self._terminate_group(signal.SIGKILL, STOP_TIMEOUT)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """For cleanup: works on a frozen process too."""
        self.signal(signal.SIGCONT)
        self.terminate(timeout)

    def restart(self) -> None:
        self.terminate()
        self.start()

    def _terminate_group(self, signum: int, timeout: float) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.signal(signum)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.process.wait(timeout)
        self._reap_group()
        _live.discard(self)
        return self.process.returncode

    def _reap_group(self) -> None:
        # The leader is gone; anything left in its group (nginx workers) goes with it.
        self.signal(signal.SIGKILL)


def _mkdir(path: Path) -> Path:
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            return False
        return True


_live: set[Service] = set()


@atexit.register
def _stop_live() -> None:
    for service in list(_live):
        with contextlib.suppress(Exception):
            service.stop(timeout=5.0)


# --- PgBouncer ------------------------------------------------------------------------------


class PgBouncer(Service):
    """PgBouncer in the foreground, trust auth, every database forwarded to one upstream."""

    name = "pgbouncer"

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        pool_mode: str = "transaction",
        default_pool_size: int = 20,
        max_client_conn: int = 200,
        reserve_pool_size: int = 0,
        dir: Path,
        listen_port: int | None = None,
        extra: dict[str, str] | None = None,
        upstream_user: str = SUPERUSER,
        upstream_password: str | None = None,
    ) -> None:
        super().__init__(dir, listen_port)
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.upstream_user = upstream_user
        self.upstream_password = upstream_password
        self.settings: dict[str, str] = {
            "listen_addr": "127.0.0.1",
            # No unix socket: a default one in /tmp would clash between PgBouncers.
            "unix_socket_dir": "",
            "auth_type": "trust",
            # Relative to the working directory (self.dir), see Service.cwd.
            "auth_file": "userlist.txt",
            "admin_users": upstream_user,
            "stats_users": upstream_user,
            "pool_mode": pool_mode,
            "default_pool_size": str(default_pool_size),
            "reserve_pool_size": str(reserve_pool_size),
            "max_client_conn": str(max_client_conn),
            # asyncpg sends it at startup; PgBouncer refuses unknown startup parameters.
            "ignore_startup_parameters": "extra_float_digits",
            # Transaction mode hands servers from client to client between transactions;
            # nothing session-level is expected to survive, so there is nothing to reset.
            "server_reset_query": "",
            # The default 15 s keeps clients failing long after a restarted PostgreSQL is back.
            "server_login_retry": "1",
            "server_connect_timeout": "5",
            # A query waiting for a server connection (PostgreSQL down or restarting) fails
            # after this, so the instance answers 503 instead of hanging. The default, 120 s,
            # outlasts nginx's read timeout: with PgBouncer's other defaults a client that is
            # already logged in waits for the whole of it.
            "query_wait_timeout": "3",
            "logfile": self.log_path.name,
            "log_connections": "0",
            "log_disconnections": "0",
        }
        self.settings.update(extra or {})

    @property
    def log_path(self) -> Path:
        return self.dir / "pgbouncer.log"

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.upstream_user}@127.0.0.1:{self.port}/{dbname}"

    def log(self) -> str:
        # Startup errors (bad config) reach only stderr; the rest is in the log file.
        logfile = tail(self.log_path, 10_000) if self.log_path.exists() else ""
        return logfile or super().log()

    def configure(self) -> None:
        upstream = f"host={self.upstream_host} port={self.upstream_port}"
        if self.upstream_password is not None:
            upstream += f" user={self.upstream_user} password={self.upstream_password}"
        settings = {**self.settings, "listen_port": str(self.port)}
        ini = "[databases]\n"
        ini += f"* = {upstream}\n\n[pgbouncer]\n"
        ini += "".join(f"{key} = {value}\n" for key, value in settings.items())
        self._write(self.dir / "pgbouncer.ini", ini, 0o600)
        self._write(self.dir / "userlist.txt", f'"{self.upstream_user}" ""\n', 0o600)

    def _write(self, path: Path, text: str, mode: int) -> None:
        path.write_text(text)
        path.chmod(mode)
        chown_to_service(path)

    def command(self) -> list[str]:
        return ["pgbouncer", "pgbouncer.ini"]


# --- nginx ----------------------------------------------------------------------------------


class Nginx(Service):
    """nginx in the foreground, round-robin over `upstreams` ("host:port")."""

    name = "nginx"

    def __init__(
        self,
        upstreams: list[str],
        *,
        dir: Path,
        listen_port: int | None = None,
        worker_connections: int = 4096,
        keepalive: int = 32,
        proxy_read_timeout: float = 120.0,
        proxy_connect_timeout: float = 2.0,
    ) -> None:
        if not upstreams:
            raise ValueError("nginx needs at least one upstream")
        super().__init__(dir, listen_port)
        self.upstreams = list(upstreams)
        self.worker_connections = worker_connections
        self.keepalive = keepalive
        self.proxy_read_timeout = proxy_read_timeout
        self.proxy_connect_timeout = proxy_connect_timeout

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def error_log_path(self) -> Path:
        return self.dir / "error.log"

    def log(self) -> str:
        return super().log() + (
            tail(self.error_log_path, 10_000) if self.error_log_path.exists() else ""
        )

    def configure(self) -> None:
        temp = self.dir / "temp"
        temp.mkdir(exist_ok=True)
        chown_to_service(temp)
        conf = self.dir / "nginx.conf"
        conf.write_text(self.render())
        chown_to_service(conf)

    def render(self) -> str:
        servers = "".join(
            f"        server {upstream} max_fails=1 fail_timeout=2s;\n"
            for upstream in self.upstreams
        )
        temp = "temp"
        read_timeout = f"{max(1, math.ceil(self.proxy_read_timeout * 1000))}ms"
        connect_timeout = f"{max(1, math.ceil(self.proxy_connect_timeout * 1000))}ms"
        return f"""# written by cronlock (tests/support/cluster.py)
daemon off;
worker_processes 1;
pid nginx.pid;
error_log {self.error_log_path.name} warn;

events {{
    worker_connections {self.worker_connections};
}}

http {{
    access_log off;
    client_body_temp_path {temp}/client_body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;

    upstream cronlock {{
{servers}        keepalive {self.keepalive};
        # Shorter than uvicorn's 5 s keep-alive: nginx must never reuse a connection the
        # instance is closing, or a POST fails with 502 (POSTs are not retried, see below).
        keepalive_timeout 4s;
    }}

    server {{
        listen 127.0.0.1:{self.port};
        client_max_body_size 1m;
        # Room for an over-long Authorization header (the default is 8k a line): a bogus 10 KB
        # token reaches the instance and gets its 401, like any wrong credentials.
        large_client_header_buffers 4 16k;

        proxy_http_version 1.1;
        # Empty Connection header: upstream keepalive. Authorization passes through untouched.
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_set_header X-Forwarded-Proto $scheme;
        proxy_connect_timeout {connect_timeout};
        proxy_read_timeout {read_timeout};
        proxy_send_timeout {read_timeout};

        location / {{
            error_page 418 = @non_idempotent;
            if ($request_method = POST) {{
                return 418;
            }}
            proxy_pass http://cronlock;
        }}

        # A POST that reached an instance may have started a job: retrying it on another
        # instance on a timeout or a dropped connection could run it twice.
        location @non_idempotent {{
            proxy_next_upstream off;
            proxy_pass http://cronlock;
        }}
    }}
}}
"""

    def command(self) -> list[str]:
        return ["nginx", "-p", "./", "-c", "nginx.conf", "-e", self.error_log_path.name]


# --- an app instance ------------------------------------------------------------------------


class Instance(Service):
    """One uvicorn process serving the app factory; secrets travel in its environment."""

    drop_root = False

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        *,
        port: int | None = None,
        dir: Path,
        app_factory: str = DEFAULT_APP,
        ready_path: str = "/healthz",
        ready_timeout: float = READY_TIMEOUT,
    ) -> None:
        super().__init__(dir, port)
        self.name = name
        self.env = dict(env)
        self.app_factory = app_factory
        self.ready_path = ready_path
        self.ready_timeout = ready_timeout

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def output_path(self) -> Path:
        return self.dir / f"{self.name}.log"

    def cwd(self) -> Path:
        return REPO_ROOT

    def command(self) -> list[str]:
        graceful = float(self.environment().get("GRACEFUL_SHUTDOWN_TIMEOUT", "30"))
        return [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            self.app_factory,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            # uvicorn takes whole seconds; rounding up never cuts the app's own timeout short.
            "--timeout-graceful-shutdown",
            str(math.ceil(graceful)),
            "--no-access-log",
        ]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(INHERIT_BLOCKLIST)}
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        env["INSTANCE_NAME"] = self.name
        return env

    def is_ready(self) -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2.0)
        try:
            connection.request("GET", self.ready_path)
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()


# --- the whole cluster ----------------------------------------------------------------------


class Cluster:
    """PostgreSQL (local, or `database_url`) + PgBouncer + `instances` app processes + nginx."""

    def __init__(
        self,
        dir: Path,
        *,
        instances: int = 3,
        pool_per_instance: int = 10,
        database_url: str | None = None,
        env: dict[str, str] | None = None,
        app_factory: str = DEFAULT_APP,
        nginx_port: int | None = None,
    ) -> None:
        self.dir = _mkdir(Path(dir))
        self.count = instances
        self.pool_per_instance = pool_per_instance
        self.sizes = sizing(instances, pool_per_instance)
        self.database_url = database_url
        self.env = dict(env or {})
        self.app_factory = app_factory
        self.nginx_port = nginx_port
        self.postgres: ScratchPostgres | None = None
        self.pgbouncer: PgBouncer | None = None
        self.instances: list[Instance] = []
        self.nginx: Nginx | None = None
        self.secret_source = "CRON_SECRET"

    @property
    def postgres_dsn(self) -> str:
        if self.database_url:
            return self.database_url
        if self.postgres is None:
            raise ServiceError("the cluster is not started")
        return self.postgres.dsn()

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        if not self.database_url:
            max_connections = max(300, self.sizes["postgres_max_connections"])
            self.postgres = ScratchPostgres(
                self.dir / "pg", settings={"max_connections": str(max_connections)}
            )
            self.postgres.start()
        admin = urlsplit(self.postgres_dsn)
        asyncio.run(_migrate(self.postgres_dsn))
        self.pgbouncer = PgBouncer(
            admin.hostname or "127.0.0.1",
            admin.port or 5432,
            default_pool_size=self.sizes["pgbouncer_default_pool_size"],
            reserve_pool_size=self.sizes["pgbouncer_reserve_pool_size"],
            max_client_conn=self.sizes["pgbouncer_max_client_conn"],
            dir=self.dir / "pgbouncer",
            upstream_user=admin.username or SUPERUSER,
            upstream_password=admin.password,
        )
        self.pgbouncer.start()
        dbname = admin.path.lstrip("/") or "postgres"
        env = {
            "DATABASE_URL": self._pooled_url(dbname),
            # LISTEN needs a session of its own: straight to PostgreSQL, not via PgBouncer.
            "DATABASE_DIRECT_URL": self.postgres_dsn,
            "DB_POOL_MAX_SIZE": str(self.pool_per_instance),
            "CRON_SECRET": self._secret(),
            **self.env,
        }
        for number in range(1, self.count + 1):
            name = f"i{number}"
            instance = Instance(
                name, env, dir=self.dir / "instances" / name, app_factory=self.app_factory
            )
            self.instances.append(instance)
        for instance in self.instances:
            instance.start()
        self.nginx = Nginx(
            [i.address for i in self.instances],
            dir=self.dir / "nginx",
            listen_port=self.nginx_port,
            worker_connections=self.sizes["nginx_worker_connections"],
            keepalive=self.sizes["nginx_keepalive"],
        )
        self.nginx.start()

    def _pooled_url(self, dbname: str) -> str:
        assert self.pgbouncer is not None
        admin = urlsplit(self.postgres_dsn)
        user = quote(admin.username or SUPERUSER, safe="")
        password = f":{quote(admin.password, safe='')}" if admin.password else ""
        return f"postgresql://{user}{password}@127.0.0.1:{self.pgbouncer.port}/{dbname}"

    def _secret(self) -> str:
        """CRON_SECRET from the environment, else one kept in `<dir>/cron_secret` (0600)."""
        given = self.env.get("CRON_SECRET") or os.environ.get("CRON_SECRET")
        if given:
            return given
        path = self.secret_path
        self.secret_source = str(path)
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
        return path.read_text().strip()

    @property
    def secret_path(self) -> Path:
        return self.dir / "cron_secret"

    def services(self) -> list[Service]:
        found: list[Service] = []
        if self.pgbouncer is not None:
            found.append(self.pgbouncer)
        found.extend(self.instances)
        if self.nginx is not None:
            found.append(self.nginx)
        return found

    def stop(self) -> None:
        """Front to back: nginx, instances (graceful), PgBouncer, then PostgreSQL."""
        if self.nginx is not None:
            self.nginx.stop()
        for instance in self.instances:
            instance.signal(signal.SIGCONT)
            instance.signal(signal.SIGTERM)
        for instance in self.instances:
            instance.stop()
        if self.pgbouncer is not None:
            self.pgbouncer.stop()
        if self.postgres is not None:
            self.postgres.stop()

    def describe(self) -> str:
        assert self.nginx is not None
        assert self.pgbouncer is not None
        header = (
            f'-H "Authorization: Bearer $(cat {self.secret_path})"'
            if self.secret_source != "CRON_SECRET"
            else '-H "Authorization: Bearer $CRON_SECRET"'
        )
        lines = [
            f"nginx      {self.nginx.url}",
            *(f"{i.name:<10} {i.url}  (log {i.output_path})" for i in self.instances),
            f"pgbouncer  {self.pgbouncer.dsn()}",
            f"postgres   {_redact(self.postgres_dsn)}",
            f"secret     {self.secret_source}",
            "",
            "try:",
            f"  curl -sS {header} {self.nginx.url}/cron/jobs",
            f"  curl -sS -X POST {header} {self.nginx.url}/cron/<job>",
        ]
        return "\n".join(lines)


def _redact(dsn: str) -> str:
    parts = urlsplit(dsn)
    if parts.password:
        return dsn.replace(f":{parts.password}@", ":***@", 1)
    return dsn


async def _migrate(dsn: str) -> None:
    from cronlock.db.pool import connect
    from cronlock.db.schema import migrate, migration_sets
    from cronlock.settings import Settings

    settings = Settings(database_url=dsn)
    conn = await connect(settings, dsn)
    try:
        await migrate(conn, settings.db_schema, migration_sets(settings.job_modules))
    finally:
        await conn.close()


# --- the command line -----------------------------------------------------------------------


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/cluster",
        description="Run PostgreSQL + PgBouncer + N instances + nginx on 127.0.0.1.",
    )
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--pool-per-instance", type=int, default=10)
    parser.add_argument("--dir", type=Path, default=Path("var/cluster"))
    parser.add_argument("--port", type=int, default=None, help="nginx port (default: a free one)")
    parser.add_argument(
        "--database-url",
        default=None,
        help="use this PostgreSQL instead of a local one (default: $DATABASE_URL, else local)",
    )
    args = parser.parse_args(argv)
    cluster = Cluster(
        args.dir,
        instances=args.instances,
        pool_per_instance=args.pool_per_instance,
        database_url=args.database_url or os.environ.get("DATABASE_URL") or None,
        nginx_port=args.port,
    )
    signal.signal(signal.SIGTERM, _raise_exit)
    try:
        cluster.start()
        print(cluster.describe(), flush=True)
        print("\nCtrl-C stops everything.", flush=True)
        return _watch(cluster)
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


def _watch(cluster: Cluster) -> int:
    """Until interrupted; an infrastructure process dying ends the run with its log."""
    reported: set[str] = set()
    while True:
        time.sleep(0.5)
        for service in cluster.services():
            if service.is_alive() or service.name in reported:
                continue
            reported.add(service.name)
            print(f"\n{service.name} died:\n{service.log_tail()}", file=sys.stderr, flush=True)
            if not isinstance(service, Instance):
                return 1


if __name__ == "__main__":
    raise SystemExit(main())
