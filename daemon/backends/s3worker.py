"""An S3 upload worker process (``python -m ckptdrain.daemon.backends.s3worker FD N``),
started and owned by the daemon's :class:`~ckptdrain.daemon.backends.s3pool.WorkerSenders`.

It reads one message with the destination's configuration, then serves part requests on the
SOCK_SEQPACKET socket ``FD``: each carries the staged file's fd and names a multipart part or a
whole object (PutObject), and is answered with the ETag and CRC64NVME, or with the error; or
it is a small request without a body (HEAD, create, complete, abort), answered with botocore's
answer as JSON. It exits when the daemon closes the socket or dies
(PR_SET_PDEATHSIG), so a ``kill -9`` of the daemon leaves no worker behind. A failure of one
part is that part's answer; nothing a part does ends the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import sys
from typing import Any

from ckptdrain.daemon.backends.s3client import S3Client
from ckptdrain.daemon.backends.s3pool import failure_message, ready, receive_ready, send_message
from ckptdrain.daemon.backends.s3senders import (
    CONTROL_OPERATIONS,
    Part,
    Whole,
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


async def _serve_part(client: S3Client, sock: socket.socket, request: dict[str, Any],
                      fd: int) -> None:
    request_id = request["id"]
    answer: dict[str, Any]
    try:
        if request.get("op") == "put":
            whole = Whole(key=str(request["key"]), full=str(request["full"]),
                          size=int(request["size"]), metadata=dict(request["metadata"]),
                          exclusive=bool(request["exclusive"]))
            answer = {"id": request_id, "crc": await put_in_process(client, whole, fd)}
        else:
            part = Part(key=str(request["key"]), full=str(request["full"]),
                        upload_id=str(request["upload_id"]), number=int(request["number"]),
                        offset=int(request["offset"]), length=int(request["length"]),
                        kept_crc=request.get("kept_crc"),
                        kept_etag=str(request.get("kept_etag", "")))
            sent = await send_in_process(client, part, fd)
            answer = {"id": request_id, "etag": sent.etag, "crc": sent.crc,
                      "uploaded": sent.uploaded}
    except asyncio.CancelledError:
        answer = {"id": request_id, "error": {"message": "cancelled", "transient": True,
                                              "kind": "io"}}
    except Exception as exc:  # the boundary of one part: its answer, never the worker's end
        answer = {"id": request_id, "error": failure_message(exc)}
    finally:
        os.close(fd)
    with contextlib.suppress(OSError, TimeoutError):
        await send_message(sock, answer, timeout_s=30.0)


async def _serve_call(client: S3Client, sock: socket.socket, request: dict[str, Any]) -> None:
    """One small request (HEAD, create, complete, abort) sent for the daemon."""
    request_id = request["id"]
    answer: dict[str, Any]
    try:
        operation = str(request["operation"])
        if operation not in CONTROL_OPERATIONS:
            raise ValueError(f"{operation} is not sent by workers")
        params = dict(request["params"])
        answer = {"id": request_id, "answer": to_message(
            await client._call(str(request["what"]), operation, **params))}
    except asyncio.CancelledError:
        answer = {"id": request_id, "error": {"message": "cancelled", "transient": True,
                                              "kind": "io"}}
    except Exception as exc:  # the boundary of one request: its answer, never the worker's end
        answer = {"id": request_id, "error": failure_message(exc)}
    with contextlib.suppress(OSError, TimeoutError):
        await send_message(sock, answer, timeout_s=30.0)


def _forget(tasks: dict[int, asyncio.Task[None]], request_id: int, _: object) -> None:
    tasks.pop(request_id, None)


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
    tasks: dict[int, asyncio.Task[None]] = {}
    try:
        async with asyncio.TaskGroup() as tg:
            while True:
                got = await _receive(sock)
                if got is None:
                    break  # the daemon closed the socket: stop
                request, fds = got
                if "cancel" in request:
                    for fd in fds:
                        os.close(fd)
                    task = tasks.get(int(request["cancel"]))
                    if task is not None:
                        task.cancel()
                    continue
                request_id = int(request["id"])
                if request.get("op") == "call" and not fds:
                    task = tg.create_task(_serve_call(client, sock, request))
                elif len(fds) == 1:
                    task = tg.create_task(_serve_part(client, sock, request, fds[0]))
                else:
                    for fd in fds:
                        os.close(fd)
                    continue
                tasks[request_id] = task
                task.add_done_callback(functools.partial(_forget, tasks, request_id))
            for task in tasks.values():
                task.cancel()
    finally:
        await client.aclose()


def main(argv: list[str]) -> int:
    _die_with_parent()
    # systemd signals the whole unit at stop: the daemon decides when its workers end (it
    # closes their sockets); a worker that outlives it dies of PR_SET_PDEATHSIG.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The drain yields to the daemon's hand-offs (filecopy.yield_to_handoffs says why).
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
