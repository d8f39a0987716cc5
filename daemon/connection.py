"""One client connection: a SERVER-role wire machine fed from a :class:`Channel`, behind the
daemon's failure boundary.

The boundary (uvicorn's per-request ``except`` is the model): an exception nobody expected in
one connection is logged once with its traceback at error level, the client gets a typed
``internal`` error, that connection closes, and the daemon and every other client carry on.
Expected conditions are :class:`RequestError`: a typed reply, and the connection goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptdrain.client import wire
from ckptdrain.client.manifest import ManifestError, NewerFormat
from ckptdrain.client.wire import Message, ProtocolError
from ckptdrain.daemon import catalog, maintenance, owners, payloads, reads, waits
from ckptdrain.daemon.access import Peer
from ckptdrain.daemon.allowance import TurnedAway
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.channel import Channel, DescriptorsShort, IdleTimeout, is_memfd
from ckptdrain.daemon.errors import DaemonError, RequestError, descriptors_short
from ckptdrain.daemon.fdcloser import MAX_FDS_HELD_PER_UID, MAX_PIPE_CLOSES_PER_UID
from ckptdrain.daemon.journalfaults import JournalFull
from ckptdrain.daemon.ledger import GenerationRecord
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.records import SAVE_AGAIN
from ckptdrain.daemon.state import (
    GenerationEvent,
    GenerationState,
    RankEvent,
    RankState,
)

if TYPE_CHECKING:
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger("ckptdrain.connection")

ACK_STRENGTH = {"memory": 0, "local": 1}
# Error replies that draw on the uid's allowance (allowance.py), and how much: in full what a
# correct client never gets. A `not_found` a reader meets for every shard with no local copy
# before it reads the destination (charged in full, 64 ranks restoring were held and 15
# turned away), yet a loop of them (8,500 a second) slowed another user's saves 7 times:
# a twentieth each, 2000 within the default burst (both found attacking).
_CHARGED_ERRORS = {wire.BAD_REQUEST: 1.0, wire.INVALID_NAME: 1.0, wire.PERMISSION_DENIED: 1.0,
                   wire.UNSUPPORTED_VERSION: 1.0, wire.NOT_FOUND: 0.05}
# A read that costs the loop many times a hand-off's request and that nothing needs often: a
# user's draw on the allowance too (found attacking: four connections of one user asking
# `status` back to back, 7400 a second, made another user's puts 13 times slower). An
# operator (root, the daemon's uid) polls it freely. Not `latest`: every rank of a restore
# asks it twice, and it cost the other user 2 to 3 times, not 13.
_METERED_READS = frozenset({"status"})
# Requests that are not hand-offs: a stop does not wait for them.
_NOT_BUSY = frozenset({"wait", "status", "latest", "drain", "resume", "open"})


# How long a connection of a uid with closes waiting waits for them before it is refused.
CLOSES_GRACE_S = 1.0

class PipesHeld(DaemonError):
    """The client's uid holds the locks of too many pipes it passed for them to be closed."""


class ClientHandler:
    def __init__(self, daemon: Daemon, sock: socket.socket, peer: Peer) -> None:
        self.d = daemon
        limits = daemon.config.limits
        self.channel = Channel(sock, idle_timeout_s=limits.client_idle_timeout_s,
                               min_bytes_per_s=limits.client_min_bytes_per_s,
                               rate_grace_s=limits.client_rate_grace_s,
                               closer=daemon.dataplane.closer, owner=peer.uid,
                               held_off=self._fds_held)
        self.conn = wire.Connection(wire.Role.SERVER)
        self.peer = peer  # checked against [access] at accept (listener.py)
        self.uid = peer.uid
        self.gid = peer.gid
        # A shard's bytes are due (its put was admitted): paced by the rate floor, never
        # the long between-requests timeout of an open rank.
        self.receiving_payload = False
        self.gen: GenerationRecord | None = None
        self.rank: int | None = None
        self.busy = False  # serving a hand-off request right now (see Listener._drain)
        self.ack: str = daemon.config.ack  # the boundary in force for this connection's rank
        self.reply_fd: int | None = None  # an fd the next `ok` hands the client (`open`)
        # Requests read after the hello. A connection that ends before its first is charged;
        # one whose client is killed while its first request runs (a `begin` waiting for a
        # slot, a `wait`: each a connection of its own) is not (found reviewing: five killed
        # waiters held their uid's restart).
        self.requests = 0
        self.charged = False  # this connection drew on its uid's error allowance

    async def run(self) -> None:
        try:
            # A connection held (or turned away) has paid by waiting: not charged again if it
            # ends with no request (a client giving up, or retrying after backpressure).
            self.charged = await self.d.allowance.hold(self.uid, self.peer.pid)
            await self._serve()
        except TurnedAway as exc:
            self.charged = True
            await self._last_word(wire.BACKPRESSURE, str(exc),
                                  {"limit": "client_errors_per_s",
                                   "retry_after_s": round(exc.retry_after_s, 1)})
        except PipesHeld as exc:
            self.charged = True  # its own wait: held off till its pipes close, not billed
            self._client_error("request_refused", reason=str(exc))
            await self._last_word(wire.BACKPRESSURE, str(exc),
                                  {"limit": "pipes_held", "retry_after_s": 5.0})
        except DescriptorsShort as exc:
            self.charged = True  # the daemon's shortage: nothing for the client's uid to pay
            self.d.client_log.log_event(log, logging.WARNING, "descriptors_short",
                                        cause="descriptors_short", uid=self.uid, error=str(exc))
            refusal = descriptors_short(str(exc))
            await self._last_word(refusal.code, refusal.message, refusal.details)
        except IdleTimeout as exc:
            self._client_error("client_dropped", reason=str(exc))
            # Said before hanging up, so the client's next request reads why.
            await self._last_word(wire.TIMEOUT, f"the daemon closed this connection: {exc}; "
                                  f"{exc.hint}")
        except (ConnectionError, TimeoutError) as exc:
            self._client_error("client_dropped", reason=str(exc) or type(exc).__name__)
        except ProtocolError as exc:
            if exc.truncated:  # it hung up mid-frame: a killed process, not a bad frame
                self._client_error("client_dropped", reason=exc.message)
            else:
                self._client_error("client_protocol_error", code=exc.code, error=exc.message)
                self._charge()
                await self._last_word(exc.code, exc.message)
        except Exception:
            # The boundary. Nothing this client did may end the daemon.
            log.exception("unexpected error serving uid %s; closing that connection", self.uid)
            self.d.metrics.internal_error("connection")
            self.charged = True  # the daemon's fault: nothing for the client's uid to pay
            await self._last_word(wire.INTERNAL, "the daemon hit an internal error serving this "
                                  "connection and closed it (it is logged); reconnect and retry")
        finally:
            if self.requests == 0 and not self.charged:
                self._charge()  # a connection that carried no request: it cost the loop all the same
            try:
                await self._abandon()
            except Exception:
                log.exception("could not abort the rank of a closed connection (uid %s)", self.uid)
            finally:
                self.channel.close()

    def _client_error(self, event: str, **fields: Any) -> None:
        self.d.metrics.client_error(event)
        self.d.client_log.log_event(log, logging.INFO, event, cause=f"uid {self.uid}",
                                    uid=self.uid, pid=self.peer.pid, **fields)

    def _charge(self, cost: float = 1.0) -> None:
        """This connection's client caused an error: its uid's allowance pays (allowance.py)."""
        self.charged = True
        self.d.allowance.charge(self.uid, cost)

    async def _pay(self, cost: float = 1.0) -> None:
        """:meth:`_charge`, then wait before the next frame while the uid is over."""
        self._charge(cost)
        await self.d.allowance.hold(self.uid, self.peer.pid)

    async def _last_word(self, code: str, message: str,
                         details: dict[str, Any] | None = None) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self.channel.sendall(self.conn.send_error(code, message, details))

    async def _abandon(self) -> None:
        """A client that leaves without sealing aborts its rank: the rank is incomplete."""
        gen, rank = self.gen, self.rank
        if gen is None or rank is None or gen.ranks.get(rank) is not RankState.OPEN:
            return
        # At a stop the daemon hung up itself: blaming the client sent operators looking at
        # the training job (found attacking).
        why = ("the daemon stopped while the rank was handing off" if self.d.stopping
               else "the client disconnected before sealing the rank")
        await self.abort_rank(gen, rank, why)

    async def send(self, kind: str, fields: dict[str, Any] | None = None) -> None:
        await self.channel.sendall(self.conn.send(kind, fields or {}))

    async def _receive(self) -> None:
        await self.channel.receive(self.conn.receive_data, self.conn.received_bytes)

    async def receive_more(self) -> None:
        """More of a payload the wire machine needs (payloads.receive_inline): on the rate
        floor that began with it, and the short idle timeout."""
        self.channel.idle_timeout_s = self.d.config.limits.client_idle_timeout_s
        await self._receive()

    async def next_message(self) -> Message | None:
        limits = self.d.config.limits
        while True:
            event = self.conn.next_event()
            if event is wire.NEED_DATA:
                # Between requests, a rank in progress may wait long (its process is busy
                # computing the next shard); anything else, or a stall mid-frame, may not.
                # A frame begun, or a shard's bytes due, must also keep the minimum rate.
                mid_frame = self.conn.buffered > 0 or self.receiving_payload
                if mid_frame:
                    self.channel.begin_transfer()
                else:
                    self.channel.end_transfer()
                between = not mid_frame and self.gen is not None and not self.gen.terminal
                self.channel.idle_timeout_s = (limits.open_rank_idle_timeout_s if between
                                               else limits.client_idle_timeout_s)
                await self._receive()
                continue
            if isinstance(event, wire.ConnectionClosed):
                return None
            if isinstance(event, Message | wire.Rejected):
                self.channel.claim(self.conn.frame_start)
            if isinstance(event, Message):
                if not wire.needs_fd(event.kind):
                    self.channel.drop_frame_fds()
                if not self.receiving_payload:
                    self.channel.end_transfer()
                return event
            if isinstance(event, wire.Rejected):
                # A whole frame with a bad field: refused, and the conversation goes on.
                self.channel.drop_frame_fds()
                self._client_error("request_refused", kind=event.kind, code=event.code,
                                   error=event.message)
                await self.channel.sendall(self.conn.send_error(event.code, event.message))
                self._drop_unclaimed_fds()
                await self._pay()
                continue
            raise ProtocolError(wire.BAD_REQUEST, f"unexpected {type(event).__name__}")

    async def _pipes_held(self) -> None:
        """Serve no more of a uid with MAX_PIPE_CLOSES_PER_UID closes of its fds (or of its
        connections) waiting: a pipe whose lock a process of its holds makes its last close
        wait, and every message may bring one more (fdcloser.py). A burst of closes that end
        at once (200 fds passed in one message) is waited out first."""
        await self._held_off(self.d.dataplane.closer.closes_of, MAX_PIPE_CLOSES_PER_UID)

    async def _fds_held(self) -> None:
        """Read no more from a uid with MAX_FDS_HELD_PER_UID fds in the daemon's hands
        (Channel.receive, before each read)."""
        await self._held_off(self.d.dataplane.closer.fds_of, MAX_FDS_HELD_PER_UID)

    async def _held_off(self, count: Callable[[object], int], limit: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSES_GRACE_S
        while (held := count(self.uid)) >= limit:
            if loop.time() >= deadline:
                raise PipesHeld(f"{held} fds uid {self.uid} passed cannot be closed yet: a "
                                "process of this user holds the lock of a pipe among them (a "
                                "read or splice on it that does not end), or they are on a "
                                "mount that does not answer; end it, then reconnect")
            await asyncio.sleep(0.02)

    async def _serve(self) -> None:
        await self._pipes_held()
        hello = await self.next_message()
        if hello is None:
            return
        if hello.fields.get("version") != wire.PROTOCOL_VERSION:
            raise ProtocolError(wire.UNSUPPORTED_VERSION,
                                f"this daemon speaks protocol version {wire.PROTOCOL_VERSION}, "
                                f"the client {hello.fields.get('version')}; upgrade the older side")
        self._drop_unclaimed_fds()
        await self.send("welcome", {"version": wire.PROTOCOL_VERSION, "node_id": self.d.node_id})
        while True:
            await self._pipes_held()
            msg = await self.next_message()
            if msg is None:
                return
            self.requests += 1
            # A hand-off in progress is let finish on shutdown; a long `wait` is not one.
            self.busy = msg.kind not in _NOT_BUSY
            try:
                reply = await self._dispatch(msg)
            except (RequestError, JournalFull) as caught:
                exc = caught if isinstance(caught, RequestError) else self._journal_full(caught)
                await self.channel.sendall(self.conn.send_error(exc.code, exc.message, exc.details or None))
                if self.conn.payload_remaining or self.conn.awaiting_data is not None:
                    # Failed part-way through a shard's bytes: the rest of them are still on
                    # the way and cannot be told apart from the next frame. Hang up.
                    return
                self._drop_unclaimed_fds()
                if exc.code in _CHARGED_ERRORS:
                    self.busy = False  # a held connection is no hand-off in flight
                    await self._pay(_CHARGED_ERRORS[exc.code])
                continue
            finally:
                self.busy = False
            self._drop_unclaimed_fds()
            fd, self.reply_fd = self.reply_fd, None
            if fd is None:
                await self.send("ok", reply)
            else:
                try:
                    await self.channel.send_with_fd(self.conn.send("ok", reply), fd)
                finally:
                    os.close(fd)
            if msg.kind in _METERED_READS and not self.peer.operator:
                await self._pay()

    def _journal_full(self, exc: JournalFull) -> RequestError:
        """Nothing new is journalled while the staging filesystem is full (Journal.write): a
        begin or a hand-off is refused as backpressure on the disk, as a full staging disk is."""
        self.d.metrics.backpressure("rejected", "staging_filesystem")
        return RequestError(wire.BACKPRESSURE, str(exc),
                            {"limit": "staging_filesystem", "retry_after_s": 5.0})

    def _drop_unclaimed_fds(self) -> None:
        """Fds passed on frames that take none are closed once the request is done. Only when
        nothing more is buffered: a pipelined next frame's fd may already have arrived."""
        if self.conn.buffered == 0 and self.channel.fds:
            dropped = self.channel.close_fds()
            log_event(log, logging.DEBUG, "unclaimed_fds_closed", uid=self.uid, fds=dropped)

    async def _dispatch(self, msg: Message) -> dict[str, Any]:
        f = msg.fields
        kind = msg.kind
        if kind == "begin":
            return await self.begin(f["job"], f["step"], f["rank"], f["world_size"], f.get("ack"),
                                    f.get("attempt") or "")
        if kind == "put_bytes":
            # Read whole before anything is decided: a refusal then leaves no bytes of it in
            # the stream, and the conversation goes on. Only the rank's own shard is a
            # hand-off a stopping daemon lets finish: a stranger's stalled payload is not.
            try:
                mine: tuple[GenerationRecord, int] | RequestError = self._own_rank(f)
            except RequestError as exc:
                mine = exc
            self.busy = not isinstance(mine, RequestError)
            inline = await payloads.receive_inline(self)
            if isinstance(mine, RequestError):
                raise mine
            gen, rank = mine
            return await self.d.handoffs.stage(self, gen, rank, f["path"], f["size"], None,
                                               bool(f.get("deferred", False)), inline)
        if kind in ("put", "put_fd", "put_memfd"):
            return await self._put(kind, f["job"], f["step"], f["rank"], f["path"], f["size"],
                                   bool(f.get("deferred", False)))
        if kind == "seal":
            return await self.seal(self._own_rank(f))
        if kind == "abort":
            gen, rank = self._own_rank(f)
            await self.abort_rank(gen, rank, f"the client aborted: {f['reason']}")
            return {}
        if kind in ("wait", "latest"):
            # A node that does not track the job still answers from the destination.
            await self.check_destination_owner(f["job"])
            self.check_job_visible(f["job"])
        if kind == "wait":
            # A waiter that hangs up ends its wait: it must not keep its slot till the timeout.
            with self.channel.hangup_watch() as gone:
                try:
                    reply = await waits.wait_for_commit(
                        self.d, f["job"], f["step"], float(f["timeout_s"]),
                        f.get("attempt") or "", gone=gone)
                except RequestError:
                    await self._may_still_see(f["job"])  # a failure or a timeout says as much
                    raise
            await self._may_still_see(f["job"])
            return reply
        if kind == "latest":
            return await self._latest(f["job"])
        if kind == "status":
            return self.d.status(job=f.get("job"), peer=self.peer)
        if kind == "retry":
            return await maintenance.retry(self, f["job"], f["step"])
        if kind == "open":
            self.reply_fd = await reads.open_local(self, f["job"], f["step"], f["path"])
            return {"job": f["job"], "step": f["step"], "path": f["path"]}
        if kind == "fetch":
            return await reads.fetch(self, f["job"], f["step"], f["path"],
                                     self.channel.take_frame_fd(kind),  # owned by the call
                                     from_destination=f.get("source") == "destination")
        if kind in ("drain", "resume"):
            return maintenance.drain(self.d, self.peer) if kind == "drain" else \
                maintenance.resume(self.d, self.peer)
        if kind == "abort_generation":
            self.check_job_owner(f["job"])
            return await maintenance.abort_generation(self.d, self.uid, f["job"], f["step"],
                                                      f.get("reason") or "")
        raise RequestError(wire.BAD_REQUEST, f"{kind!r} is not a request a client may send")

    async def _latest(self, job: str) -> dict[str, Any]:
        try:
            step = await catalog.latest(self.d.backend, job)
        except catalog.NeedsUpgrade as exc:  # committed, by a newer version: no older answer
            raise RequestError(wire.DESTINATION, f"{exc} (this daemon's)") from None
        except (BackendError, ManifestError, OSError) as exc:
            raise destination_error(job, None, exc) from None
        # Where the job's generations lie (`Client.latest_path`): `<root>/<step:020d>`.
        return {"job": job, "generation": step,
                "root": f"{self.d.config.destination.uri.rstrip('/')}/{job}"}

    # -- hand-off requests -------------------------------------------------------------------
    async def _may_still_see(self, job: str) -> None:
        """What a `wait` found is told only to a waiter who may see ``job`` now: checked when
        it began only, a wait on a name nobody used yet was told another user's commit of
        it, with its time and attempt (found attacking)."""
        await self.check_destination_owner(job)
        self.check_job_visible(job)

    def check_job_visible(self, job: str) -> None:
        """A user learns nothing of another user's job (root and the daemon's uid see all)."""
        if not self.peer.may_see(self.d.ledger.jobs.get(job)):
            raise RequestError(wire.PERMISSION_DENIED, f"job {job!r} belongs to another user; "
                               f"uid {self.uid} may not see it")

    async def settle_owner(self, job: str, *, reading: bool) -> None:
        """Before the ledger's owner of ``job`` is trusted: settled with the destination if
        it was recorded without its word (owners.settle). A write goes on when the
        destination cannot answer now (the commit checks); a read fails."""
        d = self.d
        if self.peer.operator or not d.config.access.check_destination_owner:
            return
        try:
            await owners.settle(d, job)
        except (BackendError, ManifestError, OSError, TimeoutError) as exc:
            if reading:
                raise destination_error(job, None, exc) from None

    async def check_destination_owner(self, job: str) -> None:
        """A job this node does not track (or tracks unverified) is read for a peer only when
        its commits at the destination name no other owner (owners.py): the daemon reads
        with its own rights."""
        d = self.d
        if self.peer.operator or not d.config.access.check_destination_owner:
            return
        await self.settle_owner(job, reading=True)
        if job in d.ledger.jobs:
            return
        try:
            async with asyncio.timeout(owners.LOOKUP_TIMEOUT_S):
                owner = await d.committer.owners.someone_else(job, self.uid)
        except (BackendError, ManifestError, OSError, TimeoutError) as exc:
            raise destination_error(job, None, exc) from None
        if owner is not None:
            raise RequestError(wire.PERMISSION_DENIED, owners.refusal(job, self.uid))

    def check_job_owner(self, job: str) -> None:
        """Writes to a job: its owner's, or an operator's (root or the daemon's uid, who act
        for the owner)."""
        owner = self.d.ledger.jobs.get(job)
        if owner is not None and owner != self.uid and not self.peer.operator:
            raise RequestError(wire.PERMISSION_DENIED,
                               f"job {job!r} belongs to {self._owner_name(owner)}; uid "
                               f"{self.uid} may not write it")

    def _owner_name(self, owner: int) -> str:
        # Operators are told which uid; other users only that it is not theirs.
        return f"uid {owner}" if self.peer.operator else "another user"

    def _own_rank(self, f: dict[str, Any]) -> tuple[GenerationRecord, int]:
        gen, rank = self.gen, self.rank
        if gen is None or rank is None:
            raise RequestError(wire.BAD_REQUEST, "send begin before handing off shards")
        if (f["job"], f["step"], f["rank"]) != (gen.job, gen.step, rank):
            raise RequestError(wire.BAD_REQUEST, f"this connection began job {gen.job!r} step "
                               f"{gen.step} rank {rank}, not job {f['job']!r} step {f['step']} "
                               f"rank {f['rank']}")
        if gen.terminal:
            raise RequestError(wire.GENERATION_FAILED, f"step {gen.step} of job {gen.job!r} is "
                               f"{gen.state}: {gen.error}")
        if gen.ranks.get(rank) is not RankState.OPEN:
            raise RequestError(wire.GENERATION_FAILED, f"rank {rank} is {gen.ranks.get(rank)}: "
                               f"{gen.error or 'no more shards accepted'}")
        return gen, rank

    def still_open(self, gen: GenerationRecord, rank: int) -> None:
        if gen.terminal or gen.ranks.get(rank) is not RankState.OPEN:
            raise RequestError(wire.GENERATION_FAILED, f"step {gen.step} of job {gen.job!r} "
                               f"ended while this shard was handed off ({gen.state}: {gen.error})")

    async def _put(self, kind: str, job: str, step: int, rank: int, path: str, size: int,
                   deferred: bool) -> dict[str, Any]:
        fd = self.channel.take_frame_fd(kind) if wire.needs_fd(kind) else None
        try:
            gen, rank = self._own_rank({"job": job, "step": step, "rank": rank})
            if kind == "put_memfd" and fd is not None and not is_memfd(fd):
                # Checked before any lock is taken on it: a lock on a file of a network
                # filesystem can wait on a server, and nothing here may wait on the loop.
                raise RequestError(wire.BAD_REQUEST, f"the fd passed with put_memfd for {path!r} "
                                   "is not a memfd; pass a memfd_create() fd, or use put_fd")
        except BaseException:
            if fd is not None:
                self.d.dataplane.close_client_fd(fd, self.uid)
            raise
        # From here the hand-off owns the fd (closes it, or leaves it to a stuck thread).
        if kind == "put_memfd" and self.ack == "memory" and fd is not None:
            return await self.d.held.hold(self, gen, rank, path, size, fd, deferred)
        return await self.d.handoffs.stage(self, gen, rank, path, size, fd, deferred)

    async def begin(self, job: str, step: int, rank: int, world_size: int, ack: str | None,
                    attempt: str) -> dict[str, Any]:
        if self.gen is not None:
            raise RequestError(wire.BAD_REQUEST, "this connection already began a rank; "
                               "use one connection per generation and rank")
        if rank >= world_size:
            raise RequestError(wire.BAD_REQUEST, f"rank {rank} is outside world_size {world_size}")
        max_world_size = self.d.config.limits.max_world_size
        if world_size > max_world_size:
            raise RequestError(wire.BAD_REQUEST, f"world_size {world_size} is over this daemon's "
                               f"limits.max_world_size ({max_world_size}); ask the operator to "
                               "raise it")
        await self.settle_owner(job, reading=False)
        self.check_job_owner(job)
        effective: str = self.d.config.ack
        if ack is not None and ACK_STRENGTH[ack] > ACK_STRENGTH[effective]:
            effective = ack
        gen = await self.d.generations.begin_generation(
            job, step, world_size, effective, self.uid, attempt,
            connected=self.channel.unless_hung_up)
        if gen.world_size != world_size:
            raise RequestError(wire.BAD_REQUEST, f"step {step} of job {job!r} began with world_size "
                               f"{gen.world_size}, not {world_size}")
        if gen.state is GenerationState.COMMITTED:
            raise RequestError(wire.COMMITTED, f"step {step} of job {job!r} is committed; save a "
                               "new step")
        if gen.terminal:
            # Said once: a generation a restart ended carries it in its error already.
            then = "" if (gen.error or "").endswith(SAVE_AGAIN) else f"; {SAVE_AGAIN}"
            raise RequestError(wire.GENERATION_FAILED, f"step {step} of job {job!r} is "
                               f"{gen.state} for this attempt: {gen.error}{then}")
        if rank in gen.ranks:
            raise RequestError(wire.DUPLICATE, f"rank {rank} of step {step} of job {job!r} already "
                               f"began on this node ({gen.ranks[rank]})")
        if gen.state is GenerationState.RECORDED:
            await self.d.ledger.apply(gen, GenerationEvent.REOPENED)
        await self.d.ledger.open_rank(gen, rank)
        self.gen, self.rank, self.ack = gen, rank, effective
        # inline_bytes: this daemon takes a shard that small as one put_bytes frame.
        return {"job": job, "step": step, "rank": rank, "ack": effective, "node_id": self.d.node_id,
                "inline_bytes": wire.INLINE_MAX_BYTES}

    async def seal(self, owned: tuple[GenerationRecord, int]) -> dict[str, Any]:
        gen, rank = owned
        await self.d.ledger.apply((gen, rank), RankEvent.SEALED)
        shards = [s for s in gen.shards.values() if s.rank == rank]
        self.d.spawn_advance(gen)  # the commit outlives this request: the supervisor owns it
        return {"job": gen.job, "step": gen.step, "rank": rank, "shards": len(shards),
                "bytes": sum(s.size for s in shards)}

    async def abort_rank(self, gen: GenerationRecord, rank: int, reason: str) -> None:
        await self.d.generations.give_up(gen, f"rank {rank}: {reason}", ranks=(rank,))


def destination_error(job: str, step: int | None, exc: BaseException) -> RequestError:
    what = f"step {step} of job {job!r}" if step is not None else f"job {job!r}"
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, NewerFormat):  # not damage: `verify` would say the same
        return RequestError(wire.DESTINATION, f"{what} was committed by a newer ckptdrain at "
                            f"the destination ({detail}); upgrade this node's daemon")
    if isinstance(exc, ManifestError):
        return RequestError(wire.DESTINATION, f"the manifest of {what} at the destination is "
                            f"damaged: {detail}; run `ckptdrain verify` on it")
    return RequestError(wire.DESTINATION, f"could not read {what} at the destination: {detail}; "
                        "check the destination and retry")
