"""Closing the fds clients pass, off the event loop, and charging each to the uid that passed it.

A close can block: a TCP socket lingering on unsent data, a FUSE file whose server holds the
flush, and the last close of a pipe waits for the pipe's lock, which the client that passed
it can hold for as long as it likes (a splice on it that never ends). So no passed fd is
closed on the loop or in a hand-off's thread: two shared threads close them, and a pipe, or a
socket that may have fds queued in it unread, is closed in a thread of its own.

Every passed fd is charged to its owner (the client's uid) from the moment it is received
until its close has returned (:meth:`FdCloser.fds_of`):

- a uid with :data:`MAX_PIPE_CLOSES_PER_UID` closes waiting is served no more till they end
  (connection.py, between requests);
- a uid holding :data:`MAX_FDS_HELD_PER_UID` fds received, not yet handed on or closed, is
  not read from at all (channel.py, before every read): the fds it sends meanwhile stay in
  flight in its sockets, the kernel's and the sender's, never in this process's fd table.
  Checked between requests only, 80 connections of one uid each waiting for its next frame
  received 4 locked pipes apiece before any count rose (found attacking);
- a uid's pipe closes take at most :data:`MAX_PIPE_CLOSE_THREADS_PER_UID` threads at once,
  the rest waiting their turn in that uid's own queue: one user's locked pipes filled every
  thread, and other users' pipes waited behind them (and were charged to them).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import os
import socket
import stat
import struct
import termios
import threading
from collections.abc import Callable

# Closes of clients' pipes (and sockets with fds queued unread) in threads of their own at
# once; past it, they wait for one.
MAX_PIPE_CLOSERS = 256
# Of those, one uid's at most: the others' closes always find a thread.
MAX_PIPE_CLOSE_THREADS_PER_UID = 16
# A uid with this many closes waiting (for a pipe's lock, which only a process of its own can
# hold) has its connections served no more till they end: it could pass such pipes as fast
# as it liked, each an fd of the daemon's held open.
MAX_PIPE_CLOSES_PER_UID = 16
# A uid with this many fds in the daemon's hands (received and not handed on, or closing) is
# not read from: one message may bring SCM_MAX_FD (253) more, no more. Well above what its
# ranks pass at once (one fd each per hand-off), so a burst of hand-offs is never held up.
MAX_FDS_HELD_PER_UID = 128


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class FdCloser:
    """The one owner of every fd a client passed from the moment it is received (counted by
    :meth:`received`) until it is handed on (:meth:`handed_on`, to the hand-off that uses it,
    which closes it through :meth:`close` in turn) or closed."""

    def __init__(self, name_thread: Callable[[], None]) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="ckptdrain-io-close", initializer=name_thread)
        self._lock = threading.Lock()
        # By owner: fds whose close is queued or under way (changed in threads, under _lock),
        # and fds received and not yet handed on or to close (changed on the loop only).
        self._closing: collections.Counter[object] = collections.Counter()
        self._held: collections.Counter[object] = collections.Counter()
        # Pipe-close threads running, by owner, and the closes waiting for one (oldest owner
        # first, so each owner's turn comes round).
        self._threads = 0
        self._threads_of: collections.Counter[object] = collections.Counter()
        self._waiting: dict[object, collections.deque[int]] = {}

    # -- accounting, on the loop ---------------------------------------------------------------
    def received(self, owner: object, count: int) -> None:
        self._held[owner] += count

    def handed_on(self, owner: object, count: int) -> None:
        self._held[owner] -= count
        if self._held[owner] <= 0:
            del self._held[owner]

    def closes_of(self, owner: object) -> int:
        """How many fds (a connection's included) of ``owner`` are still being closed."""
        return self._closing.get(owner, 0)

    def fds_of(self, owner: object) -> int:
        """How many fds ``owner`` passed are in the daemon's hands: received and not handed
        on, or closing."""
        return self._held.get(owner, 0) + self._closing.get(owner, 0)

    # -- closing ---------------------------------------------------------------------------------
    def close(self, fd: int, owner: object = None) -> None:
        """Close ``fd`` in a thread: returns at once, whatever the fd is. ``owner`` is charged
        with it until it is closed: counted here, on the loop, so that its next read sees it
        (counted in the thread, a burst of closes was not seen till it had been served)."""
        with self._lock:
            self._closing[owner] += 1
        try:
            self._pool.submit(self._close, fd, owner)
        except RuntimeError:  # shutting down: the process's exit closes it
            self._closed(owner)

    def _closed(self, owner: object) -> None:
        with self._lock:
            self._closing[owner] -= 1
            if self._closing[owner] <= 0:
                del self._closing[owner]

    def _close(self, fd: int, owner: object) -> None:
        # A socket too when fds may be queued in it unread: its last close drops them, a
        # pipe among them (a connection hung up on before its next frame was read: found
        # attacking, that close blocked the event loop, and the daemon with it). Shut down
        # first, nothing more can come; with nothing queued it closes here at once, as every
        # client's connection does when it ends (through the pipe threads, an innocent user's
        # closes queued behind an attacker's pipes, and were charged to it: found attacking).
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            mode = 0
        if stat.S_ISSOCK(mode) and not _queued(fd):
            mode = 0
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            close_quietly(fd)
            self._closed(owner)
            return
        with self._lock:
            if (self._threads >= MAX_PIPE_CLOSERS
                    or self._threads_of[owner] >= MAX_PIPE_CLOSE_THREADS_PER_UID):
                self._waiting.setdefault(owner, collections.deque()).append(fd)
                return
            self._started(owner)
        try:
            threading.Thread(target=self._close_pipes, args=(fd, owner), daemon=True,
                             name="ckptdrain-io-close-pipe").start()
        except RuntimeError:  # no thread to be had: closed in this one after all
            self._close_pipes(fd, owner)

    def _started(self, owner: object) -> None:
        self._threads += 1
        self._threads_of[owner] += 1

    def _close_pipes(self, fd: int, owner: object) -> None:
        """Close ``fd``, then the closes waiting for a thread, one after another."""
        while True:
            close_quietly(fd)
            self._closed(owner)
            with self._lock:
                self._threads -= 1
                self._threads_of[owner] -= 1
                if self._threads_of[owner] <= 0:
                    del self._threads_of[owner]
                turn = self._next_waiting()
                if turn is None:
                    return
                fd, owner = turn
                self._started(owner)

    def _next_waiting(self) -> tuple[int, object] | None:
        """The oldest waiting close of the first owner under its share of threads; that
        owner goes to the back of the line (called under _lock)."""
        for owner, fds in self._waiting.items():
            if self._threads_of[owner] < MAX_PIPE_CLOSE_THREADS_PER_UID:
                fd = fds.popleft()
                del self._waiting[owner]
                if fds:
                    self._waiting[owner] = fds
                return fd, owner
        return None

    def shutdown(self) -> None:
        # Stuck threads cannot be joined: leave them to the process's exit.
        self._pool.shutdown(wait=False)


def _queued(sock_fd: int) -> bool:
    """Whether bytes (and so maybe fds) wait unread in a socket, shut down first so that no
    more can come; True where that cannot be told."""
    try:
        with contextlib.suppress(OSError):
            _shutdown(sock_fd)
        (unread,) = struct.unpack("i", fcntl.ioctl(sock_fd, termios.FIONREAD, b"\0" * 4))
        return bool(unread)
    except OSError:
        return True


def _shutdown(sock_fd: int) -> None:
    s = socket.socket(fileno=sock_fd)
    try:
        s.shutdown(socket.SHUT_RDWR)
    finally:
        s.detach()
