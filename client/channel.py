"""One connection to the node's daemon: the socket, its hello, and one request and its reply
at a time, framed and checked by the sans-IO machine in :mod:`ckptdrain.client.wire`; and
what a failed connect means. Where the daemon's socket is, and whether its listener is
trusted, is :mod:`ckptdrain.client.daemonsocket`'s."""

from __future__ import annotations

import array
import contextlib
import errno
import os
import socket
import stat
import time
from typing import Any

from ckptdrain.client import forks, pipes, wire
from ckptdrain.client.daemonsocket import check_listener
from ckptdrain.client.errors import (
    DaemonUnavailable,
    DrainError,
    PermissionDenied,
    Timeout,
    UnsupportedVersion,
    error_for_code,
)

# Replies are headers only (at most 64 KiB); one reused buffer per connection reads them.
_RECV_BUFFER_BYTES = 64 * 1024
# After the daemon closed on us mid-send, how long to look for the error reply that says why.
_REFUSAL_GRACE_S = 5.0
# Requests the daemon may hold while it waits for room, up to its limits.block_timeout_s (300 s
# by default, as timeout_s is): their answer is waited for a little past timeout_s, so that
# the daemon's backpressure answer at the end of its wait comes before the client gives up
# (found attacking: with the two equal, a put on a full node raised Timeout and broke the
# connection instead of raising Backpressure).
_MAY_WAIT_FOR_ROOM = frozenset({"begin", "put", "put_bytes", "put_fd", "put_memfd"})
# Room for the fds a reply may carry (one, for `open`; more are closed unread).
_ANC_BYTES = socket.CMSG_SPACE(4 * array.array("i").itemsize)
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # EPIPE as an error, never a SIGPIPE


def _hint(path: str) -> str:
    return f"start it with `ckptdrain serve` or set CKPTDRAIN_SOCKET (tried {path})"


def _not_a_socket(path: str) -> str:
    """What ``path`` is when it is no socket: connect() refuses a directory or a file as it
    refuses a socket nobody listens on, and "nothing is listening on it; start it" sent an
    operator whose --socket named the config file to start a running daemon (found as one)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""
    if stat.S_ISSOCK(mode):
        return ""
    return "a directory" if stat.S_ISDIR(mode) else "a file"


def connect_error(path: str, exc: OSError) -> DrainError:
    """The typed error for a failed connect() to the daemon's socket."""
    if isinstance(exc, PermissionError):
        return PermissionDenied(
            f"not allowed to connect to the ckptdrain daemon socket at {path} ({exc.strerror}); "
            "ask the operator to add your user or group to the socket's group or [access] "
            "allowed_uids/allowed_gids"
        )
    if isinstance(exc, TimeoutError):
        return Timeout(
            f"the ckptdrain daemon at {path} did not accept a connection in time; "
            "it may be overloaded or hung: check `ckptdrain status` and its logs"
        )
    if isinstance(exc, FileNotFoundError):
        reason = "no socket there"
    elif isinstance(exc, ConnectionRefusedError):
        what = _not_a_socket(path)
        if what:
            return DaemonUnavailable(f"cannot reach the ckptdrain daemon at {path}: it is "
                                     f"{what}, not a socket; point CKPTDRAIN_SOCKET (or "
                                     "--socket) at the daemon's socket, `socket` in its config")
        reason = "nothing is listening on it"
    else:
        reason = exc.strerror or str(exc)
    return DaemonUnavailable(
        f"cannot reach the ckptdrain daemon at {path}: {reason}; {_hint(path)}"
    )


def socket_error(path: str, exc: OSError) -> DrainError:
    """The typed error for a socket this process could not make (its fd table full: EMFILE,
    the node's: ENFILE; memory short): no connection to the daemon can be opened now. The bare
    OSError went up before, outside DrainError, from every call that opens a connection
    (``begin``, ``latest``, ``wait``, ``DrainWriter``'s save; found attacking a rank at a low
    RLIMIT_NOFILE)."""
    return DaemonUnavailable(
        f"cannot open a connection to the ckptdrain daemon at {path}: this process could not "
        f"make a socket ({exc.strerror or exc}); close file descriptors it no longer needs, or "
        "raise its RLIMIT_NOFILE (`ulimit -n`), and retry",
        details={"errno": exc.errno},
    )


# A Unix socket's connect with a timeout fails at once with EAGAIN while the daemon's listen
# backlog is full (a burst of connects, or another user flooding it), where a blocking one
# would wait for room: tried again, backing off, until the timeout.
_BACKLOG_RETRY_FIRST_S = 0.001
_BACKLOG_RETRY_MAX_S = 0.05


def _room_grace_s(limit_s: float) -> float:
    """How long past ``limit_s`` the answer of a request that may wait for room is waited for."""
    return min(30.0, max(2.0, limit_s / 10))


def reply_grace_s(kind: str, limit_s: float) -> float:
    """How long past ``limit_s`` the reply to a ``kind`` request is waited for: a request that
    may wait for room, and a ``wait`` (whose daemon reads the destination around its timer),
    get a tenth more, 2 to 30 s; any other none."""
    return _room_grace_s(limit_s) if kind in _MAY_WAIT_FOR_ROOM or kind == "wait" else 0.0


def _connect(sock: socket.socket, path: str, timeout_s: float) -> None:
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    pause = _BACKLOG_RETRY_FIRST_S
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError as exc:
            left = deadline - time.monotonic()
            if left <= 0:  # the backlog stayed full: as a connect that timed out
                raise connect_error(path, TimeoutError(exc.errno, exc.strerror)) from exc
            time.sleep(min(pause, left))
            pause = min(pause * 2, _BACKLOG_RETRY_MAX_S)
        except OSError as exc:
            raise connect_error(path, exc) from exc


class Channel:
    """One connection to the daemon after hello/welcome: sends requests, reads replies."""

    def __init__(self, sock: socket.socket, path: str, timeout_s: float) -> None:
        self._sock = sock
        self.path = path
        self.timeout_s = timeout_s
        self._wire = wire.Connection(wire.Role.CLIENT)
        self._buffer = bytearray(_RECV_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self.broken: DrainError | None = None
        self.node_id = ""
        self._fds: list[int] = []  # fds that came with replies (`open`)
        self._fds_dropped = False  # the kernel dropped some (MSG_CTRUNC: our fd table full)
        forks.register(self)

    @classmethod
    def open(cls, path: str, *, timeout_s: float, connect_timeout_s: float) -> Channel:
        with forks.creating():  # a fork never falls between the socket and its registration
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError as exc:
                raise socket_error(path, exc) from exc
            channel = cls(sock, path, timeout_s)
        # One deadline for the connect and the `hello`: a connect that waited out a full
        # backlog leaves the hello only what is left (found attacking: open took twice
        # connect_timeout_s).
        deadline = time.monotonic() + connect_timeout_s
        try:
            _connect(sock, path, connect_timeout_s)
            check_listener(sock, path)
        except BaseException:
            channel.close()
            raise
        try:
            welcome = channel.request(
                "hello",
                {"version": wire.PROTOCOL_VERSION, "client": f"ckptdrain-python pid={os.getpid()}"},
                timeout_s=max(0.001, deadline - time.monotonic()),
            )
            version = welcome.get("version")
            if version != wire.PROTOCOL_VERSION:
                raise UnsupportedVersion(
                    f"the ckptdrain daemon at {path} speaks protocol version {version}, this "
                    f"client speaks {wire.PROTOCOL_VERSION}; install matching versions"
                )
            channel.node_id = str(welcome.get("node_id", ""))
        except BaseException:
            channel.close()
            raise
        return channel

    def _forget_in_child(self) -> None:
        """In a child just forked (forks.py): close this process's copy of the socket (and of
        fds that came with replies), so that the parent's end is the only one left."""
        self.broken = DaemonUnavailable(
            "this connection belongs to the process this one was forked from")
        with contextlib.suppress(OSError):
            self._sock.close()
        self._drop_fds()

    @property
    def awaiting_data(self) -> bool:
        return self._wire.awaiting_data is not None

    def close(self) -> None:
        if self.broken is None:
            self.broken = DaemonUnavailable(f"connection to {self.path} was closed")
        self._sock.close()
        self._view.release()
        self._drop_fds()

    def _drop_fds(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def request_fd(
        self, kind: str, fields: dict[str, Any], *, started: float | None = None
    ) -> tuple[dict[str, Any], int]:
        """A request whose ``ok`` reply hands over one file descriptor (now the caller's)."""
        self._drop_fds()
        self._fds_dropped = False
        try:
            reply = self.request(kind, fields, started=started)
            if not self._fds and self._fds_dropped:
                # The kernel could not install the passed fd: this process's fd table is full
                # (EMFILE). It was "the daemon answered with 0 file descriptors ... check that
                # client and daemon versions match" (found attacking a resume at a low
                # RLIMIT_NOFILE).
                raise DaemonUnavailable(
                    f"the ckptdrain daemon at {self.path} passed a file descriptor for "
                    f"{kind!r} that this process could not take (the kernel dropped it: its "
                    "fd table is full); close file descriptors it no longer needs, or raise its "
                    "RLIMIT_NOFILE (`ulimit -n`), and retry",
                    details={"errno": errno.EMFILE},
                )
            if len(self._fds) != 1:
                raise DrainError(
                    f"the ckptdrain daemon answered {kind!r} with {len(self._fds)} file "
                    "descriptors, not one; check that client and daemon versions match"
                )
            return reply, self._fds.pop()
        finally:
            self._drop_fds()

    def is_reusable(self) -> bool:
        """Whether an idle connection still looks open (the daemon drops idle clients)."""
        if self.broken is not None:
            return False
        try:
            # Non-blocking mode: with a timeout set, Python would first wait for readability.
            self._sock.setblocking(False)
            data = self._sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        # EOF, or bytes nobody asked for: either way the conversation is over.
        del data
        return False

    def request(
        self,
        kind: str,
        fields: dict[str, Any],
        *,
        payload: memoryview | None = None,
        fd: int | None = None,
        pipe: pipes.PipeHandOff | None = None,
        timeout_s: float | None = None,
        started: float | None = None,
    ) -> dict[str, Any]:
        """Send one request and return the fields of its ``ok`` (or ``welcome``) reply.

        An ``error`` reply raises its typed error and leaves the connection usable; any other
        failure raises and leaves it broken (``self.broken`` says why). With ``pipe`` (a
        ``data_pipe``), its read end goes with the frame and the rest of the shard is spliced
        in before the reply is read; the caller closes the pipe. ``started`` (monotonic) is
        when the caller's call began, when that was before this request (a connection opened
        for it): the time since counts against ``timeout_s``.
        """
        if self.broken is not None:
            raise self.broken
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = (time.monotonic() if started is None else started) + limit_s
        if kind == "wait":
            # The daemon times a wait itself: its request (a few bytes) may go out for as
            # long as its answer is waited for. Sent by the caller's timeout_s, a wait of
            # timeout_s=0 (a poll) raised Timeout before asking, of a committed step too.
            deadline += reply_grace_s(kind, limit_s)
        try:
            header = self._wire.send(kind, fields, len(payload) if payload is not None else 0)
        except wire.ProtocolError as exc:
            # Only this module sends, so this is a bug here or an interrupted put/data pair:
            # either way the conversation cannot go on.
            self.broken = DrainError(f"cannot send {kind!r} to the ckptdrain daemon: {exc.message}")
            self._sock.close()
            raise self.broken from exc
        message: wire.Message
        try:
            try:
                if pipe is None:
                    self._send(header, payload, fd, deadline)
                else:
                    self._send(header, None, pipe.read_fd, deadline)
                    pipe.handed_over()
                    pipe.finish(deadline, self._sock.fileno())
            except (BrokenPipeError, ConnectionResetError):
                # The daemon may refuse a request and close without reading the rest of it
                # (a shard it cannot stage): its reply is still readable and says why.
                message = self._read_reply(min(deadline, time.monotonic() + _REFUSAL_GRACE_S))
                self.broken = DaemonUnavailable(
                    f"the ckptdrain daemon at {self.path} closed the connection during {kind!r}"
                )
                if message.kind == "error":
                    raise self._error_from(message) from None
                raise self.broken from None
            if kind != "wait":
                deadline += reply_grace_s(kind, limit_s)
            message = self._read_reply(deadline)
        except DrainError as exc:
            if self.broken is None:
                self.broken = exc
            self._sock.close()
            raise
        except TimeoutError as exc:
            self.broken = Timeout(
                # Not "see `ckptdrain status`": that may be the call that just timed out
                # (found attacking a stopped daemon).
                f"the ckptdrain daemon at {self.path} did not finish {kind!r} within "
                f"{limit_s:.3g} s; it may be overloaded or hung (its log says which, e.g. "
                "`journalctl -u ckptdrain.service`), or timeout_s is too short for the request"
            )
            self._sock.close()
            raise self.broken from exc
        except OSError as exc:
            self.broken = DaemonUnavailable(
                f"lost the connection to the ckptdrain daemon at {self.path} during {kind!r} "
                f"({exc.strerror or exc}); {_hint(self.path)}"
            )
            self._sock.close()
            raise self.broken from exc
        except wire.ProtocolError as exc:
            self.broken = DrainError(
                f"the ckptdrain daemon at {self.path} sent an invalid reply to {kind!r} "
                f"({exc.message}); check that client and daemon versions match"
            )
            self._sock.close()
            raise self.broken from exc
        except BaseException:
            # Interrupted (KeyboardInterrupt...) mid-request: the stream is out of step.
            self.broken = DaemonUnavailable(f"a request to {self.path} was interrupted")
            self._sock.close()
            raise
        if message.kind == "error":
            raise self._error_from(message)
        # Typed here: `mypy client` cannot follow the editable install's ckptdrain.* mapping.
        reply: dict[str, Any] = message.fields
        return reply

    def _error_from(self, message: wire.Message) -> DrainError:
        fields = message.fields
        return error_for_code(fields["code"], fields["message"], fields.get("details"))

    def _settimeout(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        self._sock.settimeout(remaining)

    def _send(
        self, header: bytes, payload: memoryview | None, fd: int | None, deadline: float
    ) -> None:
        self._settimeout(deadline)
        if fd is None:
            self._sock.sendall(header, _SEND_FLAGS)
        else:
            # The fd rides with the first byte of the frame, so the daemon receives it with the
            # recvmsg() that starts this frame and pairs it with this message.
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            sent = self._sock.sendmsg([header], rights, _SEND_FLAGS)
            if sent < len(header):
                self._settimeout(deadline)
                self._sock.sendall(memoryview(header)[sent:], _SEND_FLAGS)
        if payload is not None and len(payload):
            # Straight from the caller's buffer: no copy of the shard on this side.
            self._settimeout(deadline)
            self._sock.sendall(payload, _SEND_FLAGS)

    def _read_reply(self, deadline: float) -> wire.Message:
        while True:
            event = self._wire.next_event()
            if event is wire.NEED_DATA:
                self._settimeout(deadline)
                try:
                    n, anc, flags, _ = self._sock.recvmsg_into([self._view], _ANC_BYTES)
                except ConnectionResetError:
                    # Linux reports a peer that closed with our bytes unread so.
                    n, anc, flags = 0, [], 0
                if flags & socket.MSG_CTRUNC:
                    self._fds_dropped = True
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds = array.array("i")
                        fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
                        self._fds.extend(fds)
                self._wire.receive_data(self._view[:n])
            elif isinstance(event, wire.Message):
                return event
            elif isinstance(event, wire.ConnectionClosed):
                raise DaemonUnavailable(
                    f"the ckptdrain daemon at {self.path} closed the connection without a "
                    f"reply; it may be stopping or have refused this client; {_hint(self.path)}"
                )
            else:  # pragma: no cover - the server role never sends payloads (wire checks)
                raise wire.ProtocolError(wire.BAD_REQUEST, f"unexpected {event!r}")
