"""A real HA cluster on loopback: etcd (Debian's etcd-server, 3.4: v3 API only) and two
Patroni nodes (from PyPI, its `etcd3` section), each managing a PostgreSQL 15 server.

Patroni's shortest `ttl` is 20 s: a hard failover (Patroni and its PostgreSQL killed
together; killing PostgreSQL alone makes Patroni restart it in place) takes that long before
the replica may take the leader key. `loop_wait` is 1 s so that everything else (a
switchover, a node rejoining) takes a second or two.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from cronlock.cli.embedded import (
    SUPERUSER,
    as_service_user,
    chown_to_service,
    find_bindir,
    free_port,
    pid_alive,
    prepare_dir,
    tail,
    wait_gone,
)
from tests.support.cluster import Service
from tests.support.postgres import children_of

SCOPE = "cronlock-test"
TTL = 20
LOOP_WAIT = 1
RETRY_TIMEOUT = 5


def interpreter() -> list[str]:
    """A Python the service user can run (Patroni runs as `postgres` when we are root, as
    PostgreSQL must): this one, unless it lives where that user cannot reach (a pyenv under
    /root), then the system's of the same version, which reads our packages (PYTHONPATH).
    That one runs with `-S`: without its own site-packages, whose Debian packages (pyOpenSSL
    23, built for Debian's cryptography 38) would meet ours (a newer cryptography, which
    google-auth brings) and fail at import inside python-etcd."""
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if (
        os.geteuid() == 0
        and not str(Path(sys.executable).resolve()).startswith("/usr/")
        and (system.is_file())
    ):
        return [str(system), "-S"]
    return [sys.executable]


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def available() -> str | None:
    """Why the cluster cannot run here, or None."""
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian: apt-get install etcd-server)"
    if importlib.util.find_spec("patroni") is None:
        return "patroni is not installed (pip install -e '.[dev]')"
    if find_bindir() is None:
        return "no PostgreSQL server binaries"
    # Patroni runs as the service user: it must reach an interpreter and our packages.
    probe = subprocess.run(
        [*interpreter(), "-c", "import patroni, psycopg, yaml"],
        env=patroni_env(Path(tempfile.gettempdir())),
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        **as_service_user(),
    )
    if probe.returncode != 0:
        return f"Patroni cannot run as the service user here: {probe.stderr.strip()[-300:]}"
    return None


def patroni_env(home: Path) -> dict[str, str]:
    return {
        # Not measured (it never imports `app`), and PYTHONPATH finds our packages.
        **{k: v for k, v in os.environ.items() if not k.startswith("COVERAGE")},
        "PYTHONPATH": site_packages(),
        "HOME": str(home),
    }


class Etcd:
    """One etcd member, its data and log in `dir`, on loopback ports of its own."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.client_port}"
        args = ["etcd", "--name", "e1", "--data-dir", str(self.dir / "data")]
        args += ["--listen-client-urls", client, "--advertise-client-urls", client]
        args += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
        args += ["--initial-cluster", f"e1={peer}", "--initial-cluster-state", "new"]
        # Quick elections on one member; nothing to wait for.
        args += ["--heartbeat-interval", "100", "--election-timeout", "1000"]
        with (self.dir / "etcd.log").open("ab") as log:
            self._process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{client}/health", timeout=1).json().get("health") == "true":
                    return
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"etcd did not start:\n{tail(self.dir / 'etcd.log', 30)}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(10)
            self._process = None


@dataclass
class Member:
    name: str
    role: str  # leader, replica, sync_standby, standby_leader
    state: str  # running, streaming, stopped, starting...
    timeline: int | None
    port: int


class Node:
    """One Patroni process and the PostgreSQL it manages."""

    def __init__(self, name: str, dir: Path, etcd: Etcd, parameters: dict[str, str]) -> None:
        self.name = name
        self.dir = dir
        self.etcd = etcd
        self.pg_port = free_port()
        self.api_port = free_port()
        self.parameters = parameters
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def log_path(self) -> Path:
        return self.dir / "patroni.log"

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.pg_port}/{dbname}"

    def config(self) -> dict[str, Any]:
        bindir = find_bindir()
        assert bindir is not None
        trust = "127.0.0.1/32 trust"
        return {
            "scope": SCOPE,
            "name": self.name,
            "restapi": {
                "listen": f"127.0.0.1:{self.api_port}",
                "connect_address": f"127.0.0.1:{self.api_port}",
            },
            "etcd3": {"hosts": [self.etcd.endpoint]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 64 * 1024 * 1024,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            # pg_rewind needs hint bits WAL-logged and full page writes.
                            "wal_log_hints": "on",
                            "wal_keep_size": "256MB",
                            "max_connections": "200",
                            "fsync": "off",
                            **self.parameters,
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
                "pg_hba": [f"host replication replicator {trust}", f"host all all {trust}"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port}",
                "connect_address": f"127.0.0.1:{self.pg_port}",
                "data_dir": str(self.data_dir),
                "bin_dir": str(bindir),
                "pgpass": str(self.dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": "unused"},
                    "replication": {"username": "replicator", "password": "unused"},
                },
                "parameters": {"unix_socket_directories": str(self.dir)},
                # A node that cannot rewind after a hard failover clones the leader afresh.
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
        }

    def start(self) -> None:
        prepare_dir(self.dir.parent, mode=0o755, own=False)
        prepare_dir(self.dir)
        path = self.dir / "patroni.yml"
        path.write_text(yaml.safe_dump(self.config()))
        chown_to_service(path)
        with self.log_path.open("ab") as log:
            chown_to_service(self.log_path)
            self._process = subprocess.Popen(
                [*interpreter(), "-m", "patroni", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                start_new_session=True,
                env=patroni_env(self.dir),
                **as_service_user(),
            )

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, IndexError, ValueError):
            return int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
        return None

    def kill(self) -> None:
        """A hard failure: Patroni and its PostgreSQL (postmaster and backends) SIGKILLed at
        once, as when the machine dies."""
        pids = []
        if self._process is not None:
            pids.append(self._process.pid)
        pg = self.postmaster_pid()
        if pg is not None and pid_alive(pg):
            pids += [pg, *children_of(pg)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._process is not None:
            self._process.wait(10)
            self._process = None
        if wait_gone(pids, timeout=15.0):
            raise AssertionError(f"processes of the killed node {self.name} survive")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()  # Patroni stops its PostgreSQL (fast) on SIGTERM
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._process = None
        pg = self.postmaster_pid()
        if pg is not None and pid_alive(pg):
            os.kill(pg, signal.SIGQUIT)
            wait_gone([pg], timeout=10.0)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)


class PatroniCluster:
    """etcd and two Patroni nodes; `leader()`, `switchover()`, `fail()` and `heal()`."""

    def __init__(self, root: Path, parameters: dict[str, str] | None = None) -> None:
        self.root = root
        self.etcd = Etcd(root / "etcd")
        self.nodes = [Node(f"n{i}", root / f"n{i}", self.etcd, parameters or {}) for i in (1, 2)]

    def start(self) -> None:
        self.etcd.start()
        first, second = self.nodes
        first.start()
        self.wait(lambda ms: any(m.role == "leader" and m.state == "running" for m in ms), 60)
        second.start()
        self.wait_healthy(90)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.etcd.stop()

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def members(self) -> list[Member]:
        for node in self.nodes:
            if not node.is_alive():
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError):
                found = httpx.get(f"{node.api}/cluster", timeout=2).json()
                return [
                    Member(
                        m["name"],
                        m["role"],
                        m["state"],
                        m.get("timeline"),
                        int(m["port"]),
                    )
                    for m in found.get("members", [])
                ]
        return []

    def wait(self, ok: Any, timeout: float, what: str = "the cluster") -> list[Member]:
        deadline = time.monotonic() + timeout
        while True:
            members = self.members()
            if ok(members):
                return members
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n.name}\n{n.log_tail(30)}" for n in self.nodes)
                raise AssertionError(f"{what} not reached in {timeout} s: {members}\n{logs}")
            time.sleep(0.2)

    def wait_healthy(self, timeout: float = 60) -> list[Member]:
        """A running leader and a streaming replica on the leader's timeline."""

        def ok(members: list[Member]) -> bool:
            leaders = [m for m in members if m.role == "leader" and m.state == "running"]
            replicas = [m for m in members if m.role != "leader" and m.state == "streaming"]
            return (
                len(leaders) == 1
                and len(replicas) == 1
                and replicas[0].timeline == leaders[0].timeline
            )

        return self.wait(ok, timeout, "a leader and a streaming replica")

    def leader(self) -> Node:
        members = self.wait(lambda ms: any(m.role == "leader" for m in ms), 60, "a leader")
        return self.node(next(m.name for m in members if m.role == "leader"))

    def replica(self) -> Node:
        leader = self.leader()
        return next(n for n in self.nodes if n is not leader)

    def timeline(self) -> int:
        members = self.members()
        found = next(m.timeline for m in members if m.role == "leader")
        assert found is not None
        return found

    def switchover(self) -> Node:
        """A planned switchover to the replica; returns the new leader once it runs."""
        leader, candidate = self.leader(), self.replica()
        answer = httpx.post(
            f"{leader.api}/switchover",
            content=json.dumps({"leader": leader.name, "candidate": candidate.name}),
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        self.wait(
            lambda ms: any(
                m.name == candidate.name and m.role == "leader" and m.state == "running" for m in ms
            ),
            60,
            f"{candidate.name} leading",
        )
        return candidate

    def fail(self) -> tuple[Node, Node]:
        """Kill the leader (Patroni and PostgreSQL together); returns (old, new) once the
        replica has taken over (after the leader key's ttl)."""
        old, new = self.leader(), self.replica()
        old.kill()
        self.wait(
            lambda ms: any(
                m.name == new.name and m.role == "leader" and m.state == "running" for m in ms
            ),
            TTL + 30,
            f"{new.name} leading after {old.name} was killed",
        )
        return old, new

    def heal(self) -> None:
        """Restart every node that is down and wait until the pair is whole again."""
        for node in self.nodes:
            if not node.is_alive():
                node.start()
        self.wait_healthy(90)

    def patch_config(self, change: dict[str, Any]) -> None:
        """Change the cluster's dynamic configuration (PATCH /config), e.g. synchronous_mode."""
        answer = httpx.patch(f"{self.leader().api}/config", json=change, timeout=10)
        assert answer.status_code == 200, answer.text

    def url(self, dbname: str, **query: str) -> str:
        """A multi-host URL listing both nodes, following the primary (read-write)."""
        hosts = ",".join(f"127.0.0.1:{n.pg_port}" for n in self.nodes)
        params = "&".join(
            f"{k}={v}" for k, v in {"target_session_attrs": "read-write", **query}.items()
        )
        return f"postgresql://{SUPERUSER}@{hosts}/{dbname}?{params}"


class HAProxy(Service):
    """HAProxy in front of the Patroni nodes, sending connections only to the one whose
    Patroni answers 200 on `GET /primary`: docs/deploying.md's pooled shape, where PgBouncer
    (which has no target_session_attrs) points at this port."""

    name = "haproxy"

    def __init__(self, nodes: list[Node], *, dir: Path) -> None:
        super().__init__(dir, None)
        self.nodes = nodes

    def configure(self) -> None:
        servers = "\n".join(
            f"    server {n.name} 127.0.0.1:{n.pg_port} check port {n.api_port}" for n in self.nodes
        )
        config = f"""\
global
    maxconn 1000

defaults
    mode tcp
    timeout connect 2s
    timeout client 30m
    timeout server 30m
    timeout check 2s

listen postgres_primary
    bind 127.0.0.1:{self.port}
    option httpchk GET /primary
    http-check expect status 200
    default-server inter 1s fall 2 rise 2 on-marked-down shutdown-sessions
{servers}
"""
        path = self.dir / "haproxy.cfg"
        path.write_text(config)
        chown_to_service(path)

    def command(self) -> list[str]:
        # -db: in the foreground, no daemon; the configuration is relative to self.dir.
        return ["haproxy", "-db", "-f", "haproxy.cfg"]

    def is_ready(self) -> bool:
        # Listening is not enough: a leader must be marked up behind it.
        if not super().is_ready():
            return False
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.settimeout(1)
                # A PostgreSQL SSLRequest: a server answers one byte ('N' or 'S'); HAProxy
                # with no server up closes the connection instead.
                sock.sendall(struct.pack("!ii", 8, 80877103))
                return sock.recv(1) in (b"N", b"S")
        except OSError:
            return False
