"""The hand-off: a shard's bytes from a client into staging, or held in RAM (ack=memory).

The event loop decides and journals; every byte copy, fsync, statvfs and unlink runs in the
data plane's threads (:mod:`.dataplane`). Resources have one owner at a time: the request
holds the reservations and file descriptors until the shard is journalled, then the shard
owns its room (:mod:`.copies`). When a blocking call outlives ``io_timeout_s`` its thread
keeps the descriptors it was given and closes them when it returns; nobody else does.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptdrain.client import wire
from ckptdrain.client.manifest import MAX_RECORD_BYTES, entry_bytes
from ckptdrain.daemon import payloads
from ckptdrain.daemon.budget import Reservation
from ckptdrain.daemon.dataplane import SourceEnded, SourceUnreadable, kernel_copy, readable
from ckptdrain.daemon.errors import RUN_OUT, RequestError, StuckIO, descriptors_short
from ckptdrain.daemon.ledger import GenerationRecord, ShardRecord
from ckptdrain.daemon.ranks import still_open
from ckptdrain.daemon.staging import (
    NO_BYTES_ADVICE,
    NO_INODES_ADVICE,
    StagingFull,
)
from ckptdrain.daemon.state import ShardState

if TYPE_CHECKING:
    from ckptdrain.daemon.connection import ClientHandler
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger(__name__)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# What a staging directory that takes no new files answers: a filesystem remounted read-only
# (after a disk error), an immutable directory, permissions changed under the daemon.
_REFUSED = (errno.EROFS, errno.EPERM, errno.EACCES)


def close_fds(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


# A part record's lines besides its shards' (its clocks, ranks, an abort reason): the room a
# hand-off leaves them under MAX_RECORD_BYTES.
RECORD_HEADER_BYTES = 1 << 20


def _disk_full(path: str, free_inodes: int | None) -> RequestError:
    """The refusal of a hand-off the staging filesystem refused (ENOSPC, EDQUOT): out of
    inodes when ``free_inodes`` (sampled after the refusal) says so, else out of bytes."""
    if free_inodes is not None and free_inodes < 2:
        what, advice = "filesystem out of inodes (files)", NO_INODES_ADVICE
    else:
        what, advice = "disk full", NO_BYTES_ADVICE
    return RequestError(wire.BACKPRESSURE, f"staging {what} while receiving {path!r}; {advice}",
                        {"limit": "staging_filesystem", "retry_after_s": 5.0})


def _staging_refused(path: str, directory: Path, exc: OSError) -> RequestError:
    """The refusal of a hand-off whose staged file the staging directory would not take: the
    node's condition, not a daemon bug (it was ``internal``, found attacking the staging side
    with the directory made immutable), and one no wait of the client's fixes."""
    return RequestError(
        wire.UNAVAILABLE,
        f"could not stage {path!r}: the staging directory {directory} refuses new files "
        f"({exc.strerror}); no hand-off is taken until an operator makes it writable again "
        "(a filesystem remounted read-only after a disk error: see dmesg), then save the "
        "step again")


class Handoffs:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def check_new_shard(self, gen: GenerationRecord, path: str, size: int, rank: int) -> None:
        if path in gen.shards or path in gen.receiving:
            raise RequestError(wire.DUPLICATE, f"shard {path!r} was already handed off in step "
                               f"{gen.step} of job {gen.job!r}; shard paths are unique per generation")
        clash = gen.path_clash(path)
        if clash is not None:
            # Refused now, not found at drain time (the destination cannot hold a file and a
            # directory of one name), where it failed the whole generation.
            raise RequestError(wire.INVALID_NAME, f"shard {path!r} and shard {clash!r} of step "
                               f"{gen.step} of job {gen.job!r} cannot both exist: one is a "
                               "directory of the other; rename one of them")
        node = self.d.config.node_id
        lines = (gen.line_bytes + len(gen.shards) * len(node)
                 + entry_bytes(path, size, rank, node))
        if lines > MAX_RECORD_BYTES - RECORD_HEADER_BYTES:
            # Refused now: drained, the generation would fail at its commit, its part record
            # or manifest over what a reader takes (found attacking: 62,000 shards acknowledged,
            # then the commit failed; across nodes, one node said committed while readers
            # ignored the manifest).
            raise RequestError(wire.BAD_REQUEST, f"step {gen.step} of job {gen.job!r} lists "
                               f"too many shards for its manifest: with {path!r} this node's "
                               f"record of its {len(gen.shards) + 1} shards would pass the "
                               f"{MAX_RECORD_BYTES >> 20} MiB a reader takes; save fewer, "
                               "larger files (with DCP, single_file_per_rank=True)")
        limit = self.d.config.limits.max_shard_bytes
        if size > limit:
            # Said what to do, as the refusal of a shard over a whole staging limit does (it
            # named the limit only: found as a job author).
            raise RequestError(wire.BAD_REQUEST, f"shard {path!r} is {size} bytes, over "
                               f"limits.max_shard_bytes ({limit}); split it into smaller "
                               "shards, or raise limits.max_shard_bytes",
                               {"limit": "max_shard_bytes", "limit_value": limit,
                                "requested": size})

    async def check_source(self, uid: int, fd: int, path: str, size: int, what: str) -> None:
        if not readable(fd):
            raise RequestError(wire.BAD_REQUEST, f"the {what} passed for {path!r} is not open for "
                               "reading; open it O_RDONLY or O_RDWR")
        # fstat of a file on a hung network mount can block: in the client's own lane of the
        # data plane, with a timeout. A memfd (the connection checked it is one) cannot: its
        # fstat is done here, without a thread hop before an ack=memory acknowledgement.
        st = (os.fstat(fd) if what == "memfd"
              else await self.d.dataplane.client_call(uid, os.fstat, fd))
        if not stat.S_ISREG(st.st_mode):
            raise RequestError(wire.BAD_REQUEST, f"the {what} passed for {path!r} is not a regular file")
        if st.st_size != size:
            raise RequestError(wire.SIZE_MISMATCH, f"shard {path!r} declared {size} bytes but "
                               f"the {what} passed holds {st.st_size}")

    async def _free_inodes(self) -> int | None:
        """The staging filesystem's free inodes now; None when they cannot be read."""
        try:
            return (await self.d.dataplane.call(self.d.staging.free))[1]
        except Exception:  # a sick disk: the refusal says "full", as it did
            return None

    async def _staging_writable(self) -> bool:
        """Whether the staging directory takes new files now: ``access(W_OK)`` says EROFS on
        a read-only filesystem and EPERM on an immutable directory, to root too (the caller's
        fd, which a hand-off also reads, may refuse with the same errnos)."""
        try:
            return await self.d.dataplane.call(os.access, self.d.staging.dir, os.W_OK)
        except Exception:  # a sick disk: the refusal stays what it was
            return True

    async def _reserve_disk(self, size: int, room: tuple[int, int, int]) -> int:
        """Promise ``size`` bytes of the staging filesystem to this hand-off, evicting kept
        copies first when the disk itself is short; else refuse it (staging_filesystem)."""
        staging = self.d.staging
        room = await self.room_after_eviction(size, room)
        try:
            staging.check_room(size, room)  # (no await between the check and the promise)
        except StagingFull as exc:
            self.d.metrics.backpressure("rejected", "staging_filesystem")
            advice = NO_INODES_ADVICE if exc.out_of_inodes else NO_BYTES_ADVICE
            raise RequestError(wire.BACKPRESSURE, f"{exc.strerror}; {advice}",
                               {"limit": "staging_filesystem", "retry_after_s": 5.0}) from None
        staging.pending_bytes += size
        return size

    async def room_after_eviction(self, size: int,
                                   room: tuple[int, int, int]) -> tuple[int, int, int]:
        """The staging filesystem's room for ``size`` more, after evicting kept copies while
        it is short (copies.make_disk_room): sampled again after each round. Again while it
        is short: a hand-off writing at the same moment counts twice until it is done (its
        written bytes, and its promise), and one round evicted too little for both (found
        attacking). Each round evicts at least one copy or ends the loop, so it ends."""
        staging = self.d.staging
        while short := staging.shortfall(size, room):
            if not await self.d.copies.make_disk_room(short):
                break
            room = await self.d.dataplane.call(staging.room)
        return room

    async def _discard_before_answering(self, name: str) -> None:
        """A refused hand-off's temp file goes before the refusal is answered: the client that
        sees the error sees a staging directory without it. When the hand-off is being
        cancelled (its client left, the daemon stops) or the unlink fails, it is queued to the
        supervisor instead; start-up sweeps whatever temp file a stop left behind."""
        d = self.d
        task = asyncio.current_task()
        if task is None or not task.cancelling():
            try:
                await d.dataplane.call(d.staging.discard, name)
                return
            except asyncio.CancelledError:
                self.give_back(name)
                raise
            except (OSError, StuckIO):
                pass  # the supervisor's try logs what is wrong, once
        self.give_back(name)

    def abandoned_tmp(self, fd: int, name: str) -> None:
        """A temp file whose open the data plane gave up on, opened after all: closed, and
        unlinked (they leaked until a restart's sweep; found reading the give-up path)."""
        close_fds(fd)
        self.give_back(name)

    def give_back(self, unlink: str | None, *held: Reservation | None) -> None:
        """A hand-off that did not become a shard: its temp file goes (in the data plane)
        and what it still holds is released."""
        d = self.d
        if unlink is not None:
            d.supervisor.spawn(lambda: d.dataplane.call(d.staging.discard, unlink),
                               what=f"unlink {unlink}")
        for reservation in held:
            if reservation is not None:
                reservation.release()

    async def _admit(self, gen: GenerationRecord, owner: int, size: int
                     ) -> tuple[Reservation, Reservation]:
        """A queue slot and staging room for one shard, with the owner's share of both."""
        d = self.d
        # The uid's byte share is waited for and taken before the queue slot: waited for
        # holding a slot, one user's hand-off over its share kept another user's out of a
        # small max_queued_shards (found attacking). It goes with the room once reserved.
        deadline = d.admission.deadline()  # one for all three waits
        share = await d.admission.hold_share(owner, size, d.admission.staged, deadline)
        slot: Reservation | None = None
        try:
            slot = await d.admission.admit(d.admission.shards, 1, gen.job, gen.step, owner,
                                           deadline)
            room = await d.admission.admit(d.admission.staged, size, gen.job, gen.step,
                                           deadline=deadline)
        except BaseException:
            share()
            if slot is not None:
                slot.release()
            raise
        room.then = share
        return slot, room

    # -- ack=local: into staging, fsynced, journalled, then acknowledged -------------------------
    async def stage(self, h: ClientHandler, gen: GenerationRecord, rank: int, path: str, size: int,
                    src_fd: int | None, deferred: bool,
                    inline: bytes | memoryview | None = None) -> dict[str, Any]:
        """Owns ``src_fd`` (closes it, or leaves it to a stuck thread's clean-up). The bytes
        come through ``src_fd``, or are ``inline`` (a put_bytes frame's payload, all of it
        already read), or else the client is told to send its data frame now."""
        d = self.d
        started = time.perf_counter()
        handed_at = time.time()
        slot: Reservation | None = None
        room: Reservation | None = None
        promised = 0
        # Charged to the job's owner, as a restart's recovery charges it (root saving a
        # user's job saves it for them; found attacking the per-uid limit).
        owner = d.ledger.jobs.get(gen.job, h.uid)
        name = d.staging.new_name(owner)
        tmp_fd: int | None = None
        created = False
        receiving = False
        # From the first byte to the acknowledgement, the drain holds new ranges back.
        yielding = contextlib.ExitStack()
        try:
            self.check_new_shard(gen, path, size, rank)
            if src_fd is not None:
                await self.check_source(h.uid, src_fd, path, size, "descriptor")
            gen.reserve_path(path)
            receiving = True
            admitted = await h.channel.unless_hung_up(self._admit(gen, owner, size),
                                                      "its hand-off waited for room")
            slot, room = admitted[0], admitted[1]
            yielding.enter_context(d.admission.incoming(owner, deferred))
            yielding.enter_context(d.scheduler.yielding.handoff(h.channel))
            # The fsyncs that make the bytes and the rename durable come with the journal
            # commit of concurrent hand-offs (GroupCommit, in add_shard below): the staged
            # files of a batch one after the other, their directory once.
            if inline is not None:
                # A put_bytes frame's bytes, all here: one data-plane call samples the room
                # and writes the staged file whole (at most wire.INLINE_MAX_BYTES before the
                # sample is checked, well within the filesystem's reserve); a refusal
                # unlinks it.
                created = True
                disk = await d.dataplane.call(
                    functools.partial(d.staging.write_sampling, name, inline))
                promised = await self._reserve_disk(size, disk)
            else:
                # One data-plane call samples the room and creates the temp file: the sample
                # is checked on the loop (pending_bytes), and a refusal unlinks the empty file.
                opened, disk = await d.dataplane.call(
                    d.staging.open_tmp_sampling, name,
                    abandoned=lambda late: self.abandoned_tmp(late[0], name))
                tmp_fd, created = opened, True
                promised = await self._reserve_disk(size, disk)
                # All of a data frame that came with what was buffered, not written yet.
                tail: bytes | memoryview | None = None
                if src_fd is None:
                    # "pipe": the client may pass a pipe instead of a data frame (pumps.py);
                    # not offered to a uid one of whose pipes wedged a pump (it holds the
                    # pipe's lock), so one uid wedges at most one pump per connection.
                    pipe = (d.config.limits.pipe_handoff
                            and h.uid not in d.dataplane.stuck_owners)
                    await h.send("ok", {"ready": True, "pipe": pipe})
                    tail = await payloads.receive_data(d, h, tmp_fd, size, path, pipe)
                else:
                    src, dst = src_fd, tmp_fd
                    src_fd = tmp_fd = None  # the copy's thread owns them until it returns
                    stop = threading.Event()

                    def give_up() -> None:
                        d.dataplane.close_client_fd(src, h.uid)
                        close_fds(dst)

                    # Reads the client's file: in its own lane (DataPlane.client_call).
                    await d.dataplane.client_call(h.uid, kernel_copy, src, dst, size, stop,
                                                  cleanup=give_up, cancel=stop)
                    src_fd, tmp_fd = None, dst
                    d.dataplane.close_client_fd(src, h.uid)
                fd, tmp_fd = tmp_fd, None
                await d.dataplane.call(functools.partial(d.staging.finish_later, fd, name, tail),
                                       cleanup=lambda: close_fds(fd))
                close_fds(fd)
            # The generation may have ended while this hand-off waited for room or bytes
            # (another rank aborted, a newer one superseded it): then nothing is kept.
            still_open(gen, rank)
            # A deferred shard is listed in the part record before it drains, so its
            # checksum is needed now (deferred shards are small: DCP's .metadata).
            checksum = await d.dataplane.call(d.staging.checksum, name) if deferred else ""
            if deferred:
                still_open(gen, rank)  # ... and while its checksum was computed
            shard = ShardRecord(
                id=d.ledger.shard_ids(), job=gen.job, step=gen.step, rank=rank, path=path,
                size=size, staged_name=name, state=ShardState.STAGED, handed_at=handed_at,
                staged_at=time.time(), deferred=deferred, checksum=checksum,
            )
            await d.ledger.add_shard(gen, shard,
                                     before=(functools.partial(d.staging.fsync_data, name),))
            d.copies.adopt(shard, room, slot)
            room = slot = None  # owned by the shard now
            created = False
            if not deferred:
                d.scheduler.enqueue(gen, shard)
        except ConnectionError:
            raise  # the client left or misbehaved on the socket: its connection ends, no reply
        except SourceEnded as exc:
            # The caller's file, not the daemon, was at fault (it was an internal error).
            raise RequestError(
                wire.SIZE_MISMATCH, f"could not stage {path!r}: {exc.strerror}: the file was "
                "truncated while it was handed off, or its size is not what stat says (a /proc "
                "or /sys file); hand off a file that is not written meanwhile") from None
        except SourceUnreadable as exc:
            # The caller's file again (it was an internal error: found attacking).
            raise RequestError(
                wire.BAD_REQUEST, f"could not stage {path!r}: {exc.strerror}; pass a regular "
                "file that read() can read (a secret-memory file cannot be)") from None
        except OSError as exc:
            if exc.errno in DISK_FULL:
                d.metrics.backpressure("rejected", "staging_filesystem")
                raise _disk_full(path, await self._free_inodes()) from None
            if exc.errno in RUN_OUT:
                # The daemon's or the node's own shortage, which passes: it was "internal".
                d.metrics.backpressure("rejected", "file_descriptors")
                raise descriptors_short(f"could not stage {path!r}: {exc.strerror}") from None
            if exc.errno in _REFUSED and not await self._staging_writable():
                raise _staging_refused(path, d.staging.dir, exc) from None
            raise RequestError(wire.INTERNAL, f"could not stage {path!r}: {exc}") from None
        except StuckIO as exc:
            raise RequestError(wire.INTERNAL, f"could not stage {path!r}: {exc}; the disk or "
                               "mount behind it is not answering") from None
        finally:
            yielding.close()
            if receiving:
                gen.release_path(path)
            d.staging.pending_bytes -= promised
            if src_fd is not None:
                d.dataplane.close_client_fd(src_fd, h.uid)
            close_fds(tmp_fd)
            self.give_back(None, room, slot)
            if created:
                await self._discard_before_answering(name)
        d.metrics.handoff(gen.job, time.perf_counter() - started, size, gen.ack)
        return {"path": path, "size": size, "ack": gen.ack}
