"""The S3 upload worker pool: ``drain.workers`` processes (s3worker.py) that send shard bodies
and the small requests every shard makes, and the messages the daemon and they exchange.

A request to a worker carries a duplicate of the staged file's fd (SCM_RIGHTS), so the daemon
may close its own fd at any time; the worker closes its copy when the part is done. Each worker
is owned by the pool: started with the backend (or on first use), restarted after it dies (what
it had in flight fails as a transient error, which the drain retries and the upload journal
resumes), and stopped with the backend. A cancelled send tells the worker to cancel the part
and waits for its answer, so no part is still in flight when the caller aborts its upload.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3parts import READ_DRAIN_TIMEOUT_S
from ckptdrain.daemon.backends.s3senders import (
    CONTROL_OPERATIONS,
    InProcessSender,
    Part,
    PartSender,
    Sent,
    Whole,
    from_message,
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


# -- messages --------------------------------------------------------------------------------


async def send_message(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None,
                       *, timeout_s: float) -> None:
    """Send one message (with ``fds`` attached) on a non-blocking SOCK_SEQPACKET socket."""
    data = encode(obj)
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                socket.send_fds(sock, [data], fds or [])
                return
            except BlockingIOError:
                await ready(sock, write=True)


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


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
        self.spawned = time.monotonic()
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
            if "started" in answer:
                self._started(answer["started"])
                continue
            future = self.pending.pop(int(answer.get("id", -1)), None)
            if future is not None and not future.done():
                future.set_result(answer)

    def _started(self, figures: Any) -> None:
        if not isinstance(figures, dict):
            return
        log_event(log, logging.INFO, "s3_worker_ready", worker=self.index, pid=self.proc.pid,
                  seconds=round(time.monotonic() - self.spawned, 3),
                  cpu_s=figures.get("cpu_s"), main_thread_cpu_s=figures.get("main_thread_cpu_s"))

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

    def __init__(self, client: S3Client, config: DestinationConfig, node_id: str,
                 count: int) -> None:
        self._client = client  # sends what does not fit in a message itself
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

    async def start(self) -> None:
        await self._worker()

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

    async def call(self, what: str, operation: str, params: dict[str, Any]) -> dict[str, Any]:
        body = {"op": "call", "what": what, "operation": operation, "params": params}
        if operation not in CONTROL_OPERATIONS or len(encode(body)) > MAX_MESSAGE_BYTES // 2:
            # A Complete of thousands of parts does not fit in one datagram: sent from here.
            answer: dict[str, Any] = await self._client._call(what, operation, **params)
            return answer
        return from_message(dict(await self._request(body, None, what))["answer"])

    async def _request(self, body: dict[str, Any], fd: int | None,
                       what: str) -> dict[str, Any]:
        worker = await self._worker()
        request_id = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        worker.pending[request_id] = answer
        request = {"id": request_id, **body}
        try:
            await send_message(worker.sock, request, [] if fd is None else [fd], timeout_s=10.0)
        except (OSError, TimeoutError) as exc:
            worker.pending.pop(request_id, None)
            worker.lost(f"a request could not be sent ({exc})")
            raise S3Failure(f"the S3 upload worker {worker.index} could not be reached; "
                            f"{what} will be sent again", transient=True, kind="io") from exc
        try:
            async with asyncio.timeout(self._answer_timeout_s):
                reply = await asyncio.shield(answer)
        except TimeoutError:
            worker.lost(f"{what} got no answer in {self._answer_timeout_s:g} s")
            raise S3Failure(f"{what} got no answer from its upload worker; it will be sent "
                            "again", transient=True, kind="timeout") from None
        except asyncio.CancelledError:
            await self._cancel(worker, request_id, answer)
            if answer.done() and not answer.cancelled() and answer.exception() is None:
                await self._undo_late_create(body, answer.result())
            raise
        if "error" in reply:
            raise failure_from(reply["error"])
        return reply

    async def _undo_late_create(self, body: dict[str, Any], reply: dict[str, Any]) -> None:
        """A create whose answer came with (or after) its caller's cancellation started an
        upload nobody will record: abort it now, within the cleanup bound, rather than leave
        it to the orphan sweep (``orphan_grace_s`` later, on this node's next start)."""
        if body.get("operation") != "create_multipart_upload" or "error" in reply:
            return
        upload_id = from_message(reply.get("answer", {})).get("UploadId")
        if not upload_id:
            return
        params = {"Bucket": body["params"]["Bucket"], "Key": body["params"]["Key"],
                  "UploadId": upload_id}
        what = f"aborting the upload of {params['Key']} begun as it was cancelled"
        try:
            async with asyncio.timeout(self._client.cleanup_timeout_s):
                await self._request({"op": "call", "what": what,
                                     "operation": "abort_multipart_upload", "params": params},
                                    None, what)
        except (BackendError, OSError, TimeoutError) as exc:
            log_event(log, logging.WARNING, "s3_upload_left", key=params["Key"],
                      upload_id=upload_id, error=str(exc) or type(exc).__name__)

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
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await worker.proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                await worker.proc.wait()


def open_sender(client: S3Client, config: DestinationConfig, node_id: str,
                workers: int) -> PartSender:
    if workers == 0:
        return InProcessSender(client)
    return WorkerSenders(client, config, node_id, workers)
