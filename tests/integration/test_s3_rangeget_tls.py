"""Restore's ranged GETs read straight into a buffer (s3rangeget.py) from an https endpoint:
SeaweedFS behind a TLS front with a self-signed certificate, trusted through AWS_CA_BUNDLE
as aiobotocore's own requests trust it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import pytest_asyncio
import uvloop

from ckptdrain.daemon.backends.s3 import S3Backend
from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3ranges import LoopWriter, Range, fetch_range
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_backend import NODE, dest_config

pytestmark = [
    pytest.mark.s3,
    pytest.mark.filterwarnings(
        "ignore:Sending a large body directly with raw bytes:ResourceWarning"),
]

MiB = 1 << 20
KEY = "job/00000000000000000001/tls.bin"
SIZE = 11 * MiB + 7  # three ranges of 5 MiB, or two of 8


class TlsFront:
    """A TLS endpoint on loopback in front of SeaweedFS; the first request line of each
    connection is recorded. Its public port passes bytes on to the TLS listener, each
    connection ``handshake_delay_s`` late: the client waits that long in its handshake.
    With ``hold``, a presigned GET's answer is relayed and its connection then left open,
    nothing more read from it (a server that neither closes after ``Connection: close`` nor
    answers the client's TLS close_notify)."""

    def __init__(self, upstream_port: int, cert: Path, key: Path) -> None:
        self.upstream_port = upstream_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.handshake_delay_s = 0.0
        self.hold = False
        self.first_lines: list[str] = []
        self.port = 0
        self._tls_port = 0
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def endpoint_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def __aenter__(self) -> TlsFront:
        tls = await asyncio.start_server(self._serve_tls, "127.0.0.1", 0, ssl=self.context)
        self._servers.append(tls)
        self._tls_port = tls.sockets[0].getsockname()[1]
        public = await asyncio.start_server(self._serve_late, "127.0.0.1", 0)
        self._servers.append(public)
        self.port = public.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def _serve_late(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.handshake_delay_s)  # the client's hello waits unread
        await self._relay(reader, writer, self._tls_port, b"")

    async def _serve_tls(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        try:
            first = await reader.readline()
        except (OSError, ssl.SSLError):
            writer.transport.abort()
            return
        self.first_lines.append(first.decode("latin-1").rstrip())
        if self.hold and b"X-Amz-Signature=" in first:
            await self._relay_and_hold(reader, writer, first)
        else:
            await self._relay(reader, writer, self.upstream_port, first)

    async def _relay_and_hold(self, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter, first: bytes) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = first + await reader.readuntil(b"\r\n\r\n")
            # (its TLS layer would answer the client's close_notify)
            cast(asyncio.Transport, writer.transport).pause_reading()
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1",
                                                                 self.upstream_port)
            up_writer.write(head)
            try:
                await self._pipe(up_reader, writer)
            finally:
                up_writer.transport.abort()
            await asyncio.Event().wait()  # open, unread, until the front closes
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()
            self._tasks.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     port: int, first: bytes) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
            up_writer.write(first)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, ssl.SSLError):
            pass
        finally:
            writer.transport.abort()
            if up_writer is not None:
                up_writer.transport.abort()
            self._tasks.discard(task)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
        with contextlib.suppress(OSError, RuntimeError, NotImplementedError):
            if dst.can_write_eof():
                dst.write_eof()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test's certificate)")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    yield cert, key


@pytest_asyncio.fixture
async def front(seaweedfs: SeaweedFS, certificate: tuple[Path, Path],
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TlsFront]:
    monkeypatch.setenv("AWS_CA_BUNDLE", str(certificate[0]))
    async with TlsFront(seaweedfs.ports["s3"], *certificate) as f:
        yield f


def _presigned_gets(front: TlsFront) -> list[bool]:
    return ["X-Amz-Signature=" in line for line in front.first_lines if line.startswith("GET")]


async def _copy(backend: S3Backend, tmp_path: Path, name: str) -> tuple[int, str]:
    fd = os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        return await backend.copy_into(KEY, fd)  # type: ignore[no-any-return]
    finally:
        os.close(fd)


@pytest.mark.asyncio
async def test_an_https_endpoint_is_read_here_trusted_as_aiobotocore_trusts_it(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any, front: TlsFront,
        tmp_path: Path) -> None:
    shard = staged(SIZE, seed=41)
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    assert await direct.put_file(KEY, shard.fd, shard.size) == shard.checksum
    config = dest_config(s3_bucket, front.endpoint_url, part_size_bytes=5 * MiB)
    assert await _copy(backends(config, writes_on_loop=True), tmp_path, "a") == (
        SIZE, shard.checksum)
    assert (tmp_path / "a").read_bytes() == shard.data
    assert _presigned_gets(front) == [True] * 3

    # Without the bundle, neither route trusts the certificate: aiobotocore's error says so.
    os.environ.pop("AWS_CA_BUNDLE")
    front.first_lines.clear()
    with pytest.raises(S3Failure) as untrusted:
        await _copy(backends(config, writes_on_loop=True), tmp_path, "b")
    assert "CERTIFICATE_VERIFY_FAILED" in str(untrusted.value)
    assert front.first_lines == [], "no request sent over a connection not trusted"


@pytest.mark.asyncio
async def test_a_handshake_slower_than_the_read_timeout_is_the_connect_timeouts(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any, front: TlsFront,
        tmp_path: Path) -> None:
    # Found attacking: the read timeout counted from before the connect, so a TLS handshake
    # longer than read_timeout_s (within connect_timeout_s) failed every attempt of every
    # range as "no byte of the answer came", where aiobotocore's GET reads it.
    shard = staged(SIZE, seed=42)
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    assert await direct.put_file(KEY, shard.fd, shard.size) == shard.checksum
    on_loop = backends(dest_config(s3_bucket, front.endpoint_url, max_attempts=1,
                                   connect_timeout_s=10.0, read_timeout_s=1.0,
                                   part_size_bytes=5 * MiB), writes_on_loop=True)
    front.handshake_delay_s = 1.5
    assert await _copy(on_loop, tmp_path, "slow") == (SIZE, shard.checksum)
    assert _presigned_gets(front) == [True] * 3, front.first_lines


def test_on_uvloop_as_the_command_runs_it(seaweedfs: SeaweedFS, s3_bucket: str, staged: Any,
                                          certificate: tuple[Path, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # uvloop's TLS transport hands the answer to the buffered protocol as asyncio's does.
    monkeypatch.setenv("AWS_CA_BUNDLE", str(certificate[0]))
    shard = staged(SIZE, seed=43)

    async def scenario() -> tuple[tuple[int, str], list[bool]]:
        direct = S3Backend(dest_config(s3_bucket, seaweedfs.endpoint_url), NODE)
        async with TlsFront(seaweedfs.ports["s3"], *certificate) as tls:
            on_loop = S3Backend(dest_config(s3_bucket, tls.endpoint_url,
                                            part_size_bytes=5 * MiB), NODE, writes_on_loop=True)
            try:
                assert await direct.put_file(KEY, shard.fd, shard.size) == shard.checksum
                return await _copy(on_loop, tmp_path, "uvloop"), _presigned_gets(tls)
            finally:
                await on_loop.aclose()
                await direct.aclose()

    copied, presigned = uvloop.run(scenario())
    assert copied == (SIZE, shard.checksum) and presigned == [True] * 3
    assert (tmp_path / "uvloop").read_bytes() == shard.data


def _sockets_to(port: int) -> int:
    """This process's sockets connected to ``port`` on loopback (the client's, not the
    front's: those are connected from it)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    mine = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            mine += os.readlink(f"/proc/self/fd/{fd}") in inodes
    return mine


@pytest.mark.asyncio
async def test_a_range_read_holds_no_connection_once_its_body_is_in(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any, front: TlsFront,
        tmp_path: Path) -> None:
    # Found attacking: a range whose body was all in closed its TLS connection gracefully,
    # waiting for the server's close_notify; a server that neither closed after the answer
    # (the GET says Connection: close) nor answered held each range's socket open for the
    # TLS shutdown timeout (30 s) after the range was done: at 100 ranges a second, 3000
    # descriptors, past a default limit of 1024. It is not reused: it is closed at once.
    shard = staged(SIZE, seed=44)
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    assert await direct.put_file(KEY, shard.fd, shard.size) == shard.checksum
    on_loop = backends(dest_config(s3_bucket, front.endpoint_url, part_size_bytes=5 * MiB),
                       writes_on_loop=True)
    front.hold = True
    assert await _copy(on_loop, tmp_path, "held") == (SIZE, shard.checksum)
    assert _presigned_gets(front) == [True] * 3
    assert _sockets_to(front.port) <= 1, "aiobotocore's, kept for the next request (the HEAD)"


@pytest.mark.parametrize("bundle", ["missing", "not a certificate"])
@pytest.mark.asyncio
async def test_a_ca_bundle_that_does_not_load_fails_the_range_as_aiobotocore_says(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any, front: TlsFront,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bundle: str) -> None:
    # Found attacking: the route's TLS context is built from the client's settings at its
    # first range (in a reader process, its first request of all); a CA bundle that did
    # not load there (gone, or rewritten in place by a configuration tool) raised a bare
    # FileNotFoundError or ssl.SSLError out of the range, read as a local file's failure,
    # where aiobotocore's GET says which endpoint it could not reach and what to do.
    shard = staged(SIZE, seed=45)
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    assert await direct.put_file(KEY, shard.fd, shard.size) == shard.checksum
    head = await direct._head(KEY, f"ckpt/run1/{KEY}")
    assert head is not None
    path = tmp_path / "bundle.pem"
    if bundle != "missing":
        path.write_text(bundle)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(path))
    on_loop = backends(dest_config(s3_bucket, front.endpoint_url, max_attempts=1),
                       writes_on_loop=True)
    fd = os.open(tmp_path / "restored", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with pytest.raises(S3Failure) as failed:
            await fetch_range(on_loop, Range(KEY, f"ckpt/run1/{KEY}", 0, 5 * MiB,
                                             str(head["ETag"])), LoopWriter(fd))
    finally:
        os.close(fd)
    assert front.endpoint_url in str(failed.value)
