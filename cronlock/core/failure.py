"""What a failed run raised, as stored with its row, answered and logged: the exception's
type, message and traceback, bounded in size, with the settings' secrets hidden."""

from __future__ import annotations

import traceback
from typing import Any

from cronlock.settings import scrub

MAX_MESSAGE = 2000
# The end of a traceback says where it failed: a long one keeps its last characters.
MAX_TRACEBACK = 16000


def type_name(exc: BaseException) -> str:
    kind = type(exc)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def failure_of(exc: BaseException, secrets: list[str]) -> dict[str, Any]:
    """`{"type", "message", "traceback"}` of `exc` (its causes included), secrets scrubbed
    before the text is cut, so no part of one survives at a cut."""
    message = scrub(str(exc), secrets)
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + f"... ({len(message) - MAX_MESSAGE} characters more)"
    text = scrub("".join(traceback.format_exception(exc)), secrets)
    if len(text) > MAX_TRACEBACK:
        cut = len(text) - MAX_TRACEBACK
        text = f"... ({cut} characters left out)\n" + text[cut:]
    return {"type": type_name(exc), "message": message, "traceback": text}
