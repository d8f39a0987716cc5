"""The S3 worker pool's slots: ``count`` of them, each holding a worker process or none, and
how the pool starts a worker in one, picks one for a request, replaces a lost one and stops
them all.

Apart from s3pool.py, whose :class:`~ckptdrain.daemon.backends.s3pool.WorkerSenders` builds on
:class:`WorkerSlots`, because which processes run is a question of its own (the program and
its environment, its configuration, restarts held back by s3procs.Restarts, an fd limit met at
start) that the requests sent to them only meet through :meth:`WorkerSlots._worker`. Logged
under the pool's logger, ``ckptdrain.daemon.backends.s3pool``, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3procs import (
    MIN_ALIVE_S,
    STOP_TIMEOUT_S,
    Restarts,
    WorkerProcess,
    exited,
    stopped,
)
from ckptdrain.daemon.logs import log_event

if TYPE_CHECKING:
    from ckptdrain.daemon.config import DestinationConfig

__all__ = ["WorkerSlots"]

# The pool's logger (s3procs.py logs under it too): operators filter on it.
log = logging.getLogger("ckptdrain.daemon.backends.s3pool")


class WorkerSlots:
    """``count`` worker processes of one ``role`` ("upload" or "reader"), started on first use
    and again after each is lost."""

    def __init__(self, config: DestinationConfig, node_id: str, count: int, *,
                 role: str = "upload") -> None:
        self._role = role
        # Processes of workers found lost and killed, not yet seen to exit (_reap).
        self._dying: list[asyncio.subprocess.Process] = []
        self._config = config
        self._node_id = node_id
        self._count = count
        self._workers: list[WorkerProcess | None] = [None] * count
        self._restarts = Restarts(count, role)
        self._lanes = itertools.count()
        self._start_lock = asyncio.Lock()
        self._closed = False
        # A worker's event loop answers a ping at once, whatever its requests wait for: one
        # silent for longer than a connection takes to open is stuck, and replaced (not
        # sooner than MIN_ALIVE_S: a loaded node may not run it for a second or two).
        self._alive_s = max(float(config.connect_timeout_s), MIN_ALIVE_S)

    async def start(self) -> None:
        await self._worker()

    @property
    def running(self) -> bool:
        """Whether the workers were started (they are, at the first request)."""
        return any(w is not None for w in self._workers)

    async def _worker(self, lane: int | None = None) -> WorkerProcess:
        """The worker in slot ``lane`` (modulo the count), or else the least busy; every dead
        one started again first, unless its slot waits (s3procs.Restarts)."""
        async with self._start_lock:
            if self._closed:
                raise S3Failure("the S3 backend is closed", transient=False, kind="io")
            for i, worker in enumerate(self._workers):
                if worker is not None and worker.alive:
                    if worker.ready:
                        self._restarts.started(i)
                    continue
                if worker is not None:
                    self._restarts.lost(worker)
                    self._workers[i] = None
                if self._restarts.may_start(i):
                    self._workers[i] = await self._start(i)
            alive = [w for w in self._workers if w is not None]
        if not alive:
            raise self._restarts.failure()  # every slot waits: its workers die at start
        if lane is not None:
            return alive[lane % len(alive)]
        return min(alive, key=lambda w: len(w.pending))

    def next_lane(self) -> int:
        """A lane for one more file's ranges (:meth:`fetch`), the workers taken in turn."""
        return next(self._lanes)

    async def _start(self, index: int) -> WorkerProcess:
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as exc:
            raise self._cannot_start(exc) from None
        try:
            proc = await asyncio.create_subprocess_exec(
                # -P: `python -m` would put the working directory first on sys.path, and a
                # restore run in a directory others can write (/tmp, a shared project) would
                # import their `secrets.py` or `queue.py` into its readers, as its own user.
                sys.executable, "-P", "-m", "ckptdrain.daemon.backends.s3worker",
                str(theirs.fileno()), str(index), self._role, pass_fds=(theirs.fileno(),),
                # botocore signs with the AWS CRT when awscrt is installed, and that signer
                # copies every body into a BytesIO (and refuses a streamed one) even when the
                # payload is not signed; its classic signer only signs the headers.
                env={**os.environ, "BOTO_DISABLE_CRT": "true"},
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                # A session (so a process group) of its own: a terminal's Ctrl-C reaches the
                # command only, which stops its workers in order; signalled too, a worker still
                # importing printed a KeyboardInterrupt traceback (PR_SET_PDEATHSIG covers a
                # kill -9 of the command). uvloop takes no process_group.
                start_new_session=True,
            )
        except BaseException as exc:
            ours.close()
            if isinstance(exc, OSError):
                raise self._cannot_start(exc) from None
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        worker = WorkerProcess(index, proc, ours, self._role, self._dying,
                               alive_s=self._alive_s)
        try:
            await worker.send({"config": self._config.model_dump(mode="json"),
                               "node_id": self._node_id}, timeout_s=10.0)
        except (OSError, TimeoutError) as exc:
            worker.lost(f"it did not take its configuration ({exc})")
        log_event(log, logging.INFO, "s3_worker_started", role=self._role, worker=index,
                  pid=proc.pid)
        return worker

    def _cannot_start(self, exc: OSError) -> S3Failure:
        """Why a worker could not start, and what to do: an fd limit is the usual cause."""
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            fix = "raise the open-files limit (ulimit -n, or LimitNOFILE= in the unit)"
        else:
            fix = "see the error"
        if self._role == "reader":
            fix += ", or restore with --readers 0"
        return S3Failure(f"could not start an S3 {self._role} process: "
                         f"{exc.strerror or exc}; {fix}", transient=True, kind="io")

    async def _reap(self, failure: S3Failure) -> None:
        """Wait until every worker found lost has exited (killed, it may still be finishing a
        write in the kernel); ``failure`` if one has not within STOP_TIMEOUT_S."""
        for proc in list(self._dying):
            if not await exited(proc, STOP_TIMEOUT_S):
                raise failure
            with contextlib.suppress(ValueError):
                self._dying.remove(proc)

    async def aclose(self) -> None:
        async with self._start_lock:
            self._closed = True
            workers = [w for w in self._workers if w is not None]
            self._workers = [None] * self._count
        for worker in workers:
            if worker.alive:
                worker.close()  # the worker sees EOF and exits
            closed = S3Failure(f"the S3 backend closed while its {self._role} worker had "
                               "the request", transient=True, kind="io")
            for future in worker.pending.values():
                if not future.done():
                    future.set_exception(closed)
            worker.pending.clear()
        # Waited for together, each killed after STOP_TIMEOUT_S and given as long again to
        # exit (one stuck in the kernel, writing to a hung network filesystem, is left); the
        # lost ones' too, killed already: never waited for, each left its transport to the
        # collector ("unclosed transport", an error under pytest's warnings).
        procs = {id(p): p for p in [*(w.proc for w in workers), *self._dying]}
        self._dying.clear()
        await asyncio.gather(*(stopped(p) for p in procs.values()))
