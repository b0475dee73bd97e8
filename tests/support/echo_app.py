"""A tiny ASGI app for testing the process plumbing (Instance, nginx) without the real service.

`GET /healthz` answers 200; every other request echoes what the instance saw, as JSON.
"""

from __future__ import annotations

import json
import os

from starlette.types import ASGIApp, Receive, Scope, Send


def create_app() -> ASGIApp:
    instance = os.environ.get("INSTANCE_NAME", "")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        payload = {
            "instance": instance,
            "pid": os.getpid(),
            "method": scope["method"],
            "path": scope["path"],
            "authorization": headers.get("authorization"),
            "body": body.decode(errors="replace"),
        }
        data = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    return app
