"""The Unix socket: bind, accept, and the registry of connections being served.

``accept`` can fail for reasons that pass (the process is at its fd limit, the kernel is short
of memory): the loop backs off and tries again instead of dying, and each cause is logged
once a minute. Every connection is a task of the listener's TaskGroup, tracked so a shutdown
can let hand-offs in flight finish and cut the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import logging
import os
import socket
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptdrain.daemon.logs import OncePerCause

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.connection import ClientHandler
    from ckptdrain.daemon.metrics import Metrics

log = logging.getLogger("ckptdrain.listener")

# accept() errors that say "not now", not "never": back off and try again.
_TRANSIENT_ACCEPT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                               errno.ECONNABORTED, errno.EPROTO, errno.EINTR})
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0


def bind(config: Config, inherited: socket.socket | None) -> socket.socket:
    if inherited is not None:
        inherited.setblocking(False)
        return inherited
    path = config.socket
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"{path} exists and is not a socket; remove it or choose another socket path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            os.unlink(path)  # stale socket of a dead daemon
        else:
            raise OSError(f"another daemon is already serving {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # No window where the socket is wider than configured.
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    access = config.access
    os.chmod(path, access.mode_int)
    if access.socket_group:
        os.chown(path, -1, grp.getgrnam(access.socket_group).gr_gid)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class Listener:
    def __init__(self, sock: socket.socket, *, max_clients: Callable[[], int], metrics: Metrics,
                 handler: Callable[[socket.socket], ClientHandler], owns_path: str | None) -> None:
        self.sock: socket.socket | None = sock
        self._max_clients = max_clients
        self._metrics = metrics
        self._handler = handler
        self._owns_path = owns_path
        self.connections: dict[asyncio.Task[None], ClientHandler] = {}
        self._errors = OncePerCause(60.0)
        self.accept_errors = 0

    async def serve(self, stop: asyncio.Event, grace_s: float) -> None:
        """Accept until ``stop``; then stop accepting and drain (see :meth:`_drain`). Every
        connection is a task of this scope's TaskGroup, which ends only when they have."""
        async with asyncio.TaskGroup() as tg:
            acceptor = tg.create_task(self._accept_loop(tg), name="accept")
            await stop.wait()
            acceptor.cancel()
            await asyncio.wait([acceptor])  # out of sock_accept before its socket closes
            self.close()
            await self._drain(grace_s)

    async def _accept_loop(self, tg: asyncio.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        backoff = BACKOFF_FIRST_S
        while self.sock is not None:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as exc:
                if exc.errno not in _TRANSIENT_ACCEPT:
                    raise
                self.accept_errors += 1
                self._errors.log_event(log, logging.WARNING, "accept_failed",
                                       cause=errno.errorcode.get(exc.errno or 0, "?"),
                                       error=exc.strerror, retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            backoff = BACKOFF_FIRST_S
            if len(self.connections) >= self._max_clients():
                conn.close()
                self._metrics.backpressure("rejected", "max_clients")
                continue
            handler = self._handler(conn)
            task = tg.create_task(handler.run(), name="client")
            self.connections[task] = handler
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self.connections.pop(task, None)

    def close(self) -> None:
        if self.sock is None:
            return
        self.sock.close()
        self.sock = None
        if self._owns_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._owns_path)

    async def _drain(self, grace_s: float) -> None:
        """Let hand-offs in flight finish (their clients get an answer); connections waiting
        for their next request go at once; whatever is left after the grace period is cut."""
        for task, handler in list(self.connections.items()):
            if not handler.busy:
                task.cancel()
        if self.connections:
            _, pending = await asyncio.wait(list(self.connections), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=grace_s)
