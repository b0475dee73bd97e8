"""A dashboard user for the in-process tests: its own cookies, logged in with one token."""

from __future__ import annotations

import re
from types import TracebackType

import httpx

from tests.support.asgi import InProcess

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
# Long enough for Settings.check_secrets; the read token of the dashboard tests.
READ_TOKEN = "cronlock-read-token-0123456789-abcdefghijklmnop"


def csrf_of(html: str) -> str:
    found = CSRF.search(html)
    assert found is not None, "no CSRF token on the page"
    return found.group(1)


class User:
    """One browser's worth of cookies against one in-process app."""

    def __init__(self, app: InProcess) -> None:
        self.http = httpx.AsyncClient(transport=app.transport, base_url=app.url)

    async def __aenter__(self) -> User:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.http.aclose()

    async def login(self, token: str) -> httpx.Response:
        page = await self.http.get("/ui/login")
        return await self.http.post("/ui/login", data={"csrf": csrf_of(page.text), "token": token})

    async def csrf(self, path: str = "/ui/") -> str:
        return csrf_of((await self.http.get(path)).text)

    async def act(self, path: str, **fields: str) -> httpx.Response:
        """A form post with the session's CSRF token."""
        return await self.http.post(path, data={"csrf": await self.csrf(), **fields})
