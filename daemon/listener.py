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

from ckptdrain.client import wire
from ckptdrain.daemon import access
from ckptdrain.daemon.access import Peer
from ckptdrain.daemon.fdcloser import closed_if_nothing_queued
from ckptdrain.daemon.logs import OncePerCause

if TYPE_CHECKING:
    from ckptdrain.daemon.config import AccessConfig, Config, LimitsConfig
    from ckptdrain.daemon.connection import ClientHandler
    from ckptdrain.daemon.metrics import Metrics

log = logging.getLogger("ckptdrain.listener")

# accept() errors that say "not now", not "never": back off and try again.
_TRANSIENT_ACCEPT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                               errno.ECONNABORTED, errno.EPROTO, errno.EINTR})
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0


# sockaddr_un.sun_path: 108 bytes with the terminating NUL.
_SUN_PATH_MAX = 108


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
    # Bound under a temporary name and renamed into place once it listens: a client that
    # finds the path can connect (between bind and listen it would be refused, and a client
    # or a probe waiting for the daemon would take that for "no daemon here"). A path too
    # long for a temporary name beside it is bound in place, as before.
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    fits = len(os.fsencode(staged)) < _SUN_PATH_MAX
    where = staged if fits else path
    if fits:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)  # left by a daemon of the same pid that died binding
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # No window where the socket is wider than configured.
        old = os.umask(0o177)
        try:
            sock.bind(str(where))
        finally:
            os.umask(old)
        access = config.access
        os.chmod(where, access.mode_int)
        if access.socket_group:
            os.chown(where, -1, group_id(access.socket_group))
        sock.listen(1024)
        if fits:
            os.rename(staged, path)
    except BaseException:
        sock.close()
        if fits:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
        raise
    sock.setblocking(False)
    return sock


def group_id(group: str) -> int:
    """``socket_group`` as a gid: a name from the group database, or a number as it is."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise OSError(f"[access] socket_group {group!r} is not a group on this host; create "
                      "it or give a numeric gid") from None


def refuse(conn: socket.socket, code: str, message: str, details: dict[str, object] | None = None,
           close: Callable[[int], None] = os.close) -> None:
    """Say why, in one frame, and hang up: never waits (a fresh socket's buffer is empty).
    ``close``: how its fd is closed (off the loop: fds may be queued in it unread)."""
    try:
        conn.setblocking(False)
        conn.send(wire.Connection(wire.Role.SERVER).send_error(code, message, details))
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        if not closed_if_nothing_queued(conn):
            close(conn.detach())


class Listener:
    def __init__(self, sock: socket.socket, *, limits: Callable[[], LimitsConfig],
                 access: Callable[[], AccessConfig], metrics: Metrics,
                 handler: Callable[[socket.socket, Peer], ClientHandler],
                 owns_path: str | None, charge: Callable[[int], None] = lambda uid: None,
                 close: Callable[[int, object], None] = lambda fd, uid: os.close(fd),
                 last_gone: Callable[[int], None] = lambda uid: None) -> None:
        self.sock: socket.socket | None = sock
        self._limits = limits
        self._access = access
        self._metrics = metrics
        self._handler = handler
        self._owns_path = owns_path
        self._charge = charge  # a uid's error allowance (allowance.py)
        # How a refused connection's fd is closed (DataPlane.close_client_fd): a client may
        # have queued fds in it already, and the last close of a pipe's can block.
        self._close = close
        # Told when a uid's last connection has ended: what the daemon keeps per uid for
        # its connections (data-plane lane, fetcher) is let go then.
        self._last_gone = last_gone
        self.connections: dict[asyncio.Task[None], ClientHandler] = {}
        self.per_uid: dict[int, int] = {}
        self._refusals = OncePerCause(60.0)
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
            peer = self._admit(conn)
            if peer is None:
                continue
            handler = self._handler(conn, peer)
            task = tg.create_task(handler.run(), name="client")
            self.connections[task] = handler
            self.per_uid[peer.uid] = self.per_uid.get(peer.uid, 0) + 1
            task.add_done_callback(self._forget)

    def _closer_for(self, uid: int) -> Callable[[int], None]:
        """How a connection of ``uid`` refused at accept is closed (``close``, charged to it)."""
        def close(fd: int) -> None:
            self._close(fd, uid)
        return close

    def _admit(self, conn: socket.socket) -> Peer | None:
        """The peer of a new connection, or None when it was refused (with a typed error,
        before any of its bytes are read, so a refused client holds nothing)."""
        try:
            peer = access.peer_of(conn)
        except OSError as exc:
            self._close(conn.detach(), None)
            self._refusals.log_event(log, logging.WARNING, "peer_credentials_unreadable",
                                     cause="peercred", error=str(exc))
            return None
        if not access.allowed(peer, self._access()):
            self._refusals.log_event(log, logging.WARNING, "client_refused",
                                     cause=f"not_allowed {peer.uid}",
                                     uid=peer.uid, reason="not in [access] allowed_uids / allowed_gids")
            refuse(conn, wire.PERMISSION_DENIED, access.refusal(peer),
                   close=self._closer_for(peer.uid))
            return None
        limits = self._limits()
        if len(self.connections) >= limits.max_clients:
            limit, value, what = "max_clients", limits.max_clients, "connections"
        elif self.per_uid.get(peer.uid, 0) >= limits.clients_per_uid:
            limit, value, what = ("max_clients_per_uid", limits.clients_per_uid,
                                  f"connections of uid {peer.uid}")
        else:
            return peer
        self._metrics.backpressure("rejected", limit)
        if limit == "max_clients_per_uid":
            # Each refusal costs the loop an accept and an answer: a uid flooding at its cap
            # pays for them from its allowance, its held connections then waiting longer.
            self._charge(peer.uid)
        # One cause per limit and uid: a user knocking at their own cap does not hide that
        # another user met one.
        self._refusals.log_event(log, logging.INFO, "client_refused", cause=f"{limit} {peer.uid}",
                                 uid=peer.uid, reason=limit)
        refuse(conn, wire.BACKPRESSURE, f"backpressure: the daemon already serves {value} "
               f"{what} (limits.{limit}); close idle connections or retry in a moment",
               {"limit": limit, "limit_value": value, "retry_after_s": 1.0},
               close=self._closer_for(peer.uid))
        return None

    def _forget(self, task: asyncio.Task[None]) -> None:
        handler = self.connections.pop(task, None)
        if handler is not None:
            uid = handler.peer.uid
            left = self.per_uid.get(uid, 1) - 1
            if left > 0:
                self.per_uid[uid] = left
            else:
                self.per_uid.pop(uid, None)
                self._last_gone(uid)

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
