"""Logging: one structured line per event; JSON in production, key=value in a terminal.

Fields come from `extra=`; secrets never reach a log call (tokens are compared, not logged).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and v is not None}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        fields = _fields(record)
        # A failed run's traceback (cronlock/core/failure.py) reads as one below its line.
        traceback = fields.pop("traceback", None)
        extras = " ".join(f"{k}={v}" for k, v in fields.items())
        line = f"{stamp} {record.levelname:<7} {record.getMessage()}"
        if extras:
            line += f"  {extras}"
        if traceback:
            line += "\n" + str(traceback).rstrip("\n")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(fmt: str = "auto", level: str = "INFO") -> None:
    """Configure the root logger once; `auto` is text on a terminal, JSON otherwise."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_cronlock", False):
            root.removeHandler(old)
    handler._cronlock = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
