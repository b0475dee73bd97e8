"""A dedicated sender process for the tests: `python -m tests.outbox_worker [--once]`.

Settings come from the environment only (never a stray `.env`), like `python -m cronlock outbox
drain` in production; SIGTERM stops it gracefully.
"""

from __future__ import annotations

import asyncio
import sys

from cronlock import logs
from cronlock.delivery import sender
from cronlock.settings import Settings


def main(argv: list[str]) -> int:
    settings = Settings(_env_file=None)
    logs.setup("json", settings.log_level)
    asyncio.run(sender.run_sender(settings, once="--once" in argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
