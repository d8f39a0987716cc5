"""The copies of staged shards to the destination: one shard's put (from its staged file, with
its resumable upload's log), a batch of small shards' in one backend call, each in a cancel
scope that ending its generation expires, paced by the drain; the destination directory of a
generation prepared once while it lives; a staged copy vouched for by the checksum its copy
read; and the resumable uploads given up.

The base of :class:`~ckptdrain.daemon.scheduler.Scheduler`, which decides what drains, when,
and what a copy's outcome does to its shard and generation.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptdrain.client.manifest import generation_prefix, shard_key
from ckptdrain.daemon.backends.base import Backend, BackendError, UploadLog
from ckptdrain.daemon.drainpace import DrainPace, ShardFlow
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.owedaborts import UploadAborts
from ckptdrain.daemon.reads import Identity, identity

if TYPE_CHECKING:
    from ckptdrain.daemon.ledger import GenerationRecord, ShardRecord
    from ckptdrain.daemon.staging import Staging


class Discarded(DaemonError):
    """The copy was cancelled because its generation failed or was cancelled."""


class Transfers(DrainPace):
    """Copies to the destination in flight (the scheduler's base; it sets these)."""

    backend: Backend
    staging: Staging
    _upload_log_for: Callable[[ShardRecord], UploadLog | None] | None
    _inflight: dict[int, asyncio.Timeout]
    _prepared: set[str]
    aborts: UploadAborts

    async def _put_batch(self, gen: GenerationRecord,
                         shards: list[ShardRecord]) -> list[str | BackendError | None] | None:
        """put_files of ``shards``, paced as one; None when their generation ended meanwhile.
        An error that stopped the whole call stands for every shard."""
        fds: list[int] = []
        scope: asyncio.Timeout | None = None
        try:
            await self._prepare(gen)
            for shard in shards:
                fds.append(self.staging.open_data(shard.staged_name))
            befores = [identity(os.fstat(fd)) for fd in fds]
            # One cancel scope for the batch: ending the generation cancels all of it.
            async with asyncio.timeout(None) as scope:
                began = time.monotonic()
                for shard in shards:
                    self._inflight[shard.id] = scope
                    shard.progress_mono = began
                try:
                    await self.pace(sum(s.size for s in shards))
                    outcomes = await self.backend.put_files(
                        [(shard_key(s.job, s.step, s.path), fd, s.size)
                         for s, fd in zip(shards, fds, strict=False)])
                finally:
                    for shard in shards:
                        self._inflight.pop(shard.id, None)
            # As _put does for one shard (found when the suite first ran in two workers:
            # shards drained in a batch were vouched for by nothing, and their first reader
            # hashed them).
            for shard, fd, before, outcome in zip(shards, fds, befores, outcomes, strict=True):
                if isinstance(outcome, str):
                    _vouch(shard, fd, before, outcome)
            return outcomes
        except TimeoutError:
            if scope is not None and scope.expired():
                return None
            raise
        except BackendError as exc:
            return [exc] * len(shards)
        except OSError as exc:  # a staged copy unreadable: its own drain says which
            return [BackendError(str(exc))] * len(shards)
        finally:
            for fd in fds:
                os.close(fd)

    async def _put(self, shard: ShardRecord) -> str:
        fd = self.staging.open_data(shard.staged_name)
        try:
            before = identity(os.fstat(fd))  # (see _vouch)
            checksum = await self._put_fd(shard, fd)
            _vouch(shard, fd, before, checksum)
            return checksum
        finally:
            os.close(fd)

    async def _put_fd(self, shard: ShardRecord, fd: int) -> str:
        scope: asyncio.Timeout | None = None
        try:
            upload_log = self._upload_log_for(shard) if self._upload_log_for else None
            if upload_log is not None:
                # An abort of this shard's upload begun before a retry took the shard ends
                # first: resumed under it, the upload vanished mid-send (NoSuchUpload: a new
                # upload, every part sent again). A dict lookup when there is none.
                await self.aborts.settled(shard)
            # A cancel scope rather than a task of its own: _discard_copies expires it, which
            # cancels this copy alone, and a stopping daemon's cancellation passes through.
            async with asyncio.timeout(None) as scope:
                self._inflight[shard.id] = scope
                try:
                    shard.moved_bytes = 0  # this attempt's progress
                    shard.progress_mono = time.monotonic()
                    return await self.backend.put_file(
                        shard_key(shard.job, shard.step, shard.path), fd, shard.size,
                        upload_log=upload_log, flow=ShardFlow(self, shard),
                    )
                finally:
                    self._inflight.pop(shard.id, None)
        except TimeoutError:
            if scope is not None and scope.expired():
                raise Discarded from None
            raise

    async def _prepare(self, gen: GenerationRecord) -> None:
        """The destination's directory of ``gen`` (prepare_prefix), once per live generation."""
        prefix = generation_prefix(gen.job, gen.step)
        if prefix in self._prepared:
            return
        await self.backend.prepare_prefix(prefix)
        if not gen.terminal:  # one that ended meanwhile is not forgotten again (_terminal)
            self._prepared.add(prefix)

    async def _abort_stale_upload(self, gen: GenerationRecord, shard: ShardRecord) -> None:
        """A multipart upload journalled for ``shard`` before a restart, which the shard's copy
        just now did not complete (it went as one PutObject: multipart_threshold_bytes was
        raised meanwhile), is aborted: it was left to the orphan sweep's grace, an hour by
        default (found attacking the S3 drain). A dict lookup when there is none."""
        if self._upload_log_for is None:
            return
        upload_log = self._upload_log_for(shard)
        if upload_log is not None and upload_log.is_open():
            await self.abort_upload(gen, shard)

    async def abort_upload(self, gen: GenerationRecord, shard: ShardRecord) -> bool:
        """Abort the upload journalled for ``shard`` (its generation ``gen``); one that fails
        is owed and tried again until the destination answers (:mod:`.owedaborts`)."""
        return await self.aborts.abort(gen, shard)


def _vouch(shard: ShardRecord, fd: int, before: Identity, checksum: str) -> None:
    """A staged copy unchanged across the read that gave its checksum is vouched for by it:
    reads.open_local need not hash it. (Local staging: an fstat does not block.)"""
    if identity(os.fstat(fd)) == before:
        shard.vouched = (before, checksum)
