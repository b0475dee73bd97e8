"""Real uvicorn instances of the app for the tests, on one database (tests/conftest.py's
`start_instance`, or a module's instances started once for all its tests)."""

from __future__ import annotations

import concurrent.futures
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.support import TEST_SECRET
from tests.support.cluster import Instance

INSTANCE_STOP_GRACE = 5.0


class Instances:
    """Real uvicorn processes on one database, each returned once ready (GET /readyz = 200 on
    that database: the service has seen it migrated, so the first request is not a 503; or
    GET /healthz = 200 when `env` points DATABASE_URL elsewhere: a server that may be down,
    a standby...), all stopped together."""

    def __init__(self, database_url: str, dir: Path, started: list[Any] | None = None) -> None:
        self.database_url = database_url
        self.dir = dir
        self.started: list[Instance] = []
        self.reported = started if started is not None else []

    def start(self, name: str = "i1", env: dict[str, str] | None = None, **kw: Any) -> Instance:
        full_env = {
            "DATABASE_URL": self.database_url,
            "CRON_SECRET": TEST_SECRET,
            "CRON_JOBS": "tests.jobs",
            "OUTBOX_ENABLED": "false",
            **(env or {}),
        }
        kw.setdefault("dir", self.dir / name)
        own_database = full_env["DATABASE_URL"] == self.database_url
        kw.setdefault("ready_path", "/readyz" if own_database else "/healthz")
        instance = Instance(name, full_env, **kw)
        self.started.append(instance)
        self.reported.append(instance)
        instance.start()
        return instance

    def start_many(
        self, names: Iterable[str], env: dict[str, str] | None = None, **kw: Any
    ) -> list[Instance]:
        """Several at once: each boots (imports, connects) while the others do."""
        names = list(names)
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            return list(pool.map(lambda name: self.start(name, env, **kw), names))

    def stop(self) -> None:
        for instance in self.started:
            instance.signal(signal.SIGTERM)  # all at once, then wait for each
        for instance in self.started:
            instance.stop(INSTANCE_STOP_GRACE)
