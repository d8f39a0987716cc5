"""An S3 upload worker process (``python -m ckptdrain.daemon.backends.s3worker FD N``),
started and owned by the daemon's :class:`~ckptdrain.daemon.backends.s3pool.WorkerSenders`.

It reads one message with the destination's configuration, then serves part requests on the
SOCK_SEQPACKET socket ``FD``: each carries the staged file's fd and names a multipart part or a
whole object (PutObject), and is answered with the ETag and CRC64NVME, or with the error; or
it is one of the daemon's small requests (s3senders.SMALL_OPERATIONS: HEAD, create, complete,
abort, listings, small objects written, read and deleted), answered with botocore's answer as
JSON and, for a read, the object's bytes in a memfd; or, for ``ckptdrain restore --readers``,
a range of an object to read into the file whose fd it carries (s3ranges.py), answered with
the range's CRC64NVME. It exits when the daemon closes the socket or dies
(PR_SET_PDEATHSIG), so a ``kill -9`` of the daemon leaves no worker behind. A failure of one
part is that part's answer; nothing a part does ends the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from ckptdrain.daemon.backends.s3bodies import in_thread
from ckptdrain.daemon.backends.s3client import S3Client
from ckptdrain.daemon.backends.s3messages import (
    INLINE_MESSAGE_BYTES,
    MESSAGE_FD_MAX_BYTES,
    close_all,
    encode,
    failure_message,
    from_memfd,
    memfd_of,
    ready,
    receive_ready,
    send_message,
)
from ckptdrain.daemon.backends.s3ranges import Range, fetch_range, writer
from ckptdrain.daemon.backends.s3senders import (
    SMALL_OPERATIONS,
    Part,
    Whole,
    call_each,
    call_in_process,
    put_in_process,
    send_in_process,
    to_message,
)
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.filecopy import DRAIN_NICE

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(0)  # the daemon died before the prctl took effect


async def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    while True:
        try:
            return receive_ready(sock)
        except BlockingIOError:
            await ready(sock, write=False)


@dataclass
class _Request:
    """One request from the daemon: the staged file's fd, if it came with one, is owned here
    until the request is done (its answer names ``id``)."""

    id: int
    body: dict[str, Any]
    fd: int | None


async def _call(client: S3Client, request: _Request) -> dict[str, Any]:
    """One small request; its answer's fields, with ``_fds``: the memfds the answer carries
    (owned by the answer until it is sent)."""
    body = request.body
    data: bytes | None = None
    if body.get("spilled") or body.get("body"):
        if request.fd is None:
            raise ValueError("a request's memfd did not come with it")
        held: bytes = await in_thread(from_memfd, request.fd, MESSAGE_FD_MAX_BYTES)
        if body.get("spilled"):
            body = json.loads(held)
        else:
            data = held
    operation = str(body["operation"])
    if operation not in SMALL_OPERATIONS:
        raise ValueError(f"{operation} is not sent by workers")
    if body.get("many"):
        # A batch (the commit's HEADs): each request's answer or its own failure, without
        # the HTTP headers botocore keeps (ResponseMetadata: about 1 KB a key, read by none).
        each = await call_each(client, str(body["what"]), operation,
                               [dict(p) for p in body["params"]])
        return await _answer_fields({"results": [
            {"error": failure_message(r)} if isinstance(r, BaseException)
            else {"answer": to_message({k: v for k, v in r.items() if k != "ResponseMetadata"})}
            for r in each]}, None)
    read_max = None if body.get("read_max") is None else int(body["read_max"])
    answer = await call_in_process(client, str(body["what"]), operation, dict(body["params"]),
                                   data, read_max)
    return await _answer_fields(to_message(answer),
                                None if read_max is None else answer["Body"])


async def _answer_fields(message: dict[str, Any], data: bytes | None) -> dict[str, Any]:
    """A small request's answer as message fields: ``message`` inline or, when longer than
    half a datagram, in a memfd; ``data`` (an object read) in a memfd of its own. ``_fds``:
    the memfds the answer carries (owned by the answer until it is sent)."""
    fds: list[int] = []
    try:
        fields: dict[str, Any] = {}
        if data is not None:
            fields["body_fd"] = len(fds)
            fds.append(await memfd_of(data))
        encoded = encode(message)
        if len(encoded) > INLINE_MESSAGE_BYTES:
            fields["answer_fd"] = len(fds)
            fds.append(await memfd_of(encoded))  # a long page of a listing
        else:
            fields["answer"] = message
    except BaseException:
        close_all(fds)
        raise
    return {**fields, "_fds": fds}


async def _work(client: S3Client, request: _Request) -> dict[str, Any]:
    """What the request asks for; its answer's fields."""
    body = request.body
    if body.get("op") == "call":
        return await _call(client, request)
    if request.fd is None:
        raise ValueError("a body request came without its file's descriptor")
    if body.get("op") == "range":
        rng = Range(key=str(body["key"]), full=str(body["full"]), offset=int(body["offset"]),
                    length=int(body["length"]), etag=str(body["etag"]))
        crc = await fetch_range(client, rng, writer(request.fd, on_loop=bool(body["on_loop"])))
        return {"crc": crc}
    if body.get("op") == "put":
        whole = Whole(key=str(body["key"]), full=str(body["full"]), size=int(body["size"]),
                      metadata=dict(body["metadata"]), exclusive=bool(body["exclusive"]))
        put = await put_in_process(client, whole, request.fd)
        return {"crc": put.crc, "etag": put.etag}
    part = Part(key=str(body["key"]), full=str(body["full"]),
                upload_id=str(body["upload_id"]), number=int(body["number"]),
                offset=int(body["offset"]), length=int(body["length"]),
                kept_crc=body.get("kept_crc"), kept_etag=str(body.get("kept_etag", "")))
    sent = await send_in_process(client, part, request.fd)
    return {"etag": sent.etag, "crc": sent.crc, "uploaded": sent.uploaded}


async def _answer(client: S3Client, request: _Request) -> dict[str, Any]:
    try:
        return {"id": request.id, **await _work(client, request)}
    except Exception as exc:  # the boundary of one request: its answer, never the worker's end
        return {"id": request.id, "error": failure_message(exc)}


def _done(answers: asyncio.Queue[dict[str, Any]], tasks: dict[int, asyncio.Task[Any]],
          request: _Request, task: asyncio.Task[dict[str, Any]]) -> None:
    """Every request ends here, however its task ended: finished, failed, cancelled while it
    ran, or cancelled before it ever started (when no code of its own runs). Its fd is closed
    and its answer queued, exactly once; the daemon waits for that answer."""
    tasks.pop(request.id, None)
    if request.fd is not None:
        os.close(request.fd)  # the task's threads are done with it: in_thread waits for them
        request.fd = None
    if task.cancelled():
        answers.put_nowait({"id": request.id, "error": {"message": "cancelled",
                                                        "transient": True, "kind": "io"}})
    else:
        answers.put_nowait(task.result())


async def _send_answers(sock: socket.socket, answers: asyncio.Queue[dict[str, Any]]) -> None:
    while True:
        answer = await answers.get()
        fds: list[int] = answer.pop("_fds", [])
        try:
            with contextlib.suppress(OSError, TimeoutError):
                await send_message(sock, answer, fds, timeout_s=30.0)
        finally:
            close_all(fds)  # sent or not: the daemon holds its own copies


async def serve(sock: socket.socket) -> None:
    sock.setblocking(False)
    first = await _receive(sock)
    if first is None:
        return
    setup, fds = first
    for fd in fds:
        os.close(fd)
    client = S3Client(DestinationConfig.model_validate(setup["config"]), str(setup["node_id"]),
                      file_bodies=True)
    await client.warm_up()
    # What starting cost (imports, botocore's service model): the daemon logs it, so an
    # operator sees a slow start and a benchmark can tell this fixed cost from the drain's.
    main_thread_cpu_s = time.thread_time()  # first: the process's figure includes it
    with contextlib.suppress(OSError, TimeoutError):
        await send_message(sock, {"started": {"cpu_s": time.process_time(),
                                              "main_thread_cpu_s": main_thread_cpu_s}},
                           timeout_s=10.0)
    tasks: dict[int, asyncio.Task[Any]] = {}
    answers: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    try:
        async with asyncio.TaskGroup() as tg:
            sender = tg.create_task(_send_answers(sock, answers))
            while True:
                got = await _receive(sock)
                if got is None:
                    break  # the daemon closed the socket: stop
                message, fds = got
                if message.get("op") == "ping":
                    # Answered from this loop, not a task: proof that the loop still runs.
                    close_all(fds)
                    answers.put_nowait({"id": int(message["id"])})
                    continue
                if "cancel" in message:
                    for fd in fds:
                        os.close(fd)
                    task = tasks.get(int(message["cancel"]))
                    if task is not None:
                        task.cancel()
                    continue
                if len(fds) > 1:
                    for fd in fds:
                        os.close(fd)
                    continue
                request = _Request(int(message["id"]), message, fds[0] if fds else None)
                task = tg.create_task(_answer(client, request))
                tasks[request.id] = task
                task.add_done_callback(functools.partial(_done, answers, tasks, request))
            for task in tasks.values():
                task.cancel()
            sender.cancel()
    finally:
        await client.aclose()


def main(argv: list[str]) -> int:
    _die_with_parent()
    # systemd signals the whole unit at stop: the daemon decides when its workers end (it
    # closes their sockets); a worker that outlives it dies of PR_SET_PDEATHSIG.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The drain yields to the daemon's hand-offs (filecopy.yield_to_handoffs says why); a
    # restore's reader is what a job waits on, and does not.
    if (argv[3] if len(argv) > 3 else "upload") != "reader":
        with contextlib.suppress(OSError):
            os.nice(DRAIN_NICE)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"s3worker[{argv[2] if len(argv) > 2 else '?'}] %(message)s")
    sock = socket.socket(fileno=int(argv[1]))
    try:
        import uvloop

        uvloop.run(serve(sock))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(serve(sock))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
