"""The metrics endpoint: ``GET /metrics`` and ``GET /healthz`` over plain HTTP/1.1.

Anyone who can reach the port can connect, so everything a client can make it hold is bounded:
one request per connection, a bounded request head, a timeout on every read and write, a cap on
connections (the longest-idle one goes first), and one render shared by every scrape that comes
while it runs. The exposition is rendered in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import prometheus_client

from ckptdrain.daemon.errors import DaemonError

__all__ = ["MetricsEndpoint", "MetricsServerError"]

# The metrics endpoint answers one request per connection; these bound what a client can make
# it hold (slow or idle clients time out, headers are bounded).
MAX_REQUEST_HEAD_BYTES = 16 * 1024
REQUEST_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
# Connections served at once. Without a cap, anyone who can reach the port held an fd per
# idle connection; at the cap, the one that has waited longest without sending its request
# goes to let a new one in (idle connections holding every slot shut out every scrape and
# /healthz: found attacking the cap). Only when all are being answered is a new one closed.
MAX_CONNECTIONS = 64
# At the cap, failing an idle one, a connection whose answer has been under way this long goes:
# its client is not reading it (a scrape of a 2 MB exposition over loopback takes ms). Held
# till REQUEST_TIMEOUT_S, 64 such connections kept Prometheus out (found attacking).
STALLED_ANSWER_S = 1.0
# A rendered exposition is served again to scrapes within this long of it. With 1,000 jobs one
# render is ~1 MB of text and ~75 ms of CPU: four scrape loops rendering it each time took
# most of a core from the daemon (found attacking /metrics).
RENDER_FRESH_S = 1.0


class MetricsServerError(DaemonError, RuntimeError):
    """The metrics endpoint could not start: pick a free port or another ``[metrics] listen``."""


class MetricsEndpoint:
    """Serves one daemon's exposition (``render``, called in a worker thread)."""

    def __init__(self, render: Callable[[], bytes]) -> None:
        self.render = render
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        # Those still waiting for their request head, by when they came; those being answered,
        # by when their answer began.
        self._unasked: dict[asyncio.Task[None], float] = {}
        self._answering: dict[asyncio.Task[None], float] = {}
        # The last exposition and when it was rendered, and the render in progress: scrapes
        # that come while one runs share it.
        self._rendered: tuple[float, bytes] | None = None
        self._rendering: asyncio.Future[bytes] | None = None

    async def rendered(self) -> bytes:
        """The exposition for a scrape: rendered in a worker thread, never on the event
        loop (prometheus_client's metrics take their own locks, and the state gauges read a
        snapshot replaced whole), once for every scrape that comes while it runs, and served
        again for :data:`RENDER_FRESH_S`."""
        loop = asyncio.get_running_loop()
        if self._rendered is not None and loop.time() - self._rendered[0] < RENDER_FRESH_S:
            return self._rendered[1]
        if self._rendering is None:
            started = loop.time()
            future = self._rendering = loop.run_in_executor(None, self.render)

            def done(f: asyncio.Future[bytes]) -> None:
                self._rendering = None
                if not f.cancelled() and f.exception() is None:
                    self._rendered = (started, f.result())

            future.add_done_callback(done)
        # Shielded: one scrape that gives up does not cancel the render the others wait for.
        return await asyncio.shield(self._rendering)

    async def serve(self, host: str, port: int) -> tuple[str, int]:
        """Serve ``GET /metrics`` and ``GET /healthz`` on ``host:port`` (0: any free port).

        Returns the bound address. Stop it with :meth:`aclose`.
        """
        if self._server is not None:
            raise MetricsServerError("the metrics endpoint is already serving; call aclose() first")
        try:
            server = await asyncio.start_server(
                self._on_connection, host, port, limit=MAX_REQUEST_HEAD_BYTES
            )
        except OSError as exc:
            raise MetricsServerError(
                f"cannot listen for metrics on {host}:{port} ({exc.strerror or exc}); "
                "set [metrics] listen to a free address"
            ) from exc
        self._server = server
        bound = server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def aclose(self) -> None:
        """Stop listening and end open connections; safe to call more than once."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        # Close the connections rather than cancel their tasks: each handler then sees end of
        # stream and returns on its own (cancelling a start_server handler task makes asyncio
        # 3.11 log a spurious error). Abort whatever is still stuck in a write after the timeout.
        tasks = list(self._connections.items())
        for _, writer in tasks:
            writer.close()
        if tasks:
            await asyncio.wait([task for task, _ in tasks], timeout=CLOSE_TIMEOUT_S)
        for task, writer in tasks:
            if not task.done():
                writer.transport.abort()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await server.wait_closed()

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # asyncio.start_server creates this task; owning it here lets aclose() end it.
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= MAX_CONNECTIONS and not self._evict():
            writer.transport.abort()  # not even read: a flood of connections costs one accept each
            return
        self._connections[task] = writer
        self._unasked[task] = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                try:
                    await self._answer(reader, writer)
                except asyncio.LimitOverrunError:
                    await _respond(writer, 431, b"request head too large\n", "text/plain")
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # a client that is slow or goes away (or aclose() aborted) gets nothing more
        finally:
            self._connections.pop(task, None)
            self._unasked.pop(task, None)
            self._answering.pop(task, None)
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await writer.wait_closed()

    def _evict(self) -> bool:
        """Close the connection that has waited longest without sending its request, else the
        one whose answer has stalled longest (its client not reading); False when every one
        is being answered and none stalls."""
        if self._unasked:
            victim = min(self._unasked, key=self._unasked.__getitem__)
            del self._unasked[victim]
        else:
            stalled_since = asyncio.get_running_loop().time() - STALLED_ANSWER_S
            stalled = [t for t, began in self._answering.items() if began <= stalled_since]
            if not stalled:
                return False
            victim = min(stalled, key=self._answering.__getitem__)
            del self._answering[victim]
        # Out of the count now, so the next arrival does not evict another in the meantime.
        self._connections.pop(victim).transport.abort()  # its task ends on its own
        return True

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        task = asyncio.current_task()
        assert task is not None
        self._unasked.pop(task, None)
        self._answering[task] = asyncio.get_running_loop().time()
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await _respond(writer, 400, b"bad request\n", "text/plain")
            return
        method, target, _ = parts
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            await _respond(writer, 405, b"only GET and HEAD\n", "text/plain")
        elif path == "/metrics":
            body = await self.rendered()
            await _respond(
                writer,
                200,
                body,
                prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4,
                head_only=method == "HEAD",
            )
        elif path == "/healthz":
            await _respond(writer, 200, b"ok\n", "text/plain", head_only=method == "HEAD")
        else:
            await _respond(writer, 404, b"try /metrics\n", "text/plain")


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
}


async def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str,
    *,
    head_only: bool = False,
) -> None:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    writer.write(head if head_only else head + body)
    await writer.drain()
