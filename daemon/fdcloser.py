"""Closing the fds clients pass, off the event loop, and charging each to the uid that passed it.

A close can block for as long as the client likes: the last close of a pipe waits for the
pipe's lock, which the client that passed it can hold (a splice on it that never ends); a TCP
socket lingers on unsent data its peer does not read; a file of a FUSE mount waits for its
server's answer to the flush. So no passed fd is closed on the loop or in a hand-off's thread,
nor in a pool all users share: each close runs in a thread of its owner's (the client's uid),
at most :data:`MAX_CLOSE_THREADS_PER_UID` of them at once, the rest waiting in that uid's own
line. Through a shared pool, two lingering sockets (or two locked pipes, before they went to
threads of their own) passed by one user held up every other user's closes, charged to them
till they were refused as ``pipes_held`` (found attacking).

Every passed fd is charged to its owner from the moment it is received until its close has
returned (:meth:`FdCloser.fds_of`):

- a uid with :data:`MAX_PIPE_CLOSES_PER_UID` closes waiting is served no more till they end
  (connection.py, between requests);
- a uid holding :data:`MAX_FDS_HELD_PER_UID` fds received, not yet handed on or closed, is
  not read from at all (channel.py, before every read): the fds it sends meanwhile stay in
  flight in its sockets, the kernel's and the sender's, never in this process's fd table.
  Checked between requests only, 80 connections of one uid each waiting for its next frame
  received 4 locked pipes apiece before any count rose (found attacking).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import socket
import stat
import struct
import termios
import threading

# Threads closing clients' fds at once; past it, closes wait for one.
MAX_CLOSE_THREADS = 256
# Of those, one uid's at most: the others' closes always find a thread.
MAX_CLOSE_THREADS_PER_UID = 16
# How long a closing thread with nothing to close waits for more before it ends.
CLOSER_IDLE_S = 2.0
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
    which closes it through :meth:`close` in turn) or closed. Closes run in worker threads,
    started as needed and kept while there is work (a thread started for each close cost the
    event loop a thread start per connection, and under strace far more: found in CI), one
    uid's at most :data:`MAX_CLOSE_THREADS_PER_UID` at once. Nothing to shut down: a close
    still waiting when the daemon exits is left to the process's exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        # By owner: fds whose close is queued or under way (changed in threads, under _lock),
        # and fds received and not yet handed on or to close (changed on the loop only).
        self._closing: collections.Counter[object] = collections.Counter()
        self._held: collections.Counter[object] = collections.Counter()
        # Worker threads alive and idle; closes under way by owner, and those waiting (the
        # owner that waited longest first, so each owner's turn comes round).
        self._threads = 0
        self._idle = 0
        self._busy_of: collections.Counter[object] = collections.Counter()
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
    def close(self, fd: int, owner: object) -> None:
        """Close ``fd`` in a worker thread: returns at once, whatever the fd is. ``owner`` is
        charged with it until it is closed: counted here, on the loop, so that its next read
        sees it (counted in the thread, a burst of closes was not seen till it had been
        served)."""
        with self._lock:
            self._closing[owner] += 1
            self._waiting.setdefault(owner, collections.deque()).append(fd)
            if self._idle:
                self._work.notify()
                return
            if (self._threads >= MAX_CLOSE_THREADS
                    or self._busy_of[owner] >= MAX_CLOSE_THREADS_PER_UID):
                return  # a worker takes it when one comes free (one of its owner's, there)
            self._threads += 1
        try:
            threading.Thread(target=self._serve, daemon=True, name="ckptdrain-io-close").start()
        except RuntimeError:
            # No thread to be had (or the interpreter is exiting). Never closed here: this is
            # the event loop, and the close may block. It waits for the next worker.
            with self._lock:
                self._threads -= 1

    def _serve(self) -> None:
        """A worker: close what waits, owner by owner in turn; leave once idle for
        CLOSER_IDLE_S."""
        while True:
            with self._lock:
                turn = self._next_waiting()
                while turn is None:
                    self._idle += 1
                    woken = self._work.wait(CLOSER_IDLE_S)
                    self._idle -= 1
                    turn = self._next_waiting()
                    if turn is None and not woken:
                        self._threads -= 1
                        return
                fd, owner = turn
                self._busy_of[owner] += 1
            _close_now(fd)
            with self._lock:
                self._busy_of[owner] -= 1
                if self._busy_of[owner] <= 0:
                    del self._busy_of[owner]
                self._closing[owner] -= 1
                if self._closing[owner] <= 0:
                    del self._closing[owner]

    def _next_waiting(self) -> tuple[int, object] | None:
        """The oldest waiting close of the first owner under its share of threads; that
        owner goes to the back of the line (called under _lock)."""
        for owner, fds in self._waiting.items():
            if self._busy_of[owner] < MAX_CLOSE_THREADS_PER_UID:
                fd = fds.popleft()
                del self._waiting[owner]
                if fds:
                    self._waiting[owner] = fds
                return fd, owner
        return None


def closed_if_nothing_queued(sock: socket.socket) -> bool:
    """Close a client's connection now, on the caller's thread, where that cannot block; else
    False, and the caller closes it as a passed fd (:meth:`FdCloser.close`). Only the fds
    queued in it unread can make its last close wait (the last close of a pipe whose lock its
    client holds): shut down first, so that nothing more can come in (the peer's sends fail
    from then on), it is closed here when it holds no byte unread, or none of them carries
    an fd (a peek with no room for fds says so without taking any: the kernel drops only its
    own extra references). Each connection of a uid whose closes were wedged waited in its
    line behind them before, an fd of the daemon's held open: reconnecting in a loop, one
    user whose process held 20 pipes' locks had the daemon at its fd limit within a minute,
    and every other user's connect timed out (found attacking)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0]
        if queued:
            data, _, flags, _ = sock.recvmsg(queued, 0, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            # Short: the peek stopped at a message that carries fds (or another sender's).
            if flags & socket.MSG_CTRUNC or len(data) < queued:
                return False
    except OSError:
        return False
    sock.close()
    return True


def _close_now(fd: int) -> None:
    # A socket is shut down first: nothing more can come into it, and a peer waiting on it
    # learns at once that the daemon is done with it.
    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()
    except OSError:
        pass
    close_quietly(fd)
