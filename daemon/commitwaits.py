"""Generations waiting on other nodes: a RECORDED generation is polled until it ends.

Every ``drain.commit_poll_interval_s`` (or at once, :meth:`CommitWaits.poke`) each generation
waiting here is looked at, a bounded number at a time: COMMITTED when the manifest appeared,
FAILED when another node's record marks a rank aborted or ``drain.commit_wait_s`` passed since
this node's drained clock (which is journalled), CANCELLED when a newer step of the job
committed (the LATEST hint, confirmed by its manifest). What the looks learned (ranks with no
record yet, why it could not commit) is kept for the expiry's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING

from ckptdrain.client.manifest import ManifestError, latest_key
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.latest import parse_latest
from ckptdrain.daemon.ledger import GenerationRecord, GenKey
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.state import GenerationEvent, GenerationState

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.publisher import Publisher

log = logging.getLogger("ckptdrain.publisher")

_G = GenerationState

# Generations polled at once (each reads its part records at the destination).
POLLS_AT_ONCE = 16


class CommitWaits:
    """The publisher's generations waiting on other nodes (``publisher``: how each settles)."""

    def __init__(self, publisher: Publisher) -> None:
        self.p = publisher
        self.ledger = publisher.ledger
        self.committer = publisher.committer
        self.metrics = publisher.metrics
        self._poll_now = asyncio.Event()
        # Ranks with no part record of this attempt at the last look, said for the
        # commit_wait_s message (describe_missing: records of other attempts included).
        self.missing: dict[GenKey, str] = {}
        # Why a generation could not commit at its last poll: its part records unreadable, or
        # shards of other nodes missing at the destination (its expiry names that, not a
        # manifest that never appeared).
        self.why_waiting: dict[GenKey, str] = {}

    @property
    def config(self) -> Config:
        return self.p.config  # a reload replaces the publisher's

    def poke(self) -> None:
        """Poll the generations waiting on other nodes now, not at the next interval."""
        self._poll_now.set()

    async def run(self) -> None:
        """Generations whose part record is written wait for the other nodes' records."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.drain.commit_poll_interval_s):
                    await self._poll_now.wait()
            self._poll_now.clear()
            waiting = [g for g in self.ledger.generations.values() if g.state is _G.RECORDED]
            if not waiting:
                continue
            newest = await self._newest_commits(waiting)
            # Several at once: one after another, a slow destination read of each (up to
            # PART_READ_MAX_S) pushed every later generation's expiry back by as much (found
            # attacking: four waiting generations ended 6, 12, 18 and 24 s late).
            await for_each_bounded(waiting, functools.partial(self._poll_locked, newest),
                                   POLLS_AT_ONCE)

    def forget(self, key: GenKey) -> None:
        """What the polls learned about a generation that has ended or committed."""
        self.missing.pop(key, None)
        self.why_waiting.pop(key, None)

    async def _poll_locked(self, newest: dict[str, int], gen: GenerationRecord) -> None:
        # Locked: an advance is at work on it right now, and will settle it itself.
        if gen.state is _G.RECORDED and not gen.lock.locked():
            async with gen.lock:
                await self.p.ends.guarded(gen, "waiting for the commit",
                                          self._poll(gen, newest.get(gen.job)))

    async def _poll(self, gen: GenerationRecord, newest: int | None) -> None:
        if gen.state is not _G.RECORDED:
            return
        if newest is not None and newest > gen.step:
            # Still RECORDED after it when the destination could not say whether this step
            # committed: drain.commit_wait_s below ends it all the same (found attacking: a
            # manifest key that never read held the generation, and its slot, for good).
            await self.p.ends.superseded(gen, newest)
        else:
            await self.p.settle(gen)
        wait_s = self.config.drain.commit_wait_s
        since = gen.created_mono if gen.drained_mono is None else gen.drained_mono
        if gen.state is _G.RECORDED and time.monotonic() - since >= wait_s:
            why = (self.missing.get(gen.key)
                   or self.why_waiting.get(gen.key, "the manifest never appeared"))
            await self._expire(gen, wait_s, why)

    async def _expire(self, gen: GenerationRecord, wait_s: float, why: str) -> None:
        """End ``gen`` at drain.commit_wait_s, on every node: its ranks are told the step
        failed, so no other node may commit it afterwards (end writes this node's failure
        record first, and ends it committed where the manifest turns out to be there)."""
        await self.p.end(
            gen, f"not committed within drain.commit_wait_s = {wait_s:g} s of this node "
                 f"recording its part: {why}", kind="timeout", event=GenerationEvent.EXPIRED,
            told=f"the step expired on node {self.config.node_id!r} after drain.commit_wait_s "
                 f"= {wait_s:g} s without a commit ({why}); its ranks were told it failed")

    async def _newest_commits(self, waiting: list[GenerationRecord]) -> dict[str, int]:
        """Per job, a committed step newer than one of ``waiting``, from the LATEST hint and
        confirmed by its manifest. A lagging or unreadable hint only means waiting longer."""
        oldest: dict[str, int] = {}
        for gen in waiting:
            oldest[gen.job] = min(oldest.get(gen.job, gen.step), gen.step)
        found: dict[str, int] = {}
        for job, step in oldest.items():
            try:
                hint = parse_latest(await self.committer.backend.get_bytes(
                    latest_key(job), max_bytes=64))
                if (hint is not None and hint > step
                        and await self.committer.committed(job, hint) is not None):
                    found[job] = hint
            except (BackendError, ManifestError) as exc:
                self.p.error_log.log_event(log, logging.WARNING, "commit_poll_error",
                                           cause=f"latest:{job}", job=job, error=str(exc))
            except Exception:  # one job's hint must not stop the polling of every job
                log_event(log, logging.ERROR, "commit_poll_crashed", job=job, exc_info=True)
                self.metrics.internal_error("commit")
        return found
