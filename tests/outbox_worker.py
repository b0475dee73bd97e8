"""A dedicated sender process for the tests: `python -m tests.outbox_worker [--once]`.

Settings come from the environment only (never a stray `.env`), like `python -m cronlock outbox
drain` in production; SIGTERM stops it gracefully.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType


def _stopped_early(signum: int, frame: FrameType | None) -> None:
    # A SIGTERM before the sender installs its own handler (a slow machine still importing):
    # nothing is claimed yet, so stopping here is as graceful as stopping later.
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    import asyncio

    from cronlock import logs
    from cronlock.delivery import sender
    from cronlock.settings import Settings

    settings = Settings(_env_file=None)
    logs.setup("json", settings.log_level)
    asyncio.run(sender.run_sender(settings, once="--once" in argv))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stopped_early)
    raise SystemExit(main(sys.argv[1:]))
