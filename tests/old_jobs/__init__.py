"""A job module written for 0.1, which shipped the library as `app`: it must not start, and
the one line must say where the names went (tests/test_embedding.py)."""

from app.jobs import JobContext, job  # type: ignore[import-not-found]  # gone since 0.2


@job("old-style")  # type: ignore[untyped-decorator]  # its import is gone
async def old_style(ctx: JobContext) -> None:
    return None
