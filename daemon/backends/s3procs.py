"""The processes of an S3 worker pool (s3pool.WorkerSenders): each one's socket, the answers
it owes matched to their requests, what happens when it is lost, and how it is stopped. The
program they run is s3worker.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import math
import socket
import time
from typing import Any

from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3messages import close_all, encode, receive_ready
from ckptdrain.daemon.logs import log_event

log = logging.getLogger("ckptdrain.daemon.backends.s3pool")

# How long a stopping pool waits for a worker to exit after its socket closed, then kills it.
STOP_TIMEOUT_S = 5.0
# How long a worker may take to start (import botocore, build its client) before it is lost:
# till it says it started, its loop cannot answer a ping.
START_GRACE_S = 60.0
# The least silence after which a started worker is pinged (destination.connect_timeout_s
# above it).
MIN_ALIVE_S = 5.0
# The code of the failure a request gets when its worker died or could not be reached.
WORKER_LOST = "ckptdrain.WorkerLost"
# A slot whose workers keep exiting before they start waits this long before its next start
# after its second such failure in a row, doubling up to the most.
RESTART_BACKOFF_FIRST_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
EXITED_EARLY = "it exited before it started"


class WorkerProcess:
    """One worker process and its socket; answers are matched to requests by id. ``role``:
    "upload" (the daemon's drain) or "reader" (``ckptdrain restore --readers``). A worker
    found lost is killed and its process put in ``dying``, for whoever must know it has
    exited before doing its work again."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process, sock: socket.socket,
                 role: str, dying: list[asyncio.subprocess.Process], *, alive_s: float) -> None:
        self.index = index
        self.proc = proc
        self.sock = sock
        self.role = role
        self._dying = dying
        # Each answer comes with the fds its message carried, owned by whoever awaits it.
        self.pending: dict[int, asyncio.Future[tuple[dict[str, Any], list[int]]]] = {}
        self.alive = True
        self.spawned = time.monotonic()
        # When it last said anything; one silent for ``alive_s`` is asked whether its event
        # loop still runs (a ping), and lost if it does not answer within as long.
        self.heard = self.spawned
        self.alive_s = alive_s
        self.ready = False  # it said it started
        self.why = ""  # why it was found lost
        # Senders take turns (see send), and the one waiting for room in the socket waits on
        # ``_room``, which close() sets.
        self._sending = asyncio.Lock()
        self._room: asyncio.Future[None] | None = None
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    async def send(self, message: dict[str, Any], fds: list[int] | None = None, *,
                   timeout_s: float) -> None:
        """Send one message (``fds`` attached, still the caller's) within ``timeout_s``;
        OSError once the worker is lost. One sender at a time: the event loop keeps one
        writer callback per fd, so where several waited for room in a full socket only the
        last was woken, and the others' sends timed out after 10 s and replaced a healthy
        worker (found attacking: 400 reads at once while a worker started, 122 of them failed
        and the fresh worker was killed). The waiter is woken by close(), never left with a
        writer callback on an fd closed under it: uvloop aborted the daemon then (SIGABRT),
        and the fd's number, reused by the next worker's socket, was another's to remove."""
        data = encode(message)
        async with asyncio.timeout(timeout_s), self._sending:
            while True:
                if not self.alive:
                    raise OSError(errno.EPIPE, f"the S3 {self.role} worker {self.index} was "
                                  f"lost ({self.why})")
                try:
                    socket.send_fds(self.sock, [data], fds or [])
                    return
                except BlockingIOError:
                    await self._wait_for_room()
                except (ConnectionResetError, BrokenPipeError):
                    # It exited (with a message of ours unread: ECONNRESET), and this send
                    # came before the reader callback heard so: the same exit, said the same
                    # way, not the network "Connection reset by peer" names (found attacking:
                    # one request in four to a worker dying at start said that).
                    self.lost("it exited" if self.ready else EXITED_EARLY)

    async def _wait_for_room(self) -> None:
        loop = asyncio.get_running_loop()
        room: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()
        loop.add_writer(fd, _settle, room)
        self._room = room
        try:
            await room
        finally:
            self._room = None
            if self.alive:  # else close() removed it, before the fd was closed
                loop.remove_writer(fd)

    def close(self) -> None:
        """Stop hearing from and sending to the worker and close its socket (it sees EOF);
        a sender waiting for room is woken, and finds the worker lost."""
        self.alive = False
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(self.sock.fileno())
        if self._room is not None:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_writer(self.sock.fileno())
            _settle(self._room)
        self.sock.close()

    def _readable(self) -> None:
        # A reader callback, not a task: it only matches answers to the futures awaiting them.
        while self.alive:
            try:
                got = receive_ready(self.sock)
            except BlockingIOError:
                return
            except ConnectionResetError:
                # It exited with a message of ours unread (a worker dying at start never reads
                # its configuration): an exit, not the network "Connection reset by peer"
                # names, which is what every request of a crash-looping worker said.
                got = None
            except (OSError, ValueError) as exc:
                self.lost(f"its socket failed ({exc})")
                return
            if got is None:
                self.lost("it exited" if self.ready else EXITED_EARLY)
                return
            self.heard = time.monotonic()
            answer, fds = got
            if "started" in answer:
                close_all(fds)
                self.ready = True
                self._started(answer["started"])
                continue
            request_id = answer.get("id")
            if not isinstance(request_id, int):
                # A worker that answers nobody's request is broken: what it has in flight
                # fails as transient (sent again to a fresh one) rather than wait it out.
                close_all(fds)
                self.lost(f"it sent an answer without a request id ({request_id!r:.40})")
                return
            future = self.pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result((answer, fds))
            else:
                close_all(fds)  # nobody waits for it any more: never leak what arrives

    async def answer(self, answer: asyncio.Future[tuple[dict[str, Any], list[int]]],
                     limit_s: float, ids: itertools.count[int]) -> tuple[dict[str, Any], list[int]]:
        """``answer`` (a request's), within ``limit_s`` (TimeoutError past it). Meanwhile a
        worker silent for ``alive_s`` is pinged, and one that answers no ping in as long is
        lost: its requests fail as transient at once. A stopped worker (SIGSTOP, a wedged
        event loop) held the parts it had for ``limit_s``, 650 s by default, before (found
        attacking). ``answer`` itself is never cancelled here (asyncio.wait leaves it be)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait({answer}, timeout=min(left, self.alive_s))
            if done:
                return answer.result()
            silent_s = time.monotonic() - self.heard
            if not self.ready:
                if silent_s >= max(START_GRACE_S, self.alive_s):
                    self.lost(f"it did not start in {silent_s:.0f} s")
            elif silent_s >= self.alive_s and not await self._pinged(next(ids)):
                self.lost(f"it answered no ping in {self.alive_s:g} s (the process is stopped, "
                          "or its event loop is stuck)")

    async def _pinged(self, request_id: int) -> bool:
        """Whether the worker answered a ping within ``alive_s`` (True too where it was lost
        meanwhile: the request's own answer says so)."""
        if not self.alive:
            return True
        pong: asyncio.Future[tuple[dict[str, Any], list[int]]] = (
            asyncio.get_running_loop().create_future())
        self.pending[request_id] = pong
        try:
            async with asyncio.timeout(self.alive_s):
                await self.send({"id": request_id, "op": "ping"}, timeout_s=self.alive_s)
                _, fds = await pong
            close_all(fds)
            return True
        except S3Failure:
            return True
        except (OSError, TimeoutError):
            return not self.alive  # lost meanwhile: the request's own answer says why
        finally:
            self.pending.pop(request_id, None)
            settled(pong)

    def _started(self, figures: Any) -> None:
        if not isinstance(figures, dict):
            return
        log_event(log, logging.INFO, "s3_worker_ready", role=self.role, worker=self.index,
                  pid=self.proc.pid,
                  seconds=round(time.monotonic() - self.spawned, 3),
                  cpu_s=figures.get("cpu_s"), main_thread_cpu_s=figures.get("main_thread_cpu_s"))

    def lost(self, why: str) -> None:
        """The worker is gone: what it had in flight fails as transient (the drain retries)."""
        if not self.alive:
            return
        self.why = why
        self.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        # Those seen to exit are dropped first: a daemon that loses a worker now and then
        # does not keep each one's process for its lifetime.
        self._dying[:] = [p for p in self._dying if p.returncode is None]
        self._dying.append(self.proc)
        log_event(log, logging.WARNING, "s3_worker_lost", role=self.role, worker=self.index,
                  why=why, in_flight=len(self.pending),
                  action=("parts in flight are sent again" if self.role == "upload"
                          else "ranges in flight are read again"))
        failure = S3Failure(f"the S3 {self.role} worker {self.index} stopped ({why}); a new "
                            "one is started for the next request", transient=True, kind="io",
                            code=WORKER_LOST)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(failure)
        self.pending.clear()

    def ended(self) -> str:
        """How its process ended, where that is known yet ("" where not)."""
        code = self.proc.returncode
        if code is None:
            return ""
        return f"exit status {code}" if code >= 0 else f"killed by signal {-code}"


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def settled(future: asyncio.Future[Any]) -> None:
    """Mark a request's answer, failed by the worker's loss after its caller stopped waiting,
    as read: asyncio would log "Future exception was never retrieved" for each at error level
    (found attacking: one per request whose send was cut short by the loss)."""
    if future.done() and not future.cancelled():
        future.exception()


class Restarts:
    """When each worker slot of a pool may start its next worker: at once, unless its workers
    keep exiting before they start (a broken installation, a memory limit too low to start in).
    Found attacking: such a worker was started again for every request and every retry (dozens
    a second, each start costing up to a CPU second), and each request failed saying "its
    socket failed (Connection reset by peer)", which points at the network. Now from its second
    failed start in a row the slot waits (RESTART_BACKOFF_FIRST_S, doubling), and requests that
    find no worker to send them fail at once saying why and what to look at."""

    def __init__(self, count: int, role: str) -> None:
        self._role = role
        self._failed = [0] * count  # failed starts in a row, per slot
        self._not_before = [0.0] * count  # monotonic time of the slot's next start
        self._why = [""] * count

    def started(self, index: int) -> None:
        """Slot ``index``'s worker said it started: its next loss starts the next at once."""
        self._failed[index] = 0
        self._not_before[index] = 0.0

    def lost(self, worker: WorkerProcess) -> None:
        """``worker`` was found lost (called once for it, before its slot starts another)."""
        i = worker.index
        if worker.ready:
            self.started(i)
            return
        self._failed[i] += 1
        said = [] if worker.why == EXITED_EARLY else [worker.why]
        self._why[i] = ", ".join(said + ([worker.ended()] if worker.ended() else []))
        if self._failed[i] < 2:
            return  # once is an accident (a kill, the OOM killer): started again at once
        # Doubled no further than the most: 2 ** n as a float overflows past n = 1023 (some
        # 8.5 hours of failed starts), and raised OverflowError out of every request.
        doublings = min(self._failed[i] - 2, 32)
        delay_s = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_FIRST_S * 2 ** doublings)
        self._not_before[i] = time.monotonic() + delay_s
        log_event(log, logging.WARNING, "s3_worker_restart_delayed", role=self._role,
                  worker=i, failed_starts=self._failed[i], delay_s=delay_s, why=self._why[i],
                  action=self._action())

    def may_start(self, index: int) -> bool:
        return time.monotonic() >= self._not_before[index]

    def failure(self) -> S3Failure:
        """What a request gets while no slot has a worker and none may start one yet."""
        i = min(range(len(self._not_before)), key=self._not_before.__getitem__)
        wait_s = max(0.0, self._not_before[i] - time.monotonic())
        why = f" ({self._why[i]})" if self._why[i] else ""
        return S3Failure(f"the S3 {self._role} worker {i} exited before it started, "
                         f"{self._failed[i]} times in a row{why}; the next is started in "
                         f"{math.ceil(wait_s)} s. {self._action()}", transient=True, kind="io")

    def _action(self) -> str:
        instead = ("drain.workers = 0 sends from the daemon itself meanwhile"
                   if self._role == "upload" else "--readers 0 reads without them")
        return ("What it printed is in the daemon's log (journalctl -u ckptdrain): look for a "
                "broken installation or a memory limit too low for it to start; " + instead)


async def exited(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        return False
    return True


async def stopped(proc: asyncio.subprocess.Process) -> None:
    if await exited(proc, STOP_TIMEOUT_S):
        return
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    if not await exited(proc, STOP_TIMEOUT_S):
        log_event(log, logging.WARNING, "s3_worker_left", pid=proc.pid,
                  why="killed, it did not exit (stuck in the kernel)")
