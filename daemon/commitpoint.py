"""The commit point: the manifest's create once the part records cover every rank, and what
may stop it first (the job's owner at the destination, newer steps that retention would keep
over it) or make of it (committed, a conflict, shards of this node missing at the
destination).

The base of :class:`~ckptdrain.daemon.publisher.Publisher`, which writes the part records and
decides when a generation is covered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from ckptdrain.client.manifest import ManifestError, RecordTooLarge
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.commit import CommitOutcome, CommitResult, Committer
from ckptdrain.daemon.latest import overtaken
from ckptdrain.daemon.logs import OncePerCause
from ckptdrain.daemon.state import GenerationEvent, GenerationState, ShardEvent, ShardState

if TYPE_CHECKING:
    from ckptdrain.daemon.commitwaits import CommitWaits
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.endings import Endings
    from ckptdrain.daemon.ledger import GenerationRecord, Ledger, ShardRecord

# The publisher's: rollback_check_failed lines keep the name they were logged under.
log = logging.getLogger("ckptdrain.publisher")

_G = GenerationState
_T = TypeVar("_T")

# A poll's read of a generation's part records is bounded: a destination whose listing never
# ends (new keys on every page) held the poller, past drain.commit_wait_s, and every other
# generation it waits on with it (found attacking). As long as the commit's wait, between
# these (a read of 1,000 nodes' records takes seconds).
PART_READ_MIN_S = 2.0
PART_READ_MAX_S = 60.0


class CommitPoint:
    """The manifest's create (the publisher's base; :class:`~ckptdrain.daemon.publisher.Publisher`
    sets these)."""

    config: Config
    ledger: Ledger
    committer: Committer
    waits: CommitWaits
    ends: Endings
    error_log: OncePerCause
    _on_published: Callable[[GenerationRecord], None]
    _on_vanished: Callable[[ShardRecord], None]

    if TYPE_CHECKING:  # the publisher's, which the commit point calls
        async def end(self, gen: GenerationRecord, reason: str, *, kind: str,
                      event: GenerationEvent = GenerationEvent.FAILED, told: str = "",
                      record_first: bool = True) -> None: ...

        async def ended_if_foreign(self, gen: GenerationRecord, *,
                                   again: bool = False) -> bool: ...

        async def _with_retries(self, op: Callable[[], Awaitable[_T]],
                                gen: GenerationRecord | None = None) -> _T: ...

    async def _try_publish(self, gen: GenerationRecord) -> None:
        try:
            if await self.ended_if_foreign(gen, again=True):
                return
        except BackendError as exc:
            await self.end(gen, f"commit failed: {exc}", kind="drain")
            return
        if await self._retention_would_take(gen):
            return
        failure = await self._publish(gen)
        if failure is not None:
            # After the commit point: the end writes the failure record first, and an abort
            # waits for none of its retries (end).
            await self.end(gen, failure[0], kind=failure[1])

    async def _retention_would_take(self, gen: GenerationRecord) -> bool:
        """End ``gen`` rather than publish it when ``retention.keep_last`` newer steps of its
        job committed since it began (latest.overtaken; found attacking: newer steps committed
        while it was saved, and the begin's check had passed). A destination that cannot say
        in time lets the commit go ahead, as before."""
        keep = self.config.retention.keep_last
        if gen.state is not _G.RECORDED:
            return False  # (the one state a newer commit may end)
        try:
            async with asyncio.timeout(PART_READ_MIN_S * 5):
                above = await overtaken(self.committer.backend, gen.job, gen.step, keep=keep)
        except (BackendError, ManifestError, OSError, TimeoutError) as exc:
            self.error_log.log_event(log, logging.WARNING, "rollback_check_failed",
                                     cause=f"retention:{gen.job}", job=gen.job, step=gen.step,
                                     error=str(exc) or type(exc).__name__)
            return False
        if not above:
            return False
        if await self.ends.committed_elsewhere(gen):
            # Another node's create committed it with this node's part, and newer steps since
            # (found attacking: a node restarted after that cancelled the committed step).
            return True
        await self.end(gen, f"steps {', '.join(map(str, above))} of this job committed while "
                            f"it was saved: retention.keep_last = {keep} would remove it as soon "
                            "as it committed, and a restart resumes from the newest step anyway",
                       kind="overtaken", event=GenerationEvent.SUPERSEDED_BY_COMMIT)
        return True

    async def _publish(self, gen: GenerationRecord) -> tuple[str, str] | None:
        """The create, retried on transient destination errors; what fails the generation, as
        (reason, kind), is returned for the caller to end it by (after the commit point)."""
        try:
            return await self._with_retries(lambda: self._publish_once(gen), gen)
        except BackendError as exc:
            return f"commit failed: {exc}", "drain"
        except RecordTooLarge as exc:
            return str(exc), "aborted"

    async def _publish_once(self, gen: GenerationRecord) -> tuple[str, str] | None:
        """One try of the create at the commit point, from the manifest's create to the
        COMMITTED it leads to: an abort (Generations.give_up) waits for it, or it for the
        abort. One try, not its retries: held across them (drain.retry_budget_s, 300 s by
        default, backing off in between), it held `ckptdrain abort` past its client's 30 s
        on a destination refusing the create, and the step then committed (found attacking
        the record-first abort). An abort between two tries ends the generation: the next
        try finds it ended, and the abort's own look finds a manifest an earlier try may
        have created after all."""
        async with gen.commit_point:
            if gen.terminal:
                return None
            result = await self.committer.try_publish(gen.job, gen.step, gen.world_size,
                                                      gen.attempt)
            return await self._published(gen, result)

    async def _published(self, gen: GenerationRecord,
                         result: CommitResult) -> tuple[str, str] | None:
        """What the create's ``result`` makes of ``gen`` (at the commit point)."""
        if result.committed:
            self.committer.owners.remember(gen.job, self.ledger.jobs.get(gen.job))
        if result.outcome is CommitOutcome.PUBLISHED:
            # This node's create made the manifest: retention runs here, also when the
            # generation ended here meanwhile (cancelled, expired).
            self._on_published(gen)
        if gen.terminal:
            return None
        if result.committed:
            await self.ends.committed(gen, result.manifest, result.outcome.name.lower())
        elif result.outcome is CommitOutcome.CONFLICT:
            return f"it cannot commit: {result.reason}", "conflict"
        elif result.absent:
            return await self._absent(gen, result)
        return None

    async def _absent(self, gen: GenerationRecord,
                      result: CommitResult) -> tuple[str, str] | None:
        """Shards the part records list are missing at the destination: deleted behind the
        daemon's back after they drained (an operator freeing room, a cleanup script). This
        node's own end the generation now (returned, as _publish's failures are), each failed
        so that `ckptdrain retry` drains its kept copy again; waiting could only end at
        drain.commit_wait_s, saying the manifest never appeared (found attacking: an hour's
        silent wait, and a retry that re-sent only the shards that had failed before).
        Other nodes' are theirs to see: the reason is kept for this generation's expiry."""
        node = self.config.node_id
        mine = [gen.shards[s.path] for s in result.absent
                if s.node == node and s.path in gen.shards]
        if not mine:
            self.waits.why_waiting[gen.key] = result.reason
            return None
        for shard in mine:
            if shard.state is ShardState.DRAINED:
                await self.ledger.apply(shard, ShardEvent.VANISHED,
                                        error="missing at the destination after it drained")
                self._on_vanished(shard)
        names = ", ".join(repr(s.path) for s in mine[:5]) + (" ..." if len(mine) > 5 else "")
        lost = [s for s in mine if not s.local_copy]
        then = ("their local copies are gone too: save a new step" if lost else
                f"`ckptdrain retry {gen.job} {gen.step}` drains them again from this node's "
                "local copies")
        return (f"{len(mine)} shard(s) drained from this node ({names}) are missing at the "
                f"destination: something deleted them before the commit; {then}", "drain")
