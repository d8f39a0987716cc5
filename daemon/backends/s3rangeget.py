"""A ranged GET read straight into a buffer the range owns: restore's bulk reads where the
range's bytes are written on the event loop's own thread (the ``ckptdrain restore`` command
and its reader processes; s3ranges.LoopWriter).

aiohttp hands a body over as new bytes objects: uvloop copies each socket read out of its own
buffer, the HTTP parser copies the body out of that, and the quarter-megabyte allocations are
memory the kernel faults in again and again. Here the socket is read into one reused buffer
(asyncio's BufferedProtocol: the loop's ``recv_into``), and each full buffer is written to the
file and checksummed from where it arrived: the kernel's copy in and its copy out, as
``s5cmd`` does.

Only the plain answer is read here: 206 with the Content-Range and Content-Length asked for,
no transfer coding. Anything else before the body (an error status, a redirect, a chunked
body, a failed connect or TLS handshake) is :class:`NotPlain`, and s3ranges asks again through
aiobotocore, whose typed errors, credential renewal and retries say what happened. The request
is signed by botocore itself as a presigned URL (SigV4 query signing with the client's own
credentials, endpoint and addressing; the Range and If-Match headers signed with it), and a
TLS endpoint is reached with aiobotocore's own TLS settings. An endpoint reached through a
proxy, or a client whose internals differ, is never read here.
"""

from __future__ import annotations

import asyncio
import urllib.parse
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ckptdrain.daemon.backends.s3errors import S3_FAILURES, S3Failure
from ckptdrain.daemon.errors import DaemonError

if TYPE_CHECKING:
    import ssl

    from ckptdrain.daemon.backends.s3client import S3Client

# A batch written (and checksummed) at once: what s3ranges' RANGE_WRITE_BYTES is for, a
# batch still in the CPU's cache when the write copies it into the page cache. Not a multiple
# of the page size, on purpose: page-aligned 256 KiB writes let the filesystem put the file in
# 256 KiB page-cache folios, taken from the free memory's large blocks, which a virtual
# machine's host takes back while they are free (free page reporting) and backs again on the
# first write. Restoring 8 x 512 MiB on the test VM cost 1.4-2.6 system CPU s/GB that way, and
# 0.45-0.55 with this size (aiohttp's irregular chunks had never hit it: 0.5-0.8).
BUFFER_BYTES = (256 << 10) - 1000
# An answer's status line and headers larger than this are not S3's plain answer.
MAX_HEAD_BYTES = 16 << 10
# A presigned URL is sent at once; it only needs to outlive a slow connect.
URL_EXPIRES_S = 900

# Writes one batch at an offset, continuing a CRC64NVME: the new one (s3ranges.write_at).
WriteNow = Callable[[list[memoryview], int, int], int]


class NotPlain(DaemonError):
    """The range was not read here (nothing of it written): ask through aiobotocore. Never
    reaches a user: s3ranges asks again on this."""


@dataclass(frozen=True, slots=True)
class Route:
    """How this process reaches the endpoint without aiohttp: host, port, TLS context
    (None: plain http), and the client's proxy settings (a request's own URL is checked
    against them: a bucket's virtual host may be proxied where the endpoint is not)."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    proxies: Any

    def target(self, url: str) -> tuple[str, int] | None:
        """Where a presigned ``url`` is sent: its own host (a virtual-hosted bucket's name
        under the endpoint's, or the endpoint's) and port; None when it is not the endpoint's
        or goes through a proxy. Connecting to the endpoint's host and naming the bucket's
        in Host reached a server aiobotocore could not (found attacking: ``bkt.localhost``
        did not resolve, the endpoint did)."""
        split = urllib.parse.urlsplit(url)
        host = split.hostname or ""
        if host != self.host and not host.endswith("." + self.host):
            return None
        if self.proxies.proxy_url_for(url):
            return None
        return host, split.port or self.port


# Per aiobotocore client (a client built again after new credentials gets its own): the
# route, or None where the client is not read here. Building a TLS context reads the CA
# bundle (about 30 ms): once per client.
_routes: weakref.WeakKeyDictionary[Any, Route | None] = weakref.WeakKeyDictionary()


def route_of(s3: Any) -> Route | None:
    """The route to ``s3``'s endpoint, or None: a proxy, an unknown scheme, internals that
    are not aiobotocore's as tested, or TLS settings that do not load now."""
    if s3 in _routes:
        return _routes[s3]
    route: Route | None = None
    endpoint = str(getattr(getattr(s3, "meta", None), "endpoint_url", "") or "")
    http = getattr(getattr(s3, "_endpoint", None), "http_session", None)
    proxies = getattr(http, "_proxy_config", None)
    contexts = getattr(http, "_build_ssl_contexts", None)
    split = urllib.parse.urlsplit(endpoint)
    if proxies is not None and not proxies.proxy_url_for(endpoint) and split.hostname:
        if split.scheme == "http":
            route = Route(split.hostname, split.port or 80, None, proxies)
        elif split.scheme == "https" and contexts is not None:
            try:
                tls = contexts(None)[0]
            except (OSError, ValueError):
                # A CA bundle or client certificate that does not load (gone, rewritten in
                # place): it raised a bare FileNotFoundError or ssl.SSLError out of the
                # range, read as the local file's failure. aiobotocore's GET says which
                # endpoint and what to do; the next range tries the route again (not kept).
                return None
            route = Route(split.hostname, split.port or 443, tls, proxies)
    _routes[s3] = route
    return route


def signed_host(url: str) -> str:
    """The Host botocore signs for ``url`` (as botocore.auth's ``_host_from_url``): its host
    lower-cased, an IPv6 address in brackets, its port unless the scheme's default. Sent as
    the URL was written (``LocalHost``, ``:443``), it was refused (SignatureDoesNotMatch)
    and every range was asked twice."""
    split = urllib.parse.urlsplit(url)
    host = split.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if split.port is not None and split.port != {"http": 80, "https": 443}.get(split.scheme):
        host = f"{host}:{split.port}"
    return host


@dataclass(slots=True)
class Head:
    """What of an answer's head decides whether its body is read here."""

    status: int
    fields: dict[str, str]


def parse_head(raw: bytes) -> Head:
    """The status and header fields (names lower-cased) of an HTTP/1.x answer's head, the
    bytes before its blank line; NotPlain when it is not one."""
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not (code.isascii() and code.isdigit()):
        raise NotPlain(f"not an HTTP/1 answer: {lines[0][:80]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise NotPlain(f"a malformed header line: {line[:80]!r}")
        name = name.lower()
        if name in fields:
            raise NotPlain(f"the header {name} twice")
        fields[name] = value.strip()
    return Head(int(code), fields)


def is_plain(head: Head, asked: str, length: int) -> bool:
    """Whether ``head`` answers the range ``asked`` (``bytes first-last/``) with exactly its
    ``length`` bytes and nothing else to decode."""
    return (head.status == 206 and "transfer-encoding" not in head.fields
            and "content-encoding" not in head.fields
            and head.fields.get("content-length") == str(length)
            and head.fields.get("content-range", "").startswith(asked))


class _Answer(asyncio.BufferedProtocol):
    """One answer read into one buffer: its head parsed, then its body written at ``at``
    batch by batch (``done``: how far it got; its CRC64NVME continued)."""

    def __init__(self, asked: str, length: int, at: int, write: WriteNow, done: Any,
                 progress: Callable[[int], None] | None, read_timeout_s: float) -> None:
        self.asked, self.length, self.at = asked, length, at
        self.write, self.done, self.progress = write, done, progress
        self.read_timeout_s = read_timeout_s
        self.buf = bytearray(BUFFER_BYTES)
        self.view = memoryview(self.buf)
        self.fill = 0
        self.body = -1  # bytes of the body written; -1 while the head is still coming
        self.moved = False
        self.transport: asyncio.Transport | None = None
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.watch: asyncio.TimerHandle | None = None

    # -- protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport's subclasses: no isinstance check)
        self.transport = cast("asyncio.Transport", transport)
        # The read timeout counts from here, as aiohttp's sock_read does: the connect and a
        # TLS handshake have connect_timeout_s. Counted from before the connect, a handshake
        # slower than read_timeout_s (within connect_timeout_s) failed every attempt of the
        # range as "no byte came", where aiobotocore's GET would have read it.
        self.watch = asyncio.get_running_loop().call_later(self.read_timeout_s,
                                                           self._check_moving)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.fill:]

    def buffer_updated(self, nbytes: int) -> None:
        self.fill += nbytes
        self.moved = True
        try:
            if self.body < 0:
                self._read_head()
            if self.body >= 0 and self.body + self.fill > self.length:
                # Bytes after the body its Content-Length frames are not the range's (HTTP;
                # aiohttp leaves them too, for aiobotocore's GET): a server or a box on the
                # way that adds some failed every attempt of the range here (found
                # attacking). The connection is closed after the body either way.
                self.fill = self.length - self.body
            if self.body >= 0 and (self.fill == len(self.buf)
                                   or self.body + self.fill == self.length):
                self._write_batch()
        except Exception as exc:
            # Raised out of a protocol's callback, it would only be logged by the loop, and
            # the range would wait for its read timeout: it ends this answer instead (a full
            # disk's OSError, NotPlain).
            self._end(exc)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.body < 0:
            self._end(NotPlain(f"the connection closed before the answer's head: {exc}"))
        else:
            self._end(S3Failure(
                f"the answer was cut short after {self.body} of {self.length} bytes "
                f"({exc or 'closed by the server'}); retry", transient=True, kind="io"))

    # -- reading ----------------------------------------------------------------------------
    def _read_head(self) -> None:
        end = self.buf.find(b"\r\n\r\n", 0, self.fill)
        if end < 0:
            if self.fill >= MAX_HEAD_BYTES:
                raise NotPlain(f"an answer's head longer than {MAX_HEAD_BYTES} bytes")
            return
        head = parse_head(bytes(self.view[:end]))
        if not is_plain(head, self.asked, self.length):
            raise NotPlain(f"not a plain answer to the range (status {head.status})")
        begins = end + 4
        self.buf[:self.fill - begins] = self.buf[begins:self.fill]
        self.fill -= begins
        self.body = 0

    def _write_batch(self) -> None:
        n = self.fill
        if n:
            self.done.crc = self.write([self.view[:n]], self.at + self.body, self.done.crc)
            self.body += n
            self.done.written += n
            self.fill = 0
            if self.progress is not None:
                self.progress(n)
        if self.body == self.length:
            self._end(None)

    def _check_moving(self) -> None:
        if self.finished.done():
            return
        if not self.moved:
            self._end(S3Failure(f"no byte of the answer came for {self.read_timeout_s:.0f} s "
                                "(the read timeout); retry", transient=True, kind="timeout"))
            return
        self.moved = False
        self.watch = asyncio.get_running_loop().call_later(self.read_timeout_s,
                                                            self._check_moving)

    def _end(self, exc: BaseException | None) -> None:
        """Settle the answer once; the connection is not reused either way, so it is
        dropped at once: closed gracefully, a TLS connection waited for the server's
        close_notify, and one that neither answered nor closed after the body (the GET says
        Connection: close) held the range's socket for the TLS shutdown timeout, 30 s after
        the range was done (found attacking: at 100 ranges a second, 3000 descriptors)."""
        if self.watch is not None:
            self.watch.cancel()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()
        if self.finished.done():
            return
        if exc is None:
            self.finished.set_result(None)
        else:
            self.finished.set_exception(exc)


async def read_on(client: S3Client, full: str, offset: int, length: int, etag: str,
                  write: WriteNow, progress: Callable[[int], None] | None, done: Any) -> None:
    """GET ``length`` bytes of ``full`` from ``offset`` (pinned to ``etag``) and write them
    with ``write`` at that offset of the file, ``done`` advanced with each batch.
    :class:`NotPlain` when nothing was read here (ask through aiobotocore); S3Failure
    (transient) when the answer broke off partway (``done`` says how far it got)."""
    if not (etag.isascii() and etag.isprintable()):
        raise NotPlain(f"an ETag not sent as it is: {etag[:80]!r}")
    s3 = await client._s3()
    route = route_of(s3)
    if route is None:
        raise NotPlain(f"{client.uri} is not read without aiohttp (a proxy, or TLS settings "
                       "not known or not loading)")
    last = offset + length - 1
    asked = f"bytes {offset}-{last}/"
    ranged = f"bytes={offset}-{last}"
    try:
        url = await s3.generate_presigned_url(
            "get_object", Params={"Bucket": client.bucket, "Key": full, "Range": ranged,
                                  "IfMatch": etag}, ExpiresIn=URL_EXPIRES_S)
    except S3_FAILURES as exc:
        # Signing renews credentials about to expire: a chain that fails to (a
        # credential_process, a role's) raised botocore's own error out of the restore.
        # aiobotocore's GET fails the same way, as a typed error, and renews the client.
        raise NotPlain(f"presigning the GET: {exc}") from exc
    where = route.target(url)
    if where is None:
        raise NotPlain(f"{url.split('?')[0]} is not the endpoint's host, or is proxied")
    host, port = where
    split = urllib.parse.urlsplit(url)
    target = split.path + ("?" + split.query if split.query else "")
    request = (f"GET {target} HTTP/1.1\r\nHost: {signed_host(url)}\r\nRange: {ranged}\r\n"
               f"If-Match: {etag}\r\nUser-Agent: ckptdrain\r\nConnection: close\r\n\r\n")
    config = client._config
    answer = _Answer(asked, length, offset, write, done, progress, float(config.read_timeout_s))
    loop = asyncio.get_running_loop()
    transport: asyncio.Transport | None = None
    try:
        try:
            async with asyncio.timeout(float(config.connect_timeout_s)):
                transport, _ = await loop.create_connection(
                    lambda: answer, host, port, ssl=route.tls,
                    server_hostname=host if route.tls is not None else None)
        except (OSError, TimeoutError) as exc:
            raise NotPlain(f"connecting to {host}:{port}: {exc}") from exc
        transport.write(request.encode("latin-1"))
        await answer.finished
    finally:
        if answer.watch is not None:
            answer.watch.cancel()
        if transport is not None and not transport.is_closing():
            transport.abort()
