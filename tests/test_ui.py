"""The dashboard in-process (httpx against the ASGI app): sessions, safety, pages, actions."""

from __future__ import annotations

import re

import httpx

from tests.support import TEST_SECRET
from tests.support.asgi import StartApp

READ_TOKEN = "cronlock-read-token-0123456789-abcdefghijklmnop"


async def login(client: httpx.AsyncClient, url: str, token: str) -> httpx.Response:
    page = await client.get(f"{url}/ui/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf is not None
    return await client.post(f"{url}/ui/login", data={"csrf": csrf.group(1), "token": token})


async def test_smoke(start_app: StartApp, client: httpx.AsyncClient) -> None:
    app = await start_app(cron_read_token=READ_TOKEN, ui_cookie_secure=False)
    r = await login(client, app.url, TEST_SECRET)
    print(r.status_code, r.headers)
    for path in ["/ui/", "/ui/jobs/fast", "/ui/locks", "/ui/outbox"]:
        r = await client.get(app.url + path)
        print(path, r.status_code, r.text[:3000] if r.status_code != 200 else "")
        assert r.status_code == 200
    r = await client.get(app.url + "/ui/")
    csrf = re.search(r'name="csrf" value="([^"]+)"', r.text).group(1)
    r = await client.post(app.url + "/ui/jobs/fast/run", data={"csrf": csrf})
    print(r.status_code, r.headers.get("location"))
    r = await client.get(app.url + r.headers["location"])
    print(r.status_code, r.text[-2000:])
