"""One rank's part of one generation: ``begin``, ``put`` shards, then ``seal`` (or ``abort``).

A :class:`Generation` has a connection of its own for its whole ``begin`` ... ``seal``
conversation, used by the process that began it and one thread at a time. A shard goes the
cheapest way the daemon offers: one frame for a small one, a pipe or a memfd for bytes in
memory, the file's descriptor for a file (the daemon copies it in the kernel).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ckptdrain.client import names, pipes, wire
from ckptdrain.client.attempts import default_attempt
from ckptdrain.client.channel import Channel
from ckptdrain.client.errors import (
    DaemonUnavailable,
    DrainError,
    GenerationFailed,
    RejectedInput,
)
from ckptdrain.client.memfd import fill

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from ckptdrain.client.client import Client

__all__ = ["Generation", "checked_fd", "default_attempt"]

_MAX_REASON_CHARS = wire.MAX_REASON_CHARS
# How long leaving a `with` block by an exception waits for the daemon's answer to its abort.
_EXIT_ABORT_S = 5.0


class Generation:
    """This rank's part of one generation: ``put`` shards, then seal (or abort) it.

    Use it as a context manager (``with client.generation(...) as gen``): entering sends
    ``begin``; leaving without an exception seals this rank's part, leaving with one aborts it.
    """

    def __init__(
        self,
        client: Client,
        job: str,
        step: int,
        *,
        rank: int,
        world_size: int,
        ack: str | None,
        attempt: str | None = None,
    ) -> None:
        self._client = client
        self.job = job
        self.step = step
        self.rank = rank
        self.world_size = world_size
        self.ack = ack
        self.attempt = attempt if attempt is not None else default_attempt()
        self._channel: Channel | None = None
        self._pid = 0  # the process that began it: only it may use its connection
        # One request at a time on its connection: threads putting at once interleaved their
        # frames and broke it (found attacking from the training side). See _turn.
        self._lock = threading.RLock()
        self._holder: int | None = None
        self._state = "new"  # new -> open -> sealed | aborted
        # The boundary in force, as the daemon answered begin (never weaker than asked).
        self.effective_ack: str | None = None
        self._inline_bytes = -1  # the largest shard sent as one put_bytes frame (none: -1)

    @property
    def node_id(self) -> str:
        """The node id the daemon announced (empty before ``begin``)."""
        return self._channel.node_id if self._channel is not None else ""

    def __enter__(self) -> Generation:
        if self._state != "new":
            raise RejectedInput(
                f"generation {self.job}/{self.step} rank {self.rank} was already begun; "
                "create a new one with Client.generation()"
            )
        started = time.monotonic()
        channel = self._client._open_channel("begin", self._client.timeout_s)
        try:
            reply = channel.request(
                "begin",
                {
                    "job": self.job,
                    "step": self.step,
                    "rank": self.rank,
                    "world_size": self.world_size,
                    "ack": self.ack,
                    "attempt": self.attempt or None,
                },
                started=started,
            )
        except BaseException:
            channel.close()
            raise
        self._channel = channel
        self._pid = os.getpid()
        self._state = "open"
        ack = reply.get("ack")
        self.effective_ack = ack if isinstance(ack, str) else None
        # Offered by daemons that take small shards as one put_bytes frame (an older one does
        # not: every shard then takes put and data).
        inline = reply.get("inline_bytes")
        if isinstance(inline, int) and not isinstance(inline, bool):
            self._inline_bytes = min(inline, wire.INLINE_MAX_BYTES)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._state == "open":
                if exc is None:
                    self.seal()
                else:
                    # Best effort: the original exception matters more than why abort failed,
                    # and the daemon drops an unsealed part whose connection goes away. So the
                    # abort has a short bound of its own: the training code's exception waited
                    # behind it for the whole timeout_s (300 s) on a hung daemon (found
                    # attacking a SIGSTOPped one); if it runs out, the connection closes and
                    # the daemon aborts the part all the same, only without the reason.
                    with contextlib.suppress(DrainError, OSError):
                        self._abort(f"{type(exc).__name__}: {exc}",
                                    min(self._client.timeout_s, _EXIT_ABORT_S))
        finally:
            if self._channel is not None:
                self._channel.close()

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """This generation's connection for one request, in the process that began it and
        once no other request is on it. The process is checked first: in a forked child the
        lock may be held for good by a parent thread that does not exist there. A request
        begun while this thread's own is under way (a signal handler calling abort during a
        put) is refused: its frames would have gone out in the middle of the other's."""
        if self._pid and self._pid != os.getpid():
            raise RejectedInput(
                f"generation {self.job}/{self.step} rank {self.rank} was begun by process "
                f"{self._pid}, and this is process {os.getpid()} (forked from it): a forked "
                "process cannot hand off into its parent's generation; hand the shards to "
                "the parent, or begin a generation (another rank) of its own"
            )
        with self._lock:
            if self._holder == threading.get_ident():
                raise RejectedInput(
                    f"a request of generation {self.job}/{self.step} rank {self.rank} is under "
                    "way in this thread already (called from a signal handler?); raise an "
                    "exception there instead, and the `with` block aborts the generation"
                )
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def __reduce__(self) -> tuple[Any, ...]:
        raise RejectedInput(
            "a Generation belongs to the process that began it and cannot be pickled; pass "
            "the Client (or its socket path) and begin a generation in the other process"
        )

    def _open_channel(self) -> Channel:
        if self._state != "open" or self._channel is None:
            if self._state == "new":
                raise RejectedInput(
                    "begin the generation first: `with client.generation(job, step) as gen:`"
                )
            raise RejectedInput(
                f"generation {self.job}/{self.step} rank {self.rank} is already {self._state}; "
                "begin a new one to hand off more shards"
            )
        if self._channel.awaiting_data and self._channel.broken is None:
            # A put was admitted but its data never went (interrupted between the two).
            self._channel.broken = DaemonUnavailable("a put was interrupted before its data")
            self._channel.close()
        if self._channel.broken is not None:
            raise GenerationFailed(
                f"the connection to the daemon broke earlier in generation {self.job}/{self.step} "
                f"({self._channel.broken.message}); this rank's part cannot be finished, "
                "save the checkpoint again as a new generation"
            )
        return self._channel

    def _shard_fields(self, path: str, size: int, deferred: bool) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "job": self.job, "step": self.step, "rank": self.rank, "path": path, "size": size
        }
        if deferred:
            fields["deferred"] = True
        return fields

    def put(self, path: str, data: ReadableBuffer, *, deferred: bool = False) -> dict[str, Any]:
        """Hand off ``data`` as shard ``path``; returns when it is safe per the ack mode.

        ``deferred=True`` holds the shard back until every rank's shards are at the
        destination, and writes it just before the manifest: for a file whose presence makes
        the directory look complete to other readers (DCP's ``.metadata``).
        """
        with self._turn():
            names.validate_shard_path(path)
            channel = self._open_channel()
            try:
                view = memoryview(data)
            except TypeError:
                raise RejectedInput(
                    f"shard data must be bytes-like (bytes, bytearray, memoryview), "
                    f"not {type(data).__name__}"
                ) from None
            with view:
                if not view.c_contiguous:
                    raise RejectedInput(
                        "shard data must be one contiguous buffer; copy it (e.g. bytes(...)) first"
                    )
                with view.cast("B") as flat:
                    if self.effective_ack == "memory":
                        reply = self._put_memory(channel, path, flat, deferred)
                        if reply is not None:
                            return reply
                    return self._put_bytes(channel, path, flat, deferred)

    def _put_bytes(
        self, channel: Channel, path: str, flat: memoryview, deferred: bool
    ) -> dict[str, Any]:
        """The shard's bytes over the connection: the daemon stages them (ack=local)."""
        fields = self._shard_fields(path, flat.nbytes, deferred)
        if flat.nbytes <= self._inline_bytes:
            # A small shard in one round trip: a refusal costs little of the wire.
            return channel.request("put_bytes", fields, payload=flat)
        # Two round trips: the daemon admits the shard (or pushes back) before any of
        # its bytes are on the wire, then takes them: through a pipe where it offers
        # one (one copy, see pipes.py), else in one data frame.
        ready = channel.request("put", fields)
        pipe = pipes.PipeHandOff.start(flat) if ready.get("pipe") is True else None
        if pipe is None:
            return channel.request("data", {}, payload=flat)
        try:
            return channel.request("data_pipe", {}, pipe=pipe)
        finally:
            pipe.close()

    def _put_memory(
        self, channel: Channel, path: str, data: memoryview, deferred: bool
    ) -> dict[str, Any] | None:
        """ack=memory: copy into a pooled memfd and pass it; the daemon owns it from here.
        None, with nothing sent, when no memfd can be made or filled (the process's fd table
        full, or the memfd refused the bytes: RLIMIT_FSIZE, memory short): the caller sends
        the bytes over the connection and the daemon stages them, a stronger boundary than
        asked for. The bare OSError went up before, outside DrainError (found attacking)."""
        pool = self._client._memfds
        try:
            fd = pool.acquire()
        except OSError:
            return None
        try:
            fill(fd, data)
        except OSError:
            pool.discard(fd)
            return None
        except BaseException:
            pool.discard(fd)
            raise
        try:
            reply = channel.request(
                "put_memfd", self._shard_fields(path, data.nbytes, deferred), fd=fd
            )
        except BaseException:
            pool.discard(fd)
            raise
        pool.release(fd, data.nbytes)  # reused once the daemon lets go of it
        return reply

    def put_file(
        self, path: str, file: str | os.PathLike[str] | int, *, deferred: bool = False
    ) -> dict[str, Any]:
        """Hand off a file on this node as shard ``path`` by passing its open fd to the daemon.

        ``file`` is a path (opened read-only here and closed after) or an open fd (left open).
        The daemon reads through the fd, with this process's rights, never by path. A memfd
        is sent as ``put_memfd`` so an ``ack="memory"`` daemon can keep it as it is.
        """
        with self._turn():
            names.validate_shard_path(path)
            channel = self._open_channel()
            if isinstance(file, int) and not isinstance(file, bool):
                fd, owned = checked_fd(file, "shard file"), False
            elif isinstance(file, str | bytes | os.PathLike):
                try:
                    # O_NONBLOCK: opening a FIFO with no writer (or a device) waited for one,
                    # before any check or timeout (found attacking); it is refused below.
                    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                    os.set_blocking(fd, True)  # the daemon reads through the same file
                except OSError as exc:
                    raise RejectedInput(
                        f"cannot open shard file {os.fspath(file)!r}: {exc.strerror}"
                    ) from exc
                except ValueError as exc:  # a NUL in the path
                    raise RejectedInput(f"cannot open shard file {file!r}: {exc}") from None
                owned = True
            else:
                raise RejectedInput(
                    f"shard file must be a path or an fd (an int), not {type(file).__name__}; "
                    "for an open file object pass its fileno()"
                )
            try:
                try:
                    info = os.fstat(fd)
                except OSError as exc:
                    raise RejectedInput(f"cannot stat shard fd {fd}: {exc.strerror}") from exc
                if not stat.S_ISREG(info.st_mode):
                    raise RejectedInput(
                        f"shard {path!r} must be a regular file or memfd; {file!r} is not"
                    )
                if info.st_size == 0 and _reads_bytes(fd):
                    # /proc files say 0 bytes and hold more: handed off, they committed empty.
                    raise RejectedInput(
                        f"shard {path!r}: {file!r} says it holds 0 bytes but has bytes to read "
                        "(a /proc or /sys file, whose size stat does not tell); copy it into a "
                        "regular file, or put() its bytes"
                    )
                kind = "put_memfd" if _is_memfd(fd) else "put_fd"
                return channel.request(kind, self._shard_fields(path, info.st_size, deferred), fd=fd)
            finally:
                if owned:
                    os.close(fd)

    def seal(self) -> None:
        """Declare this rank's part complete (done by ``__exit__``; call it to see errors early)."""
        with self._turn():
            channel = self._open_channel()
            channel.request("seal", {"job": self.job, "step": self.step, "rank": self.rank})
            self._state = "sealed"

    def abort(self, reason: str) -> None:
        """Give up this rank's part; the daemon discards its shards and the generation fails."""
        self._abort(reason, None)

    def _abort(self, reason: str, timeout_s: float | None) -> None:
        with self._turn():
            channel = self._open_channel()
            self._state = "aborted"
            channel.request(
                "abort",
                {
                    "job": self.job,
                    "step": self.step,
                    "rank": self.rank,
                    "reason": str(reason)[:_MAX_REASON_CHARS],
                },
                timeout_s=timeout_s,
            )


def checked_fd(fd: object, what: str) -> int:
    """``fd`` if it can be an open file descriptor; RejectedInput (not the TypeError,
    OverflowError or lost connection sending it would raise) if not."""
    if isinstance(fd, bool) or not isinstance(fd, int) or not 0 <= fd < 2**31:
        raise RejectedInput(f"{what} must be an open file descriptor (an int), not {fd!r}")
    return fd


def _reads_bytes(fd: int) -> bool:
    """Whether a read at the start of ``fd`` returns a byte (False where it cannot be read:
    the daemon then says why)."""
    try:
        return bool(os.pread(fd, 1, 0))
    except OSError:
        return False


def _is_memfd(fd: int) -> bool:
    # The kernel names memfds "/memfd:NAME"; readlink of the fd is the one precise test
    # (F_GET_SEALS also answers for ordinary tmpfs files).
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False
