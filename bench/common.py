"""What the bench scripts share: a PostgreSQL of their own, app instances pinned to a core, wrk
with the secret kept out of argv, tables, and the facts about the machine.

Not a benchmark itself (and never collected by pytest: testpaths is tests/ only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from cronlock.cli.embedded import LocalPostgres
from tests.support.cluster import REPO_ROOT, Instance

BENCH_DIR = Path(__file__).resolve().parent
# The bench jobs live next to the scripts; instances import them from the repo root.
BENCH_JOBS = "bench.jobs"


# --- PostgreSQL -----------------------------------------------------------------------------


@dataclass
class Server:
    """The bench's PostgreSQL: one started here (`local`), or DATABASE_URL's server."""

    admin_dsn: str
    local: LocalPostgres | None
    created: list[str] = field(default_factory=list)

    def dsn(self, dbname: str) -> str:
        parts = urlsplit(self.admin_dsn)
        return urlunsplit(parts._replace(path=f"/{dbname}"))

    @property
    def postmaster_pid(self) -> int | None:
        return self.local.postmaster_pid() if self.local is not None else None


@contextlib.contextmanager
def postgres(settings: dict[str, str] | None = None) -> Iterator[Server]:
    """A throwaway local server in a temp dir with `settings`, or DATABASE_URL's server (whose
    settings are what they are; the databases created on it are dropped at the end)."""
    url = os.environ.get("DATABASE_URL")
    if url:
        server = Server(url, None)
        try:
            yield server
        finally:
            for name in server.created:
                with contextlib.suppress(Exception):
                    asyncio.run(drop_database(server, name))
        return
    root = Path(tempfile.mkdtemp(prefix="cronlock-bench-"))
    local = LocalPostgres(root / "pg", settings=settings)
    try:
        local.start()
        yield Server(local.dsn("postgres"), local)
    finally:
        local.stop("fast")
        shutil.rmtree(root, ignore_errors=True)


async def create_database(server: Server, *, template: str | None = None) -> str:
    """A new database (migrated when no template is given); its name."""
    from cronlock.db.schema import migrate, migration_sets

    name = f"bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(server.admin_dsn, statement_cache_size=0)
    try:
        if template is None:
            await conn.execute(f'CREATE DATABASE "{name}"')
        else:
            # FILE_COPY: a checkpoint and a copy of the files, not the whole database through
            # the WAL (PostgreSQL 15's default), so each clone is quick and starts equal.
            strategy = " STRATEGY FILE_COPY" if conn.get_server_version().major >= 15 else ""
            await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"{strategy}')
    finally:
        await conn.close()
    server.created.append(name)
    if template is None:
        conn = await asyncpg.connect(server.dsn(name), statement_cache_size=0)
        try:
            await migrate(conn, "cronlock", migration_sets(["cronlock.demo.digest"]))
        finally:
            await conn.close()
    return name


async def drop_database(server: Server, name: str) -> None:
    conn = await asyncpg.connect(server.admin_dsn, statement_cache_size=0)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()
    with contextlib.suppress(ValueError):
        server.created.remove(name)


def pin(pid: int, cpus: str) -> None:
    """Pin a process and its current children (a postmaster's backends) to `cpus`; children
    forked later inherit the affinity."""
    from tests.support.postgres import children_of

    for target in (pid, *children_of(pid)):
        subprocess.run(
            ["taskset", "-a", "-p", "-c", cpus, str(target)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )


# --- app instances --------------------------------------------------------------------------


BENCH_APP = "bench.app:create_app"


def new_secret() -> str:
    """A fresh cron secret for this run; it travels in environments and 0600 files only."""
    return secrets.token_urlsafe(32)


class PinnedInstance(Instance):
    """An app instance whose uvicorn runs under `taskset -c <cpus>` (taskset execs it, so the
    pid is uvicorn's)."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        *,
        cpus: str | None,
        dir: Path,
        app_factory: str = BENCH_APP,
    ) -> None:
        # By default the service plus bench/app.py's two baseline routes.
        super().__init__(name, env, dir=dir, ready_path="/readyz", app_factory=app_factory)
        self.cpus = cpus

    def command(self) -> list[str]:
        base = super().command()
        return ["taskset", "-c", self.cpus, *base] if self.cpus is not None else base


def instance_env(dsn: str, secret: str, jobs: str = BENCH_JOBS, **extra: str) -> dict[str, str]:
    return {
        "DATABASE_URL": dsn,
        "CRON_SECRET": secret,
        "CRON_JOBS": jobs,
        "OUTBOX_ENABLED": "false",
        "LOG_FORMAT": "json",
        **extra,
    }


def peak_rss_kib(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of a process in KiB: its peak and current resident memory."""
    found: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            found[key] = int(value.split()[0])
    return found["VmHWM"], found["VmRSS"]


# --- wrk ------------------------------------------------------------------------------------

PERCENTILES = (50.0, 75.0, 90.0, 99.0, 99.9)

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Authorization"] = "Bearer {secret}"
-- Requests rotate over these paths (one request built per path, once per thread).
local paths = {{{paths}}}
local prepared = {{}}
local sent = 0
init = function(args)
  for i, path in ipairs(paths) do
    prepared[i] = wrk.format(nil, path)
  end
end
request = function()
  sent = sent + 1
  return prepared[(sent % #prepared) + 1]
end
done = function(summary, latency, requests)
  io.write(string.format(
    "WRK requests=%d duration_us=%d status=%d connect=%d read=%d write=%d timeout=%d\\n",
    summary.requests, summary.duration, summary.errors.status, summary.errors.connect,
    summary.errors.read, summary.errors.write, summary.errors.timeout))
  for _, p in ipairs({{{percentiles}}}) do
    io.write(string.format("PCT %g %d\\n", p, latency:percentile(p)))
  end
end
"""


@dataclass
class WrkResult:
    requests: int
    seconds: float
    errors: int
    percentiles_ms: dict[float, float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@contextlib.contextmanager
def wrk_script(secret: str, paths: Sequence[str]) -> Iterator[Path]:
    """A wrk Lua script that POSTs to `paths` in turn, carrying the Authorization header, in a
    0600 file removed afterwards (the secret never appears in a process's argv)."""
    folder = Path(tempfile.mkdtemp(prefix="cronlock-wrk-"))
    path = folder / "post.lua"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            WRK_SCRIPT.format(
                secret=secret,
                paths=", ".join(json.dumps(p) for p in paths),
                percentiles=", ".join(f"{p:g}" for p in PERCENTILES),
            )
        )
    try:
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def wrk(
    url: str, script: Path, *, seconds: float, connections: int, cpus: str | None = "0"
) -> WrkResult:
    """One bounded wrk run (one thread) against `url`, pinned to `cpus`."""
    args = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "5s"]
    args += ["-s", str(script), url]
    if cpus is not None:
        args = ["taskset", "-c", cpus, *args]
    process = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        raw, _ = await asyncio.wait_for(process.communicate(), seconds + 30)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    out = raw.decode(errors="replace")
    summary = re.search(r"^WRK (.*)$", out, re.M)
    if process.returncode != 0 or summary is None:
        raise RuntimeError(f"wrk failed ({process.returncode}):\n{out}")
    fields = dict(kv.split("=") for kv in summary.group(1).split())
    percentiles = {
        float(m.group(1)): int(m.group(2)) / 1000
        for m in re.finditer(r"^PCT (\S+) (\d+)$", out, re.M)
    }
    errors = sum(int(fields[k]) for k in ("status", "connect", "read", "write", "timeout"))
    return WrkResult(int(fields["requests"]), int(fields["duration_us"]) / 1e6, errors, percentiles)


# --- output ---------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (readable in a terminal too), numbers right-aligned."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if num else ("-" * (w + 2))
            for w, num in zip(widths, numeric, strict=True)
        )
        + "|"
    )
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value >= 100:
            return f"{value:,.0f}"
        if value >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(data, indent=2, default=str))


# --- the machine ----------------------------------------------------------------------------


def machine(pg_version: str | None = None) -> dict[str, str]:
    """nproc, CPU model, RAM, kernel, Python and (if given) PostgreSQL versions."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = "unknown"
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    facts = {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "ram": ram,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    if pg_version is not None:
        facts["postgresql"] = pg_version
    return facts


async def server_version(dsn: str) -> str:
    conn = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        version: str = await conn.fetchval("SHOW server_version")
        return version
    finally:
        await conn.close()


def stats(values: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    ordered = sorted(values)
    n = len(ordered)
    mid = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return ordered[0], mid, ordered[-1]


def repo_root() -> Path:
    return REPO_ROOT


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start
