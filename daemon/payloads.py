"""A shard's bytes as they come on the socket: the ``data`` frame of an admitted ``put``, or
the payload of a ``put_bytes`` frame (a small shard, in one round trip).

Both are paced by the client's rate floor from the moment the bytes are due, so a client
whose bytes never come, or trickle, is cut off in ``client_rate_grace_s + size /
client_min_bytes_per_s`` at most. A data frame's bytes go to the staged file (those already
buffered in one data-plane call, the rest through the socket pump's thread); a ``put_bytes``
payload, at most ``wire.INLINE_MAX_BYTES``, is read whole before its request is decided, so
that a refusal leaves the conversation at a frame boundary.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptdrain.client import wire
from ckptdrain.client.wire import PayloadChunk, PayloadEnd, ProtocolError
from ckptdrain.daemon.channel import IdleTimeout, TooSlow
from ckptdrain.daemon.dataplane import (
    Cancelled,
    ClientIdle,
    ClientTooSlow,
    PumpStalled,
    readable,
    write_all,
)
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.pumps import POLL_SLICE_S, PipeEnded, PipeOverrun, PipePump, SocketPump

if TYPE_CHECKING:
    from ckptdrain.daemon.connection import ClientHandler
    from ckptdrain.daemon.server import Daemon


def _joined(chunks: list[memoryview]) -> bytes | memoryview | None:
    return None if not chunks else chunks[0] if len(chunks) == 1 else b"".join(chunks)


@contextlib.contextmanager
def _due(h: ClientHandler) -> Iterator[None]:
    """The bytes are due: paced by the rate floor until they are in."""
    h.receiving_payload = True
    h.channel.begin_transfer()
    try:
        yield
    finally:
        h.receiving_payload = False
        h.channel.end_transfer()


async def receive_inline(h: ClientHandler) -> bytes | memoryview:
    """All of the payload of the ``put_bytes`` frame just read."""
    chunks: list[memoryview] = []
    with _due(h):
        while True:
            event = h.conn.next_event()
            if event is wire.NEED_DATA:
                await h.receive_more()
            elif isinstance(event, PayloadChunk):
                chunks.append(event.data)
            elif isinstance(event, PayloadEnd):
                return _joined(chunks) or b""
            else:
                raise ProtocolError(wire.BAD_REQUEST, f"unexpected {event!r} inside a payload")


async def receive_data(d: Daemon, h: ClientHandler, fd: int, size: int,
                       path: str, pipe: bool) -> bytes | memoryview | None:
    """The admitted shard's data frame, into ``fd``. Returns the payload unwritten when all
    of it came with what was buffered (the caller writes it with the rename, one data-plane
    call for both), else None (all written to ``fd``)."""
    with _due(h):
        return await _receive_data_frame(d, h, fd, size, path, pipe)


async def _receive_data_frame(d: Daemon, h: ClientHandler, fd: int, size: int,
                              path: str, pipe: bool) -> bytes | memoryview | None:
    msg = await h.next_message()
    if msg is None:
        raise ConnectionError(f"client left before sending the bytes of {path!r}")
    if msg.kind == "data_pipe":
        if not pipe:
            h.channel.close_fd(h.channel.take_frame_fd("data_pipe"))
            raise RequestError(wire.BAD_REQUEST, f"no pipe was offered for {path!r} (the put's "
                               "ok said \"pipe\": false: limits.pipe_handoff is off, or a pipe "
                               "of this uid's wedged a hand-off); send its bytes as 'data'")
        await _receive_pipe(d, h, fd, size, path)
        return None
    if msg.kind != "data":
        raise ProtocolError(wire.BAD_REQUEST, f"expected the data frame of {path!r}, got {msg.kind!r}")
    if msg.payload_len != size:
        raise ProtocolError(wire.SIZE_MISMATCH, f"shard {path!r} declared {size} bytes but the "
                            f"data frame carries {msg.payload_len}")
    conn = h.conn
    # What the wire machine had already buffered (at most one receive buffer; the chunks
    # are copies it handed over) is written in one call, then the pump takes the rest.
    buffered: list[memoryview] = []
    ended = False
    while conn.buffered or conn.payload_remaining == 0:
        event = conn.next_event()
        if isinstance(event, PayloadChunk):
            buffered.append(event.data)
            continue
        if not isinstance(event, PayloadEnd):
            raise ProtocolError(wire.BAD_REQUEST, f"unexpected {event!r} inside a payload")
        ended = True
        break
    data = _joined(buffered)
    if ended:
        return data
    if data is not None:
        await d.dataplane.call(write_all, fd, data)
    want = conn.payload_remaining
    # The byte pump runs in a thread of its own: splice socket -> pipe -> file. The wire
    # machine is told afterwards what bypassed it.
    await _run_pump(d, h, h.channel.socket_pump(), fd, want)
    conn.payload_consumed(want)
    if not isinstance(end := conn.next_event(), PayloadEnd):
        raise ProtocolError(wire.BAD_REQUEST, f"unexpected {end!r} after a payload")
    return None


async def _run_pump(d: Daemon, h: ClientHandler, pump: SocketPump | PipePump, fd: int,
                    want: int) -> None:
    cancel = threading.Event()
    idle_s, floor = h.channel.idle_timeout_s, h.channel.transfer
    # The pump's own copy of the staged file's fd: a pump given up on (stalled) may still be
    # inside a system call on it when the hand-off closes and unlinks its file.
    try:
        out = os.dup(fd)
    except OSError:
        pump.never_started(h.channel.close_fd)
        raise

    def run() -> int:
        try:
            return pump.pump(out, want, idle_s, cancel, floor)
        finally:
            os.close(out)

    stall_s = idle_s + POLL_SLICE_S
    pump.arm()
    try:
        # Only a client's pipe can wedge a pump by its client's doing: its uid is blamed (and
        # offered no pipe meanwhile); a socket pump stalls on our own disk.
        pipe = isinstance(pump, PipePump)
        await d.dataplane.pump(run, cancel=cancel, stalled=lambda: pump.stalled(stall_s),
                               pipe=pipe, owner=h.uid if pipe else None, running=pump.running)
    except PumpStalled as exc:
        # Answered; a data frame's connection then ends (its bytes are out of step), a
        # data_pipe's goes on (its frame was whole).
        raise RequestError(wire.TIMEOUT, f"{exc} for {stall_s:g} s; the hand-off is given up "
                           "on, and its thread is counted as stuck in `ckptdrain status`"
                           ) from None
    except (PipeEnded, PipeOverrun) as exc:
        # The frame is whole: the client hears why, and the conversation goes on.
        raise RequestError(wire.SIZE_MISMATCH, str(exc)) from None
    except ClientTooSlow as exc:
        raise TooSlow(str(exc)) from None
    except ClientIdle as exc:
        raise IdleTimeout(str(exc)) from None
    except Cancelled:
        raise ConnectionError("hand-off cancelled") from None


async def _receive_pipe(d: Daemon, h: ClientHandler, fd: int, size: int, path: str) -> None:
    """A ``data_pipe`` frame: the shard's bytes through the pipe whose read end came with it
    (the client vmsplice()s its buffer in, so the one copy is the kernel's into ``fd``)."""
    pipe_fd = h.channel.take_frame_fd("data_pipe")
    try:
        # In the data plane: a client's fd may be anything, even a file on a hung mount.
        # Closed off the loop too (close_fd): the last close of a pipe takes its lock.
        is_read_end = await d.dataplane.client_call(h.uid, _pipe_read_end, pipe_fd,
                                                    cleanup=lambda: h.channel.close_fd(pipe_fd))
    except OSError as exc:
        raise RequestError(wire.BAD_REQUEST, f"the fd passed with data_pipe for {path!r} "
                           f"cannot be used ({exc.strerror or exc})") from None
    if not is_read_end:
        h.channel.close_fd(pipe_fd)
        raise RequestError(wire.BAD_REQUEST, f"the fd passed with data_pipe for {path!r} is "
                           "not the read end of a pipe; pass os.pipe()'s first fd, or send "
                           "'data'")
    # Owns the pipe from here, and closes it in its own thread as it returns.
    await _run_pump(d, h, PipePump(pipe_fd), fd, size)


def _pipe_read_end(fd: int) -> bool:
    # readable() turns away an O_PATH fd of a FIFO, which reads as O_RDONLY and cannot be
    # read: it answered `internal` (EBADF) with nothing logged (found attacking).
    return readable(fd) and stat.S_ISFIFO(os.fstat(fd).st_mode)
