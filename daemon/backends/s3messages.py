"""The messages between the daemon and its S3 upload workers (s3pool.py, s3worker.py): one
JSON object per SOCK_SEQPACKET datagram, with fds attached (SCM_RIGHTS).

What does not fit in one datagram travels in a memfd attached to the message: a small
object's bytes each way (a part record or manifest written or read), and a request or an
answer longer than half a datagram (a Complete of thousands of parts, a page of a listing).
Whoever receives a message's fds owns them and closes them once read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

from ckptdrain.daemon.backends.s3bodies import in_thread
from ckptdrain.daemon.backends.s3errors import S3Failure

# A message is one SOCK_SEQPACKET datagram: requests and answers are a few hundred bytes.
MAX_MESSAGE_BYTES = 64 << 10
# A request or answer longer than this goes in a memfd (the datagram keeps room for the rest).
INLINE_MESSAGE_BYTES = MAX_MESSAGE_BYTES // 2
# Longest memfd a message may carry: a small object's bytes (get_bytes reads at most 64 MiB) or
# a spilled request or answer; a longer one is refused, not read.
MESSAGE_FD_MAX_BYTES = 256 << 20
# The longest message a failure's answer carries: as JSON (a character up to 12 bytes, as a
# surrogate pair's escapes) it stays within INLINE_MESSAGE_BYTES.
ERROR_MESSAGE_CHARS = 2000
# Up to this many bytes are copied into or out of a memfd on the loop; more, in a thread.
_COPY_ON_LOOP_BYTES = 64 << 10


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
    except (ValueError, RecursionError) as exc:  # nested too deep for json: malformed too
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a malformed message ({type(exc).__name__}: {exc})") from exc
    return obj, fds


def to_memfd(data: bytes | bytearray | memoryview) -> int:
    """A new memfd holding ``data`` (its fd, owned by the caller)."""
    fd = os.memfd_create("ckptdrain-s3-message", os.MFD_CLOEXEC)
    try:
        _write_all(fd, data)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def from_memfd(fd: int, limit: int) -> bytes:
    """All of the memfd ``fd`` (the caller still owns it); ValueError when longer than
    ``limit``."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise ValueError(f"a message's memfd holds {size} bytes, more than {limit}")
    pieces: list[bytes] = []
    got = 0
    while got < size:
        piece = os.pread(fd, size - got, got)
        if not piece:
            raise ValueError(f"a message's memfd ended at {got} of its {size} bytes")
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)


async def memfd_of(data: bytes | bytearray | memoryview) -> int:
    """:func:`to_memfd`, written in a thread when ``data`` is long (no byte copy of size on
    the loop). The memfd is made here, so a cancelled caller closes it: in_thread has waited
    for the thread's write by then."""
    if len(data) <= _COPY_ON_LOOP_BYTES:
        return to_memfd(data)
    fd = os.memfd_create("ckptdrain-s3-message", os.MFD_CLOEXEC)
    try:
        await in_thread(_write_all, fd, data)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def read_memfd(fd: int, limit: int) -> bytes:
    """:func:`from_memfd`, in a thread when the memfd is long."""
    if os.fstat(fd).st_size <= _COPY_ON_LOOP_BYTES:
        return from_memfd(fd, limit)
    data: bytes = await in_thread(from_memfd, fd, limit)
    return data


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def failure_message(exc: BaseException) -> dict[str, Any]:
    """How a worker reports a failed part (rebuilt by :func:`failure_from`), its message cut
    to fit one datagram (:func:`_fitting`)."""
    if isinstance(exc, S3Failure):
        return {"message": _fitting(str(exc)), "transient": exc.transient, "kind": exc.kind,
                "code": exc.code, "status": exc.status}
    if isinstance(exc, OSError):
        # The errno is sent apart: OSError(errno, message) puts "[Errno N]" in front again.
        return {"message": _fitting(exc.strerror or str(exc)), "oserror": exc.errno or 0}
    return {"message": _fitting(f"{type(exc).__name__}: {exc}"), "transient": True,
            "kind": "io", "internal": True}


def _fitting(message: str) -> str:
    """``message`` cut in its middle to at most ERROR_MESSAGE_CHARS: its start says what
    failed, its end what to do. A failure's message carries the server's own, of any length,
    and an answer is not spilled into a memfd. Found attacking the workers: an S3 error whose
    message was 300 KB made its answer too long to send (EMSGSIZE, dropped by the worker: the
    request waited for it, 650 s by default, while the worker answered every ping), and one
    over 64 KiB was cut by the daemon's read, which replaced the worker at every retry."""
    if len(message) <= ERROR_MESSAGE_CHARS:
        return message
    half = ERROR_MESSAGE_CHARS // 2
    return f"{message[:half]} [... {len(message) - 2 * half} characters cut ...] {message[-half:]}"


def failure_from(error: dict[str, Any]) -> BaseException:
    message = str(error.get("message", "the upload worker failed"))
    if "oserror" in error:
        return OSError(int(error["oserror"]), message)
    return S3Failure(message, transient=bool(error.get("transient", True)),
                     kind=str(error.get("kind", "io")), code=str(error.get("code", "")),
                     status=int(error.get("status", 0)))


@contextlib.contextmanager
def malformed(what: str) -> Iterator[None]:
    """Every reading of a worker's answer happens in here: whatever shape it has, a broken or
    hostile worker's answer is a transient S3Failure (the drain sends the request again),
    never an untyped exception that ends a generation as ``internal``."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError,
            OSError) as exc:
        raise S3Failure(f"{what}: the upload worker's answer was malformed "
                        f"({type(exc).__name__}: {exc}); the request will be sent again",
                        transient=True, kind="io") from exc


def failure_of_one(error: dict[str, Any]) -> S3Failure:
    """The failure one request of a batch got (workers report S3Failures only)."""
    failed = failure_from(error)
    if isinstance(failed, S3Failure):
        return failed
    return S3Failure(str(failed), transient=True, kind="io")
