"""The blocking client training code uses to hand shards to its node's daemon (stdlib only).

Every request is one frame out and one reply in, over a Unix socket, framed and checked by the
sans-IO machine in :mod:`ckptdrain.client.wire`. Each :class:`Generation` has a connection of
its own (its ``begin`` ... ``seal`` conversation); the other calls share a small pool of idle
connections (connections.py, the client's base), so several threads may use one
:class:`Client`.

Every wait has a timeout: a request, with its payload, must finish within ``timeout_s`` (the
``wait`` call within its own timeout); a ``wait``, ``begin`` or ``put`` gets a tenth more, 2 to
30 s, for its reply to arrive. A connection opened for a call (its connect and ``hello``) waits
at most ``connect_timeout_s`` and counts against the call's own bound. A ``put`` of bytes is
two requests (admission, then the data), each within ``timeout_s``.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ckptdrain.client import forks, names, wire
from ckptdrain.client.attempts import default_attempt
from ckptdrain.client.channel import Channel
from ckptdrain.client.connections import ConnectionPool, Lost, close_channels
from ckptdrain.client.daemonsocket import default_socket_path
from ckptdrain.client.errors import (
    DrainError,
    RejectedInput,
)
from ckptdrain.client.generation import Generation, checked_fd
from ckptdrain.client.memfd import DEFAULT_MAX_IDLE_BYTES, MemfdPool

if TYPE_CHECKING:
    pass

def default_rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size`` as given, else torchrun's ``RANK`` / ``WORLD_SIZE``; neither
    has a default. (A default world_size of 1 would let ranks that forget it each commit a
    one-rank "checkpoint".)"""
    def from_env(name: str, arg: str) -> int:
        text = os.environ.get(name)
        if text is None:
            raise RejectedInput(
                f"{arg} is required: pass {arg}= to Client.generation() (every rank saving this "
                f"step passes the same world_size and its own rank), or run under torchrun, "
                f"which sets ${name}")
        try:
            return int(text)
        except ValueError:
            raise RejectedInput(f"${name} is {text!r}, not an integer; fix the launcher's "
                                f"environment or pass {arg}=") from None

    size = from_env("WORLD_SIZE", "world_size") if world_size is None else world_size
    return (from_env("RANK", "rank") if rank is None else rank), size


def _check_attempt(attempt: object) -> str:
    if not isinstance(attempt, str) or len(attempt) > wire.MAX_ATTEMPT_CHARS or not attempt.isprintable():
        raise RejectedInput(
            f"attempt must be printable text of at most {wire.MAX_ATTEMPT_CHARS} characters"
        )
    return attempt


# Socket timeouts past this only overflow the timers they end up in.
_MAX_SOCKET_TIMEOUT_S = 10**9


def _check_timeout(value: object, what: str, limit: float = _MAX_SOCKET_TIMEOUT_S) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RejectedInput(f"{what} must be a number of seconds, not {type(value).__name__}")
    # An int too big for a float has no isfinite(): compare it as the int it is.
    if (isinstance(value, float) and not math.isfinite(value)) or not 0 <= value <= limit:
        shown = value if len(str(value)) <= 40 else f"{str(value)[:20]}..."
        raise RejectedInput(f"{what} is {shown}; use a finite number of seconds from 0 to {limit}")
    return float(value)


def _above_zero(seconds: float, what: str) -> float:
    """A client's own timeout is never 0: every call would raise Timeout blaming the daemon
    ("it may be overloaded or hung"; found attacking with timeout_s=0, which some take for
    "no timeout"). A wait's own timeout_s may be 0: a poll."""
    if seconds <= 0:
        raise RejectedInput(
            f"{what} is 0: use the seconds a reply may take, above 0 (every call is bounded; "
            "there is no 'no timeout': for a long one pass a large number)"
        )
    return seconds


# A wait whose daemon went away asks the next one after this pause, doubling up to the most.
_REWAIT_FIRST_PAUSE_S = 0.05
_REWAIT_MAX_PAUSE_S = 1.0


def _client_for(socket_path: str, timeout_s: float, connect_timeout_s: float,
                memfd_pool_bytes: int = DEFAULT_MAX_IDLE_BYTES) -> Client:
    return Client(socket_path, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                  memfd_pool_bytes=memfd_pool_bytes)


def _target_fd(fd: object) -> int:
    """``fd`` for a fetch to write into, if it is open. A closed one failed as the kernel
    refused to pass it, and that came back as a lost connection: DaemonUnavailable, "start
    it with `ckptdrain serve`", for the caller's own mistake (found as a job author)."""
    fd = checked_fd(fd, "fd")
    try:
        os.fstat(fd)
    except OSError as exc:
        raise RejectedInput(f"fd {fd} is not an open file descriptor ({exc.strerror}); pass "
                            "a regular file open for writing") from None
    return fd


class Client(ConnectionPool):
    """A handle on the node's ckptdrain daemon. Thread-safe; cheap to create."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        memfd_pool_bytes: int = DEFAULT_MAX_IDLE_BYTES,
    ) -> None:
        try:
            self.socket_path = (
                os.fspath(socket_path) if socket_path is not None else default_socket_path()
            )
        except TypeError:
            raise RejectedInput(
                f"socket_path must be a path (str or os.PathLike), not {socket_path!r}"
            ) from None
        if not self.socket_path:
            # Client(os.environ.get("MY_SOCK", "")) tried a daemon at "" and said "Invalid
            # argument; start it with `ckptdrain serve`" (found as a job author).
            raise RejectedInput("socket_path is empty (an unset variable?); pass the daemon's "
                                "socket path, or None for the default ($CKPTDRAIN_SOCKET, "
                                "then the system socket)")
        self.timeout_s = _above_zero(_check_timeout(timeout_s, "timeout_s"), "timeout_s")
        self.connect_timeout_s = _above_zero(
            _check_timeout(connect_timeout_s, "connect_timeout_s"), "connect_timeout_s")
        # Held only to take or give back an idle connection. Re-entrant: a signal handler
        # calling the client while this thread holds it would otherwise wait for good.
        self._lock = threading.RLock()
        self._idle: list[Channel] = []
        # A Client dropped without close() (Client().latest(job) is a fine one-liner) still
        # closes its pooled sockets when collected; the finalizer holds the list, not the Client.
        if (isinstance(memfd_pool_bytes, bool) or not isinstance(memfd_pool_bytes, int)
                or memfd_pool_bytes < 0):
            raise RejectedInput(f"memfd_pool_bytes is {memfd_pool_bytes!r}; use a whole number "
                                "of bytes, 0 or more (0 keeps no memfd between saves)")
        self._memfds = MemfdPool(max_idle_bytes=memfd_pool_bytes)
        self._finalizer = weakref.finalize(self, close_channels, self._idle, self._lock)
        self._memfd_finalizer = weakref.finalize(self, self._memfds.close)
        self._closed = False
        forks.register(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # A client for the same daemon, with none of this one's connections (a spawned
        # DataLoader worker or a Pool gets its arguments pickled).
        return (_client_for, (self.socket_path, self.timeout_s, self.connect_timeout_s,
                              self._memfds.max_idle_bytes))

    def _forget_in_child(self) -> None:
        """In a child just forked (forks.py): start with an empty pool. Its connections'
        sockets and its memfds are closed as theirs; the lock is new (a parent thread may
        hold the old one for good)."""
        self._finalizer.detach()
        self._idle = []
        self._lock = threading.RLock()
        self._finalizer = weakref.finalize(self, close_channels, self._idle, self._lock)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the idle connections; generations still open keep their own until they end."""
        self._closed = True
        self._finalizer()
        self._memfd_finalizer()


    def generation(
        self,
        job: str,
        step: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        ack: str | None = None,
        attempt: str | None = None,
    ) -> Generation:
        """This rank's part of generation ``step`` of ``job``; use it with ``with``.

        ``rank`` and ``world_size`` default to torchrun's ``$RANK`` and ``$WORLD_SIZE``;
        without them they are required (RejectedInput says so).
        ``ack`` ("local" or "memory") overrides the daemon's default failure boundary.
        ``attempt`` names this attempt at saving the step; every rank of the attempt must pass
        the same. A new attempt at a step that failed or never finished replaces the old one
        (a restarted job saving the same step again). Default: :func:`default_attempt`.
        Names are checked here, so a bad one fails before any I/O.
        """
        names.validate_job(job)
        step = names.validate_step(step)
        rank, world_size = default_rank_and_world_size(rank, world_size)
        world_size = names.validate_world_size(world_size)
        rank = names.validate_rank(rank, world_size)
        if ack is not None and ack not in wire.ACK_MODES:
            raise RejectedInput(f"ack is {ack!r}; use one of {list(wire.ACK_MODES)} or None")
        if attempt is not None:
            _check_attempt(attempt)
        return Generation(self, job, step, rank=rank, world_size=world_size, ack=ack,
                          attempt=attempt)

    def wait(
        self, job: str, step: int, timeout_s: float = 600.0, *, attempt: str | None = None
    ) -> dict[str, Any]:
        """Block until generation ``step`` of ``job`` is committed; returns the daemon's answer.

        Raises Timeout if it is not committed within ``timeout_s`` and GenerationFailed if
        this attempt at the step never will be. ``attempt`` is the one the save passed to
        :meth:`generation` (default: :func:`default_attempt`): a failed older attempt (the
        crashed run this one restarted from) is not the answer, so a wait that starts before
        the re-save begins waits for the re-save. ``""`` takes whatever attempt is there.
        """
        names.validate_job(job)
        step = names.validate_step(step)
        limit_s = _check_timeout(timeout_s, "timeout_s", wire.MAX_TIMEOUT_S)
        mine = default_attempt() if attempt is None else _check_attempt(attempt)
        started = time.monotonic()
        pause_s = _REWAIT_FIRST_PAUSE_S
        left_s = limit_s
        while True:
            try:
                return self._call(
                    "wait",
                    {"job": job, "step": step, "timeout_s": left_s, "attempt": mine or None},
                    timeout_s=left_s, lost=True,
                )
            except Lost as lost:
                # The daemon went away during the wait (a restart: `systemctl restart`, whose
                # socket unit holds the socket meanwhile, so the next connect waits for the new
                # daemon). The step survives a restart, and the new daemon knows how it ends:
                # asked again on a new connection for what is left of timeout_s. A connect
                # that fails raises as ever (no daemon to ask). It raised DaemonUnavailable
                # at once before, though the step committed seconds after (found attacking).
                if limit_s - (time.monotonic() - started) <= pause_s:
                    raise lost.error from None
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, _REWAIT_MAX_PAUSE_S)
                left_s = max(0.0, limit_s - (time.monotonic() - started))

    def latest(self, job: str) -> int | None:
        """The newest committed generation of ``job``, or None when there is none."""
        names.validate_job(job)
        reply = self._call("latest", {"job": job})
        generation = reply.get("generation")
        if generation is None:
            return None
        if isinstance(generation, bool) or not isinstance(generation, int):
            raise DrainError(
                f"the ckptdrain daemon answered 'latest' with generation {generation!r}, not an "
                "integer; check that client and daemon versions match"
            )
        return generation

    def latest_path(self, job: str, step: int | None = None) -> str | None:
        """Where generation ``step`` (default: the newest committed one) of ``job`` lies at
        the destination: a local directory for a ``file://`` destination, else its URI
        (``s3://bucket/prefix/job/<step>``); None when nothing is committed."""
        names.validate_job(job)
        if step is not None:
            step = names.validate_step(step)
        reply = self._call("latest", {"job": job})
        root, newest = reply.get("root"), reply.get("generation")
        if step is None:
            step = newest if isinstance(newest, int) and not isinstance(newest, bool) else None
        if not isinstance(root, str) or step is None:
            return None
        uri = f"{root}/{step:020d}"
        return uri.removeprefix("file://") if uri.startswith("file://") else uri

    def open_local(self, job: str, step: int, path: str) -> int:
        """A read-only fd of this node's local copy of shard ``path`` of committed step
        ``step``, which the daemon has just checked against the manifest; the caller closes
        it. Raises NotFound when the destination must serve the shard instead."""
        names.validate_job(job)
        step = names.validate_step(step)
        names.validate_shard_path(path)
        started = time.monotonic()
        channel = self._open_channel("open", self.timeout_s)
        try:
            _reply, fd = channel.request_fd("open", {"job": job, "step": step, "path": path},
                                            started=started)
        finally:
            channel.close()
        return fd

    def status(self, job: str | None = None) -> dict[str, Any]:
        """The daemon's status report (jobs, generations, staged bytes, limits); ``job``
        keeps only that job's generations. A user sees only the jobs it owns."""
        if job is None:
            return self._call("status", {})
        names.validate_job(job)
        return self._call("status", {"job": job})

    def fetch_local(self, job: str, step: int, path: str, fd: int) -> dict[str, Any]:
        """Have the daemon copy its local copy of a committed shard into ``fd`` (a regular
        file open for writing, without O_APPEND), which it empties first: the file becomes
        exactly the shard. Returns ``{"size", "checksum"}`` of what it wrote. Raises NotFound
        when this node holds no local copy. The caller checks the checksum against the
        manifest."""
        names.validate_job(job)
        step = names.validate_step(step)
        names.validate_shard_path(path)
        fd = _target_fd(fd)
        started = time.monotonic()
        channel = self._open_channel("fetch", self.timeout_s)
        try:
            return channel.request("fetch", {"job": job, "step": step, "path": path}, fd=fd,
                                   started=started)
        finally:
            channel.close()

    def fetch_from_destination(self, job: str, step: int, path: str, fd: int) -> dict[str, Any]:
        """Have the daemon copy shard ``path`` of committed step ``step`` from the destination
        into ``fd`` (a regular file open for writing, without O_APPEND; emptied first, so the
        file becomes exactly the shard), checked against the manifest (for a destination this
        process cannot read itself, such as S3); returns ``{"size", "checksum"}``."""
        names.validate_job(job)
        step = names.validate_step(step)
        names.validate_shard_path(path)
        fd = _target_fd(fd)
        started = time.monotonic()
        channel = self._open_channel("fetch", self.timeout_s)
        try:
            return channel.request(
                "fetch", {"job": job, "step": step, "path": path, "source": "destination"}, fd=fd,
                started=started,
            )
        finally:
            channel.close()

    def retry(self, job: str, step: int) -> dict[str, Any]:
        """Ask the daemon to retry draining a generation that failed on a transient error."""
        names.validate_job(job)
        step = names.validate_step(step)
        return self._call("retry", {"job": job, "step": step})

    def drain(self) -> dict[str, Any]:
        """Operators: stop taking new generations on this node (a new ``begin`` gets
        :class:`NodeDraining`) and finish what it holds. Returns what is left to drain
        (``{"draining": True, "done": bool, "left": {...}}``); call again to poll."""
        return self._call("drain", {})

    def resume(self) -> dict[str, Any]:
        """Operators: take new generations again after :meth:`drain`."""
        return self._call("resume", {})

    def abort_generation(self, job: str, step: int, reason: str = "") -> dict[str, Any]:
        """Operators: end generation ``step`` of ``job`` on this node (it fails, with
        ``reason``, and frees what it holds). Only the job's owner or root may."""
        names.validate_job(job)
        step = names.validate_step(step)
        fields: dict[str, Any] = {"job": job, "step": step}
        if reason:
            fields["reason"] = reason
        return self._call("abort_generation", fields)
