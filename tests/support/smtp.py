"""A tiny real SMTP relay that answers slowly: a tarpit, to test that a send's timeout bounds
the whole send and not each step.

It speaks just enough SMTP for smtplib (greeting, EHLO/HELO, MAIL, RCPT, DATA, QUIT, anything
else gets 250), in a thread per connection, and records for each connection when it opened,
when each command arrived, and when a message was accepted (the end of DATA). Every reply
waits `delay` seconds first, or `delays[verb]` for that command ("GREETING" for the banner,
"." for the end of the message). With `idle_close`, a connection that sends no command for
that many seconds is told `421` and closed, as relays do with idle clients.
"""

from __future__ import annotations

import socketserver
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType


@dataclass
class Connection:
    opened: float
    commands: list[tuple[float, str]] = field(default_factory=list)
    delivered: list[float] = field(default_factory=list)


class SlowRelay:
    def __init__(
        self,
        delay: float = 0.0,
        delays: dict[str, float] | None = None,
        *,
        idle_close: float | None = None,
    ) -> None:
        self.delay = delay
        self.idle_close = idle_close
        self.delays = dict(delays or {})
        self._lock = threading.Lock()
        self._connections: list[Connection] = []
        relay = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                relay._handle(self)

        class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> SlowRelay:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def connections(self) -> list[Connection]:
        with self._lock:
            return [
                Connection(c.opened, list(c.commands), list(c.delivered)) for c in self._connections
            ]

    def delivered(self) -> list[float]:
        """When each message was accepted, over all connections."""
        return sorted(t for c in self.connections for t in c.delivered)

    def _handle(self, handler: socketserver.StreamRequestHandler) -> None:
        conn = Connection(time.monotonic())
        with self._lock:
            self._connections.append(conn)

        def reply(verb: str, text: str) -> None:
            time.sleep(self.delays.get(verb, self.delay))
            handler.wfile.write(text.encode() + b"\r\n")
            handler.wfile.flush()

        try:
            reply("GREETING", "220 slow relay")
            in_data = False
            while True:
                handler.connection.settimeout(None if in_data else self.idle_close)
                try:
                    line = handler.rfile.readline()
                except TimeoutError:
                    # Idle too long: what a relay says before it hangs up on a kept connection.
                    reply("IDLE", "421 4.4.2 idle too long, closing")
                    return
                if not line:
                    return
                if in_data:
                    if line == b".\r\n":
                        in_data = False
                        with self._lock:
                            conn.delivered.append(time.monotonic())
                        reply(".", "250 queued")
                    continue
                verb = line[:4].decode("ascii", "replace").upper()
                with self._lock:
                    conn.commands.append((time.monotonic(), verb))
                if verb in ("EHLO", "HELO"):
                    reply(verb, "250 slow relay")
                elif verb == "DATA":
                    in_data = True
                    reply(verb, "354 go on")
                elif verb == "QUIT":
                    reply(verb, "221 bye")
                    return
                else:
                    reply(verb, "250 ok")
        except OSError:
            return
