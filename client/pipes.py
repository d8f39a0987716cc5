"""A shard's bytes to the daemon through a pipe, with ``vmsplice(2)``: one copy, not two.

Sent over the socket, a shard is copied twice: by this process into the socket's buffers,
and by the daemon from them into the staged file. ``vmsplice`` instead hands the kernel
references to this process's pages; the daemon splices them from the pipe into the staged
file, which is the only copy (as when a process writes its own file). The daemon offers it
in its ``ok`` to a ``put`` (``"pipe": true``); the read end travels with a ``data_pipe``
frame. The buffer must stay unchanged until the daemon answers, which ``put`` waits for.

Stdlib only (ctypes). Used only where it is safe: Linux with ``vmsplice`` in libc, and
SIGPIPE ignored (Python's default), because writing into a pipe whose reader has gone
raises SIGPIPE, which would otherwise end the process; elsewhere ``put`` sends ``data``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import select
import signal
import time
from collections.abc import Callable

from ckptdrain.client import forks

_SPLICE_F_NONBLOCK = 0x02
# The pipe's capacity: how much of the shard is in flight at once (the Linux default for an
# unprivileged process's F_SETPIPE_SZ ceiling, /proc/sys/fs/pipe-max-size).
_PIPE_BYTES = 1 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _PyBuffer(ctypes.Structure):
    # CPython's Py_buffer, stable since 3.3: to find where a read-only buffer (bytes) lies.
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def _load() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).vmsplice
        get = ctypes.pythonapi.PyObject_GetBuffer
        release = ctypes.pythonapi.PyBuffer_Release
    except (OSError, AttributeError):  # not Linux / not CPython: the socket it is
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_size_t, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    get.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    get.restype = ctypes.c_int
    release.argtypes = [ctypes.POINTER(_PyBuffer)]
    release.restype = None
    vmsplice: Callable[..., int] = fn
    return vmsplice


_vmsplice = _load()


def usable() -> bool:
    """Whether a put may go through a pipe from this process now."""
    return _vmsplice is not None and signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN


def _address(view: memoryview) -> int:
    """Where ``view``'s first byte lies. ``view`` holds its own export of the memory for as
    long as it lives (the put's), so the address stays valid after this lookup."""
    buf = _PyBuffer()
    if ctypes.pythonapi.PyObject_GetBuffer(view, ctypes.byref(buf), 0) != 0:
        raise BufferError("no buffer")
    try:
        return int(buf.buf or 0)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buf))


class PipeHandOff:
    """One shard's pipe: :meth:`start` before the ``data_pipe`` frame, :meth:`finish` after
    it, :meth:`close` always. Owns both ends until then (the read end goes to the daemon
    with the frame and is closed here right after)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._base = _address(view)
        self.sent = 0
        with forks.creating():  # a fork never falls between the pipe and its registration
            self.read_fd, self._write_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            forks.register(self)
        try:
            # Past the user's pipe quota (/proc/sys/fs/pipe-user-pages-soft) the kernel
            # refuses, and a small pipe would move the shard a few pages per call: then
            # the socket serves better (OSError: the caller sends `data`).
            granted = fcntl.fcntl(self._write_fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
            if granted < _PIPE_BYTES:
                raise OSError(errno.ENOSPC, f"a pipe of {granted} bytes")
        except OSError:
            self.close()
            raise

    @classmethod
    def start(cls, view: memoryview) -> PipeHandOff | None:
        """A pipe already holding the shard's first bytes, or None where the kernel will not
        take this buffer's pages (then the caller sends ``data``; nothing is on the wire)."""
        if not usable() or not view.nbytes:
            return None
        try:
            pipe = cls(view)
        except (OSError, BufferError):
            return None
        try:
            pipe._splice_some()
        except OSError:
            pipe.close()
            return None
        return pipe

    def handed_over(self) -> None:
        """The frame carrying the read end is sent: the daemon has its own copy of it."""
        # Forgotten before it is closed: a fork in between must not close in its child
        # whatever took the number meanwhile (the same in the closes below).
        fd, self.read_fd = self.read_fd, -1
        os.close(fd)

    def finish(self, deadline: float, reply_fd: int) -> None:
        """Splice the rest in, waiting for room until ``deadline``; then close the write end.
        The daemon's reply arriving early on ``reply_fd`` (its socket: a refusal mid-shard)
        ends it, and so does a reader that went away (EPIPE, unless a forked child of this
        process holds a read end too, hence the socket): the reply, read next, says why."""
        poller = select.poll()
        poller.register(self._write_fd, select.POLLOUT)
        poller.register(reply_fd, select.POLLIN)
        try:
            while self.sent < self._view.nbytes:
                try:
                    if self._splice_some():
                        continue
                except BrokenPipeError:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("the daemon did not take the shard's bytes in time")
                ready = poller.poll(max(1, int(remaining * 1000)))
                if any(fd == reply_fd for fd, _events in ready):
                    return
        finally:
            self._close_write()

    def _splice_some(self) -> int:
        assert _vmsplice is not None
        left = self._view.nbytes - self.sent
        iov = _Iovec(self._base + self.sent, left)
        n = _vmsplice(self._write_fd, ctypes.byref(iov), 1, _SPLICE_F_NONBLOCK)
        if n < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EINTR):
                return 0
            raise OSError(err, os.strerror(err))
        self.sent += n
        return n

    def _close_write(self) -> None:
        if self._write_fd >= 0:
            fd, self._write_fd = self._write_fd, -1
            os.close(fd)

    def _forget_in_child(self) -> None:
        """In a child just forked (forks.py): close this process's copies of the pipe. A
        write end kept by a long-lived child hid a killed parent from the daemon, which kept
        the parent's rank open until the child exited (found attacking)."""
        for fd in (self.read_fd, self._write_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.read_fd = self._write_fd = -1

    def close(self) -> None:
        self._close_write()
        if self.read_fd >= 0:
            fd, self.read_fd = self.read_fd, -1
            os.close(fd)
