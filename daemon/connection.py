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
from ckptdrain.client.manifest import ManifestError
from ckptdrain.client.wire import Message, ProtocolError
from ckptdrain.daemon import catalog, maintenance, payloads, permissions, ranks, reads, waits
from ckptdrain.daemon.access import Peer
from ckptdrain.daemon.allowance import TurnedAway
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.channel import Channel, DescriptorsShort, IdleTimeout
from ckptdrain.daemon.errors import DaemonError, RequestError, descriptors_short, destination_error
from ckptdrain.daemon.fdcloser import MAX_FDS_HELD_PER_UID, MAX_PIPE_CLOSES_PER_UID
from ckptdrain.daemon.journalfaults import JournalFull
from ckptdrain.daemon.ledger import GenerationRecord
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.state import RankState

if TYPE_CHECKING:
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger("ckptdrain.connection")

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
                                  f"{exc.hint}", exc.details)
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
        await ranks.abort_rank(self, gen, rank, why)

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
            return await ranks.begin(self, f["job"], f["step"], f["rank"], f["world_size"],
                                     f.get("ack"), f.get("attempt") or "")
        if kind == "put_bytes":
            # Read whole before anything is decided: a refusal then leaves no bytes of it in
            # the stream, and the conversation goes on. Only the rank's own shard is a
            # hand-off a stopping daemon lets finish: a stranger's stalled payload is not.
            try:
                mine: tuple[GenerationRecord, int] | RequestError = ranks.own_rank(self, f)
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
            return await ranks.put(self, kind, f["job"], f["step"], f["rank"], f["path"],
                                   f["size"], bool(f.get("deferred", False)))
        if kind == "seal":
            return await ranks.seal(self, ranks.own_rank(self, f))
        if kind == "abort":
            gen, rank = ranks.own_rank(self, f)
            await ranks.abort_rank(self, gen, rank, f"the client aborted: {f['reason']}")
            return {}
        if kind in ("wait", "latest"):
            # A node that does not track the job still answers from the destination.
            await permissions.check_destination_owner(self, f["job"])
            permissions.check_job_visible(self, f["job"])
        if kind == "wait":
            # A waiter that hangs up ends its wait: it must not keep its slot till the timeout.
            with self.channel.hangup_watch() as gone:
                try:
                    reply = await waits.wait_for_commit(
                        self.d, f["job"], f["step"], float(f["timeout_s"]),
                        f.get("attempt") or "", gone=gone)
                except RequestError:
                    await permissions.may_still_see(self, f["job"])  # a failure or a timeout says as much
                    raise
            await permissions.may_still_see(self, f["job"])
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
            permissions.check_job_owner(self, f["job"], "abort it")
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
