"""An HTTP/1.1-aware TCP proxy that breaks requests on purpose, between a client and a server.

    async with FaultProxy("127.0.0.1", server_port, seed=1) as proxy:
        proxy.set_rates(reset=0.1, slowdown=0.1)     # 20% of requests fail, chosen by the seed
        proxy.inject("error200", match=lambda r: r.method == "POST" and "uploadId=" in r.target)
        proxy.unreachable = True                     # every connection is reset from now on
        ... endpoint_url=proxy.endpoint_url ...

It reads each request's head and body (``Content-Length`` framing; botocore sends no chunked
bodies) and then either forwards it and relays the answer, or injects one fault:

- ``reset``: the client connection is closed with a TCP RST right after the request head;
- ``slowdown``: ``503 SlowDown`` with S3's XML error body (the connection is kept);
- ``stall``: no answer at all until ``stall_s`` (the client's read timeout fires first);
- ``error200``: ``200 OK`` whose body is an S3 ``<Error>`` (what S3 may answer to
  CompleteMultipartUpload when it fails after sending the status line);
- ``drop_response``: the request is forwarded and done by the server, but its answer is
  thrown away and the client connection reset (so the client's retry finds the work done);
- ``corrupt``: the request is forwarded with one byte of its body flipped (a server that checks
  the body's checksum must refuse it);
- ``truncate``: the answer is relayed up to half its body, then the connection is reset.
- ``wrong_etag``: the request is forwarded and done, and its answer relayed with another
  ETag (a corrupted answer, or a gateway that rewrites ETags);
- ``stuck_listing``: a ListObjectsV2 answered with an empty page that says more follow, with
  the same continuation token every time (a server whose paging never advances);
  ``endless_listing``: the same with a new token every time; ``tokenless_listing``: with no
  token at all; ``growing_listing``: a new token and a new key under the prefix every time
  (a listing without end).
- ``trickle``: the request is forwarded and its answer's body relayed at ``trickle_bytes_per_s``
  (a byte every now and then: no read of the client's ever times out);
- ``web_page``: ``200 OK`` with an HTML page and no ETag (a web server, a proxy or a load
  balancer answering in the S3 server's place); the request is not forwarded.
- ``trailing``: the answer is relayed whole, in one write with a few bytes more after its
  ``Content-Length`` body (a server or a box on the way that adds them), then the connection
  is closed.

Faults come first from the scripted queue (``inject``), then at random from ``set_rates`` with
a seeded generator. ``unreachable`` resets every connection, old and new (the request head is
still read, so tests can see what was attempted). Every request seen is in ``requests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import struct
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, cast

FAULTS = ("reset", "slowdown", "stall", "error200", "drop_response", "corrupt", "truncate",
          "delete_denied", "stuck_listing", "endless_listing", "tokenless_listing",
          "growing_listing", "wrong_etag", "web_page", "trickle", "trailing")
# Faults applied to a request that is still forwarded to the server.
_FORWARDED = frozenset({None, "drop_response", "corrupt", "truncate", "wrong_etag", "trickle",
                        "trailing"})
# What ``trailing`` sends after an answer's body.
TRAILING = b"\r\n\r\nnot the body"
_MAX_HEAD = 64 * 1024
_RELAY_CHUNK = 1 << 20
_TRICKLE_PIECE = 1024


@dataclass
class ProxiedRequest:
    """One request as the proxy saw it, and what it did with it (``fault`` None: forwarded;
    ``"unreachable"``: refused while unreachable)."""

    method: str
    target: str
    fault: str | None = None
    user_agent: str = ""  # which client sent it (botocore's or the AWS common runtime's)

    @property
    def is_upload_part(self) -> bool:
        return self.method == "PUT" and "partNumber=" in self.target and "uploadId=" in self.target


@dataclass
class _Scripted:
    fault: str
    times: int
    match: Callable[[ProxiedRequest], bool] | None


@dataclass
class _Head:
    raw: bytes
    first_line: str
    headers: dict[str, str] = field(default_factory=dict)


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, *, seed: int = 0,
                 stall_s: float = 30.0, connect_timeout_s: float = 5.0,
                 trickle_bytes_per_s: float = 64 * 1024) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.stall_s = stall_s
        self.trickle_bytes_per_s = trickle_bytes_per_s
        self.connect_timeout_s = connect_timeout_s
        self.requests: list[ProxiedRequest] = []
        self._rng = random.Random(seed)
        self._rates: dict[str, float] = dict.fromkeys(FAULTS, 0.0)
        self._script: list[_Scripted] = []
        self._unreachable = False
        self._unreachable_after: int | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._closing = asyncio.Event()
        self.port = 0

    # -- control ----------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_rates(self, **rates: float) -> None:
        """Fault probabilities per request, e.g. ``set_rates(reset=0.1, slowdown=0.1)``."""
        unknown = set(rates) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; choose from {FAULTS}")
        self._rates = dict.fromkeys(FAULTS, 0.0) | rates
        if sum(self._rates.values()) > 1.0:
            raise ValueError("fault rates add up to more than 1")

    def inject(self, fault: str, *, times: int = 1,
               match: Callable[[ProxiedRequest], bool] | None = None) -> None:
        """Apply ``fault`` to the next ``times`` requests that ``match`` (all if None)."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose from {FAULTS}")
        self._script.append(_Scripted(fault, times, match))

    @property
    def unreachable(self) -> bool:
        return self._unreachable

    @unreachable.setter
    def unreachable(self, value: bool) -> None:
        self._unreachable = value
        self._unreachable_after = None
        if value:
            for writer in list(self._writers):
                _reset(writer)

    def unreachable_after(self, n_requests: int) -> None:
        """Forward ``n_requests`` more requests, then become unreachable."""
        self._unreachable_after = sum(1 for r in self.requests if r.fault is None) + n_requests

    def faults(self, kind: str | None = None) -> list[ProxiedRequest]:
        return [r for r in self.requests
                if r.fault is not None and (kind is None or r.fault == kind)]

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0,
                                                  limit=_MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        self._closing.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        if self._server is not None:
            # Python 3.11: a Server closed while one of its accepts is under way in the loop
            # (asyncio's own task, the connection's transport not made yet) leaks that
            # connection: its transport is made after close() and never closed, and a later
            # test fails on the ResourceWarning (seen in make chaos and in CI). So the accepts
            # under way finish first; the last check and close() have no await between them,
            # so no accept starts in between.
            while (accepting := _accepts_under_way()) and loop.time() < deadline:
                await asyncio.wait(accepting, timeout=max(0.0, deadline - loop.time()))
            self._server.close()
        for writer in list(self._writers):
            _reset(writer)
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5.0)
        # Python 3.11's Server.close() leaves accepted connections open, and wait_closed()
        # does not wait for them. A connection accepted just before close() gets its handler
        # a few loop turns later; if the loop closes first, that handler never runs and its
        # connection is never closed. So wait until every connection the server attached
        # has ended: each late handler finds _closing set and closes its own.
        while (self._server is not None and getattr(self._server, "_active_count", 0)
               and loop.time() < deadline):
            for writer in list(self._writers):
                _reset(writer)
            await asyncio.sleep(0.01)
        if self._server is not None:
            await asyncio.wait_for(self._server.wait_closed(), timeout=5.0)

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # -- per connection ---------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        up_reader: asyncio.StreamReader | None = None
        up_writer: asyncio.StreamWriter | None = None
        try:
            while not self._closing.is_set():
                head = await _read_head(reader)
                if head is None:
                    return
                method, target = _request_line(head.first_line)
                request = ProxiedRequest(method, target,
                                         user_agent=head.headers.get("user-agent", ""))
                self.requests.append(request)
                self._maybe_go_unreachable()
                if self._unreachable:
                    request.fault = "unreachable"
                    _reset(writer)
                    return
                request.fault = self._choose(request)
                if request.fault == "reset":
                    _reset(writer)
                    return
                length = int(head.headers.get("content-length", "0") or 0)
                if "chunked" in head.headers.get("transfer-encoding", "").lower():
                    raise ValueError("chunked request bodies are not supported by the proxy")
                if head.headers.get("expect", "").lower() == "100-continue":
                    # Answer the client's Expect ourselves (as a server would) and do not pass it
                    # on: the body is read here either way, and aiohttp waits for the 100
                    # without any timeout.
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = _without_header(head, "expect")
                if request.fault is not None and request.fault not in _FORWARDED:
                    await _discard(reader, length)
                    if request.fault == "stall":
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._closing.wait(), self.stall_s)
                        _reset(writer)
                        return
                    writer.write(_fault_response(request.fault, target))
                    await writer.drain()
                    continue
                if up_writer is None or up_writer.is_closing():
                    # asyncio.timeout, not wait_for: on Python 3.11 a cancel (aclose) that
                    # meets the connect's completion made wait_for drop the new connection
                    # unclosed, which a later test then saw as a ResourceWarning.
                    async with asyncio.timeout(self.connect_timeout_s):
                        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
                assert up_reader is not None and up_writer is not None
                if request.fault == "corrupt":
                    body = bytearray(await reader.readexactly(length))
                    if body:
                        body[len(body) // 2] ^= 0xFF
                    up_writer.write(head.raw + body)
                else:
                    up_writer.write(head.raw)
                    await _copy(reader, up_writer, length)
                if request.fault == "drop_response":
                    await _relay_response(up_reader, None, method)
                    _reset(writer)
                    return
                if request.fault == "truncate":
                    await _relay_response(up_reader, writer, method, truncate=True)
                    _reset(writer)
                    return
                if request.fault == "trailing":
                    held = _Held()
                    await _relay_response(up_reader, cast(asyncio.StreamWriter, held), method)
                    writer.write(bytes(held.data) + TRAILING)
                    await writer.drain()
                    return  # (closed gracefully below: a reset could drop what was sent)
                keep = await _relay_response(
                    up_reader, writer, method, wrong_etag=request.fault == "wrong_etag",
                    trickle_bytes_per_s=(self.trickle_bytes_per_s if request.fault == "trickle"
                                         else None))
                if not keep:
                    return
        except (OSError, asyncio.IncompleteReadError, ValueError):
            _reset(writer)
        except asyncio.CancelledError:
            # aclose() cancels handlers on purpose; ending quietly keeps asyncio's stream
            # callback from logging the cancellation as an error.
            _reset(writer)
        finally:
            self._writers.discard(writer)
            if up_writer is not None:
                up_writer.close()
            if not writer.is_closing():
                writer.close()
            self._handlers.discard(task)

    def _maybe_go_unreachable(self) -> None:
        if self._unreachable_after is None:
            return
        forwarded = sum(1 for r in self.requests if r.fault is None)
        if forwarded > self._unreachable_after:
            self.unreachable = True

    def _choose(self, request: ProxiedRequest) -> str | None:
        for scripted in self._script:
            if scripted.times > 0 and (scripted.match is None or scripted.match(request)):
                scripted.times -= 1
                return scripted.fault
        draw = self._rng.random()
        for fault in FAULTS:
            rate = self._rates[fault]
            if draw < rate:
                return fault
            draw -= rate
        return None


# -- HTTP framing -----------------------------------------------------------------------------


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    """The request or response head (through the blank line), or None at a clean EOF."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    except asyncio.LimitOverrunError as exc:
        raise ValueError("HTTP head too large") from exc
    lines = raw.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return _Head(raw=raw, first_line=lines[0], headers=headers)


def _without_header(head: _Head, name: str) -> _Head:
    lines = head.raw.split(b"\r\n")
    kept = [line for line in lines[1:] if not line.lower().startswith(name.encode() + b":")]
    headers = {k: v for k, v in head.headers.items() if k != name}
    return _Head(raw=b"\r\n".join([lines[0], *kept]), first_line=head.first_line,
                 headers=headers)


def _request_line(line: str) -> tuple[str, str]:
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x request line: {line!r}")
    return parts[0], parts[1]


class _Held:
    """An answer held whole, to be written at once (the StreamWriter methods it takes)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                length: int) -> None:
    """Move ``length`` bytes from reader to writer (None: throw them away)."""
    left = length
    while left > 0:
        chunk = await reader.read(min(left, _RELAY_CHUNK))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", left)
        if writer is not None:
            writer.write(chunk)
            await writer.drain()
        left -= len(chunk)


async def _discard(reader: asyncio.StreamReader, length: int) -> None:
    await _copy(reader, None, length)


async def _relay_response(up: asyncio.StreamReader, client: asyncio.StreamWriter | None,
                          method: str, *, truncate: bool = False,
                          wrong_etag: bool = False,
                          trickle_bytes_per_s: float | None = None) -> bool:
    """Relay one response (after any 1xx interim ones) to ``client`` (None: read and drop
    it); True if the connection stays open. With ``truncate``, stop half-way through a
    ``Content-Length`` body (the caller then resets both connections); with ``wrong_etag``,
    its ETag header says another ETag; with ``trickle_bytes_per_s``, a ``Content-Length``
    body goes at that rate."""

    def out(data: bytes) -> None:
        if client is not None:
            client.write(data)

    while True:
        head = await _read_head(up)
        if head is None:
            raise asyncio.IncompleteReadError(b"", None)
        status = int(head.first_line.split(" ")[1])
        if wrong_etag and not 100 <= status < 200:
            out(re.sub(rb"(?im)^(etag:)[^\r\n]*", rb'\1 "' + b"0" * 32 + rb'"', head.raw))
        else:
            out(head.raw)
        if not 100 <= status < 200:
            break
    keep = head.headers.get("connection", "").lower() != "close"
    if method == "HEAD" or status in (204, 304):
        pass
    elif "chunked" in head.headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await up.readuntil(b"\r\n")
            out(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                # Trailers (usually none) up to the blank line.
                while (line := await up.readuntil(b"\r\n")) != b"\r\n":
                    out(line)
                out(line)
                break
            await _copy(up, client, size + 2)
    elif "content-length" in head.headers and trickle_bytes_per_s and client is not None:
        left = int(head.headers["content-length"])
        while left:
            piece = await up.readexactly(min(left, _TRICKLE_PIECE))
            client.write(piece)
            await client.drain()
            left -= len(piece)
            await asyncio.sleep(len(piece) / trickle_bytes_per_s)
    elif "content-length" in head.headers:
        length = int(head.headers["content-length"])
        await _copy(up, client, length // 2 if truncate else length)
    else:
        while chunk := await up.read(_RELAY_CHUNK):
            out(chunk)
            if client is not None:
                await client.drain()
        keep = False
    if client is not None:
        await client.drain()
    return keep


def _fault_response(fault: str, target: str) -> bytes:
    resource = target.split("?")[0]
    if fault == "delete_denied":
        # A DeleteObjects answered 200 with one key refused inside it (the request is not
        # forwarded: nothing is deleted), as S3 reports a key it could not delete.
        body = (
            b'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult><Error>'
            b"<Key>denied/key</Key><Code>AccessDenied</Code><Message>Access Denied</Message>"
            b"</Error></DeleteResult>"
        )
        return (
            "HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nx-amz-request-id: faultproxy\r\n\r\n"
        ).encode() + body
    if fault in ("stuck_listing", "endless_listing", "tokenless_listing", "growing_listing"):
        token = {"stuck_listing": b"same-token", "tokenless_listing": b""}.get(
            fault, random.randbytes(8).hex().encode())
        grown = b""
        if fault == "growing_listing":
            prefix = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query).get(
                "prefix", [""])[0]
            grown = (f"<Contents><Key>{prefix}grown-{token.decode()}.json</Key>"
                     "<LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                     '<ETag>"0"</ETag><Size>1</Size></Contents>').encode()
        body = (
            b'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult>'
            b"<IsTruncated>true</IsTruncated><MaxKeys>1000</MaxKeys>" + grown
            + (b"<NextContinuationToken>" + token + b"</NextContinuationToken>" if token else b"")
            + b"</ListBucketResult>"
        )
        return (
            "HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nx-amz-request-id: faultproxy\r\n\r\n"
        ).encode() + body
    if fault == "web_page":
        page = b"<html><body><h1>Welcome to nginx!</h1></body></html>"
        return (
            "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n"
            f"Content-Length: {len(page)}\r\n\r\n"
        ).encode() + page
    if fault == "slowdown":
        status, code, message = "503 Slow Down", "SlowDown", "Please reduce your request rate."
    else:  # error200
        status, code, message = "200 OK", "InternalError", "We encountered an internal error."
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{resource}</Resource><RequestId>faultproxy</RequestId></Error>"
    ).encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: faultproxy\r\n\r\n"
    ).encode() + body


def _accepts_under_way() -> list[asyncio.Task[object]]:
    """asyncio's tasks that are turning an accepted socket into a connection."""
    return [t for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__qualname__", "").endswith("_accept_connection2")]


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed server or a dropped link looks."""
    if writer.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class ThreadedProxy:
    """A FaultProxy on its own event loop in a thread, so a daemon subprocess can talk through
    it while the test body stays synchronous."""

    def __init__(self, upstream_url: str, *, seed: int = 7, stall_s: float = 5.0) -> None:
        import threading

        host, port = upstream_url.removeprefix("http://").split(":")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="faultproxy",
                                       daemon=True)
        self.thread.start()
        self.proxy = FaultProxy(host, int(port), seed=seed, stall_s=stall_s)
        self.call(self.proxy.start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def do(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the proxy's loop (its state is not thread-safe)."""
        from concurrent.futures import Future

        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return fut.result(10)

    @property
    def endpoint_url(self) -> str:
        return self.proxy.endpoint_url

    def close(self) -> None:
        self.call(self.proxy.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
