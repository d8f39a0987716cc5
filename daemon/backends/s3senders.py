"""Who sends shard bodies to S3 (multipart parts and single PutObjects): the daemon's own event
loop, or worker processes.

Sending a body is the S3 drain's byte work: read it from the staged file, checksum it, and
write it into an HTTP request. In one process that work sits on the event loop thread (aiohttp
writes bodies there), which caps a daemon near one core. :class:`WorkerSenders` moves it into
``drain.workers`` processes (s3worker.py), each with its own event loop and S3 client; the
daemon keeps everything that decides: creating and completing uploads, the journal, the commit.

A request to a worker carries a duplicate of the staged file's fd (SCM_RIGHTS), so the daemon
may close its own fd at any time; the worker closes its copy when the part is done. Each worker
is owned by the pool: started on first use, restarted after it dies (what it had in flight
fails as a transient error, which the drain retries and the upload journal resumes), and
stopped with the backend. A cancelled send tells the worker to cancel the part and waits for
its answer, so no part is still in flight when the caller aborts its upload.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp.payload

from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3parts import (
    CHECKSUM_METADATA_KEY,
    READ_DRAIN_TIMEOUT_S,
    crc64_header,
)
from ckptdrain.daemon.logs import log_event

if TYPE_CHECKING:
    from ckptdrain.daemon.backends.s3client import S3Client
    from ckptdrain.daemon.config import DestinationConfig

log = logging.getLogger(__name__)

# A message is one SOCK_SEQPACKET datagram: requests and answers are a few hundred bytes.
MAX_MESSAGE_BYTES = 64 << 10
# How long a stopping pool waits for a worker to exit after its socket closed, then kills it.
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Part:
    """One part to send: ``length`` bytes of the staged file at ``offset``. ``kept_crc`` is the
    CRC64NVME of a part already on the server (a resumed upload): when the staged bytes have
    that checksum the part is not sent again and ``kept_etag`` is its answer."""

    key: str  # the shard's key (for messages)
    full: str  # the object key in the bucket
    upload_id: str
    number: int
    offset: int
    length: int
    kept_crc: int | None = None
    kept_etag: str = ""


@dataclass(frozen=True, slots=True)
class Whole:
    """A whole object sent in one PutObject: ``size`` bytes of the staged file from offset 0,
    with ``metadata`` (the sender adds the checksum it computes) and, when ``exclusive``,
    ``If-None-Match: *`` (a taken key fails with the server's PreconditionFailed)."""

    key: str
    full: str
    size: int
    metadata: dict[str, str]
    exclusive: bool


@dataclass(frozen=True, slots=True)
class Sent:
    etag: str
    crc: int
    uploaded: bool  # False: a kept part, checksummed and found unchanged


class PartSender(abc.ABC):
    """Who moves shard bodies to S3: :class:`InProcessSender` or :class:`WorkerSenders`."""

    @abc.abstractmethod
    async def send(self, part: Part, fd: int) -> Sent:
        """Send ``part`` of the file ``fd`` (the caller keeps owning ``fd``)."""

    @abc.abstractmethod
    async def put(self, whole: Whole, fd: int) -> int:
        """PutObject ``whole`` from the file ``fd``; returns the CRC64NVME of its bytes."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Stop whatever the sender runs."""


# A body is handed to the socket this much at a time (memoryview slices of the pooled buffer).
BODY_CHUNK_BYTES = 1 << 20


class StreamedBody(aiohttp.payload.Payload):
    """A request body written to the connection as slices of one pooled buffer, never copied.

    aiohttp sends a bytes-like body with one ``write``: it slices it (a copy for a bytearray),
    joins it with the headers (a copy before Python 3.12.9) and the transport keeps what the
    socket did not take (a copy): three fresh allocations of the whole part, whose page faults
    were most of the S3 drain's CPU. Written as 1 MiB memoryview slices with a drain after
    each, nothing is copied in user space but what the socket cannot take at once, and memory
    stays at the pool's buffers. Only for clients built with ``streamed_bodies`` (parameter
    validation off: botocore does not know this type, and must not treat it as a file, which
    would add ``Expect: 100-continue``); the bytes are the same whichever way they go.
    """

    _autoclose = True

    def __init__(self, view: memoryview) -> None:
        super().__init__(view, content_type="application/octet-stream")
        self._view = view
        self._size = len(view)

    def __len__(self) -> int:
        return len(self._view)

    def seek(self, offset: int, whence: int = 0) -> int:
        """botocore rewinds a request's body before each retry (and gives the request up if
        it cannot): this body is always written from its first byte, so rewinding is a no-op."""
        return 0

    def tell(self) -> int:
        return 0

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a shard body is binary")

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        view = self._view if content_length is None else self._view[:content_length]
        for start in range(0, len(view), BODY_CHUNK_BYTES):
            await writer.write(view[start:start + BODY_CHUNK_BYTES])


def body_of(client: S3Client, buf: bytearray) -> Any:
    """What to pass as ``Body``: the streamed body where the client allows it."""
    return StreamedBody(memoryview(buf)) if client.streamed_bodies else buf


async def send_in_process(client: S3Client, part: Part, fd: int) -> Sent:
    """Read, checksum and upload one part from this process (a worker's, or the daemon's own
    when ``drain.workers = 0``). The buffer comes from the client's pool."""
    buf = await client.buffers.acquire(part.length)
    reuse = False
    try:
        crc = await client._read(fd, buf, part.offset)
        reuse = True  # no thread writes into buf any more
        if part.kept_crc is not None and part.kept_crc == crc:
            return Sent(part.kept_etag, crc, uploaded=False)
        answer = await client._call(
            f"uploading part {part.number} of {part.key}", "upload_part",
            Bucket=client.bucket, Key=part.full, UploadId=part.upload_id,
            PartNumber=part.number, Body=body_of(client, buf), ContentLength=part.length,
            ChecksumCRC64NVME=crc64_header(crc),
        )
        return Sent(str(answer["ETag"]), crc, uploaded=True)
    finally:
        client.buffers.release(buf, reuse=reuse)


async def put_in_process(client: S3Client, whole: Whole, fd: int) -> int:
    """Read, checksum and PutObject a whole object from this process."""
    buf = await client.buffers.acquire(whole.size)
    reuse = False
    try:
        crc = await client._read(fd, buf, 0)
        reuse = True
        params: dict[str, Any] = {
            "Bucket": client.bucket, "Key": whole.full, "Body": body_of(client, buf),
            "ContentLength": whole.size, "ChecksumCRC64NVME": crc64_header(crc),
            "Metadata": {**whole.metadata, CHECKSUM_METADATA_KEY: checksums.combine(
                [(crc, whole.size)])},
        }
        if whole.exclusive:
            params["IfNoneMatch"] = "*"
        await client._call(f"uploading {whole.key}", "put_object", **params)
        return crc
    finally:
        client.buffers.release(buf, reuse=reuse)


class InProcessSender(PartSender):
    """``drain.workers = 0``: bodies go out on the daemon's own event loop."""

    def __init__(self, client: S3Client) -> None:
        self._client = client

    async def send(self, part: Part, fd: int) -> Sent:
        return await send_in_process(self._client, part, fd)

    async def put(self, whole: Whole, fd: int) -> int:
        return await put_in_process(self._client, whole, fd)


# -- messages --------------------------------------------------------------------------------


async def send_message(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None,
                       *, timeout_s: float) -> None:
    """Send one message (with ``fds`` attached) on a non-blocking SOCK_SEQPACKET socket."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                socket.send_fds(sock, [data], fds or [])
                return
            except BlockingIOError:
                await ready(sock, write=True)


async def ready(sock: socket.socket, *, write: bool) -> None:
    """Wait until ``sock`` is writable (or readable), without a task of its own."""
    loop = asyncio.get_running_loop()
    event = loop.create_future()
    fd = sock.fileno()
    if write:
        loop.add_writer(fd, event.set_result, None)
    else:
        loop.add_reader(fd, event.set_result, None)
    try:
        await event
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


def receive_ready(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message waiting on a non-blocking socket: (object, fds); None at EOF; raises
    BlockingIOError when none is waiting. A malformed message closes its fds and raises
    ValueError."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 4)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    try:
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("not an object")
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    return obj, fds


def failure_message(exc: BaseException) -> dict[str, Any]:
    """How a worker reports a failed part (rebuilt by :func:`failure_from`)."""
    if isinstance(exc, S3Failure):
        return {"message": str(exc), "transient": exc.transient, "kind": exc.kind,
                "code": exc.code, "status": exc.status}
    if isinstance(exc, OSError):
        return {"message": str(exc), "oserror": exc.errno or 0}
    return {"message": f"{type(exc).__name__}: {exc}", "transient": True, "kind": "io",
            "internal": True}


def failure_from(error: dict[str, Any]) -> BaseException:
    message = str(error.get("message", "the upload worker failed"))
    if "oserror" in error:
        return OSError(int(error["oserror"]), message)
    return S3Failure(message, transient=bool(error.get("transient", True)),
                     kind=str(error.get("kind", "io")), code=str(error.get("code", "")),
                     status=int(error.get("status", 0)))


# -- worker processes ------------------------------------------------------------------------


class _Worker:
    """One worker process and its socket; answers are matched to requests by id."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.index = index
        self.proc = proc
        self.sock = sock
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.alive = True
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        # A reader callback, not a task: it only matches answers to the futures awaiting them.
        while self.alive:
            try:
                got = receive_ready(self.sock)
            except BlockingIOError:
                return
            except (OSError, ValueError) as exc:
                self.lost(f"its socket failed ({exc})")
                return
            if got is None:
                self.lost("it exited")
                return
            answer, fds = got
            for fd in fds:
                os.close(fd)  # workers send none; never leak what arrives anyway
            future = self.pending.pop(int(answer.get("id", -1)), None)
            if future is not None and not future.done():
                future.set_result(answer)

    def lost(self, why: str) -> None:
        """The worker is gone: what it had in flight fails as transient (the drain retries)."""
        if not self.alive:
            return
        self.alive = False
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        log_event(log, logging.WARNING, "s3_worker_lost", worker=self.index, why=why,
                  in_flight=len(self.pending), action="parts in flight are sent again")
        failure = S3Failure(f"the S3 upload worker {self.index} stopped ({why}); the part "
                            "will be sent again", transient=True, kind="io")
        for future in self.pending.values():
            if not future.done():
                future.set_exception(failure)
        self.pending.clear()


class WorkerSenders(PartSender):
    """Parts sent by ``count`` worker processes, each request to the least busy one."""

    def __init__(self, config: DestinationConfig, node_id: str, count: int) -> None:
        self._config = config
        self._node_id = node_id
        self._count = count
        self._workers: list[_Worker | None] = [None] * count
        self._ids = itertools.count(1)
        self._start_lock = asyncio.Lock()
        self._closed = False
        # Longest wait for one part's answer: botocore's own retries are bounded by these, so a
        # worker that answers nothing for longer is stuck and is replaced.
        self._answer_timeout_s = config.max_attempts * (
            float(config.connect_timeout_s) + float(config.read_timeout_s) + 60.0)

    async def _worker(self) -> _Worker:
        async with self._start_lock:
            if self._closed:
                raise S3Failure("the S3 backend is closed", transient=False, kind="io")
            for i, worker in enumerate(self._workers):
                if worker is None or not worker.alive:
                    self._workers[i] = await self._start(i)
            alive = [w for w in self._workers if w is not None]
        return min(alive, key=lambda w: len(w.pending))

    async def _start(self, index: int) -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ckptdrain.daemon.backends.s3worker",
                str(theirs.fileno()), str(index), pass_fds=(theirs.fileno(),),
                # botocore signs with the AWS CRT when awscrt is installed, and that signer
                # copies every body into a BytesIO (and refuses a streamed one) even when the
                # payload is not signed; its classic signer only signs the headers.
                env={**os.environ, "BOTO_DISABLE_CRT": "true"},
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        worker = _Worker(index, proc, ours)
        try:
            await send_message(ours, {"config": self._config.model_dump(mode="json"),
                                      "node_id": self._node_id}, timeout_s=10.0)
        except (OSError, TimeoutError) as exc:
            worker.lost(f"it did not take its configuration ({exc})")
        log_event(log, logging.INFO, "s3_worker_started", worker=index, pid=proc.pid)
        return worker

    async def send(self, part: Part, fd: int) -> Sent:
        reply = await self._request(
            {"op": "part", "key": part.key, "full": part.full, "upload_id": part.upload_id,
             "number": part.number, "offset": part.offset, "length": part.length,
             "kept_crc": part.kept_crc, "kept_etag": part.kept_etag},
            fd, f"part {part.number} of {part.key}")
        return Sent(str(reply["etag"]), int(reply["crc"]), uploaded=bool(reply["uploaded"]))

    async def put(self, whole: Whole, fd: int) -> int:
        reply = await self._request(
            {"op": "put", "key": whole.key, "full": whole.full, "size": whole.size,
             "metadata": whole.metadata, "exclusive": whole.exclusive}, fd, whole.key)
        return int(reply["crc"])

    async def _request(self, body: dict[str, Any], fd: int, what: str) -> dict[str, Any]:
        worker = await self._worker()
        request_id = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        worker.pending[request_id] = answer
        request = {"id": request_id, **body}
        try:
            await send_message(worker.sock, request, [fd], timeout_s=10.0)
        except (OSError, TimeoutError) as exc:
            worker.pending.pop(request_id, None)
            worker.lost(f"a request could not be sent ({exc})")
            raise S3Failure(f"the S3 upload worker {worker.index} could not be reached; "
                            f"{what} will be sent again", transient=True, kind="io") from exc
        try:
            reply = await asyncio.wait_for(asyncio.shield(answer), self._answer_timeout_s)
        except TimeoutError:
            worker.lost(f"{what} got no answer in {self._answer_timeout_s:g} s")
            raise S3Failure(f"{what} got no answer from its upload worker; it will be sent "
                            "again", transient=True, kind="timeout") from None
        except asyncio.CancelledError:
            await self._cancel(worker, request_id, answer)
            raise
        if "error" in reply:
            raise failure_from(reply["error"])
        return reply

    async def _cancel(self, worker: _Worker, request_id: int,
                      answer: asyncio.Future[dict[str, Any]]) -> None:
        """Tell the worker to give the part up and wait until it has: the caller aborts the
        upload next, and a part landing after the abort would be left on the server."""
        if answer.done():
            return
        try:
            await send_message(worker.sock, {"cancel": request_id}, timeout_s=5.0)
            await asyncio.wait([answer], timeout=READ_DRAIN_TIMEOUT_S)
        except (OSError, TimeoutError):
            pass
        if not answer.done():
            worker.lost("a cancelled part did not stop")
        if answer.done() and not answer.cancelled():
            answer.exception()  # retrieved: the cancellation is what the caller sees

    async def aclose(self) -> None:
        async with self._start_lock:
            self._closed = True
            workers = [w for w in self._workers if w is not None]
            self._workers = [None] * self._count
        for worker in workers:
            if worker.alive:
                worker.alive = False
                with contextlib.suppress(ValueError, OSError):
                    asyncio.get_running_loop().remove_reader(worker.sock.fileno())
                worker.sock.close()  # the worker sees EOF and exits
            closed = S3Failure("the S3 backend closed while the part was sent",
                               transient=True, kind="io")
            for future in worker.pending.values():
                if not future.done():
                    future.set_exception(closed)
            worker.pending.clear()
        for worker in workers:
            try:
                await asyncio.wait_for(worker.proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                await worker.proc.wait()


def open_sender(client: S3Client, config: DestinationConfig, node_id: str,
                workers: int) -> PartSender:
    return InProcessSender(client) if workers == 0 else WorkerSenders(config, node_id, workers)
