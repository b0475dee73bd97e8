"""A real local HTTP server receiving cronlock's alerts (webhooks and pings), for the tests.

Served from an asyncio loop in a thread of its own, like tests/support/provider.py. It records
every request (path, headers, body), counts deliveries per `webhook-id` and accepts each id
once, as a receiver that deduplicates does (a repeat is answered 200 and not accepted again).
`down()` stops listening (connections are refused), `up()` listens again on the same port;
`hold()` keeps answers back (the request has arrived and is accepted, the sender waits), so a
test can kill a sender mid-send.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.lock = threading.Lock()
        self.received: list[Received] = []
        self.accepted: set[str] = set()
        self.deliveries: Counter[str] = Counter()
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.Server | None = None
        self.open: set[asyncio.StreamWriter] = set()
        self.closing = False
        self.released = asyncio.Event()
        self.loop.call_soon_threadsafe(self.released.set)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)  # type: ignore[arg-type]

    def up(self) -> None:
        async def start() -> None:
            self.server = await asyncio.start_server(
                self._connection, "127.0.0.1", self.port, reuse_address=True
            )

        self._call(start())

    def down(self) -> None:
        async def stop() -> None:
            if self.server is not None:
                self.server.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.server.wait_closed(), 2)
                self.server = None

        self._call(stop())

    def hold(self) -> None:
        self.loop.call_soon_threadsafe(self.released.clear)

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.released.set)

    def close(self) -> None:
        async def finish() -> None:
            # Server.close (Python 3.11) leaves accepted connections open: a handler still
            # reading one would be collected after the loop closed (an unraisable "Event loop
            # is closed" at the test's teardown). Closing its transport ends its read and the
            # handler returns normally (a held one is released first); one accepted but not
            # yet started sees `closing` and returns at once.
            self.closing = True
            if self.server is not None:
                self.server.close()
            self.released.set()
            for writer in list(self.open):
                writer.close()
            others = asyncio.all_tasks() - {asyncio.current_task()}
            await asyncio.gather(*others, return_exceptions=True)
            if self.server is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.server.wait_closed(), 2)
                self.server = None

        self._call(finish())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def requests(self) -> list[Received]:
        with self.lock:
            return list(self.received)

    def wait(self, predicate: Callable[[Receiver], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"receiver: {what} not within {timeout} s")
            time.sleep(0.05)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.closing:
            writer.close()
            return
        self.open.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            msg_id = headers.get("webhook-id")
            with self.lock:
                self.received.append(Received(path, headers, body))
                if msg_id is not None:
                    self.deliveries[msg_id] += 1
                    self.accepted.add(msg_id)
            await self.released.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, IndexError, ValueError):
            pass
        finally:
            writer.close()
            self.open.discard(writer)
