"""cronlock: scheduled jobs that run exactly once across instances sharing one PostgreSQL
primary. The public API is what `__all__` names; every other module is internal and may move.

In an app of your own (docs/fastapi.md):

    cron = Cronlock()

    @cron.job("daily-digest", schedule="0 7 * * *", tz="Europe/Berlin")
    async def daily_digest(ctx: JobContext) -> int: ...

    app = FastAPI(lifespan=cron.lifespan)
    app.include_router(cron.router)
"""

from cronlock.core.fanout import DoneContext, ItemContext
from cronlock.core.jobs import JobContext, job
from cronlock.db.helper import JobLock, job_lock
from cronlock.errors import (
    ConfigurationError,
    CronlockError,
    InvalidSchedule,
    JobDefinitionError,
    LeaseLost,
    RunCancelled,
    TransactionRequired,
)
from cronlock.instance import Cronlock, Readiness
from cronlock.settings import Settings, SettingsError
from cronlock.version import __version__

__all__ = [
    "ConfigurationError",
    "Cronlock",
    "CronlockError",
    "DoneContext",
    "InvalidSchedule",
    "ItemContext",
    "JobContext",
    "JobDefinitionError",
    "JobLock",
    "LeaseLost",
    "Readiness",
    "RunCancelled",
    "Settings",
    "SettingsError",
    "TransactionRequired",
    "__version__",
    "job",
    "job_lock",
]
