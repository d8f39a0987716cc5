"""What a refused hand-off or ``open`` is told: which limit refused it, how long to wait, what
holds the room, and what frees it.

Apart from admission.py, whose :class:`~ckptdrain.daemon.admission.Admission` builds on
:class:`Refusals`, because these are the operator's and user's words about a full node (the
oldest undrained shard, the drain rate, the steps holding a job's slots, the copies failed
generations keep for ``retry``), not the accounting that decided to refuse.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptdrain.client import wire
from ckptdrain.daemon.budget import BudgetFull, TooLarge
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.sizes import human_amount
from ckptdrain.daemon.state import GenerationState

if TYPE_CHECKING:
    from ckptdrain.daemon.budget import Reservation
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.ledger import GenerationRecord, Ledger
    from ckptdrain.daemon.metrics import Metrics

__all__ = ["MAX_RETRY_AFTER_S", "Refusals"]

# The longest a refusal tells a client to wait before it asks again: the room a drain frees
# is seen anew at each ask, so a long wait gains nothing over asking again.
MAX_RETRY_AFTER_S = 60.0


class Refusals:
    """The refusals :class:`~ckptdrain.daemon.admission.Admission` raises, built from its
    state (set by its ``__init__``)."""

    config: Config
    metrics: Metrics
    ledger: Ledger
    _drain_rate: Callable[[], float]
    _held: dict[GenerationRecord, Reservation]
    held_for_retry: Callable[[int], tuple[int, int, list[GenerationRecord]]] | None

    def _retry_advice(self, uid: int | None, slots: bool) -> tuple[int, str]:
        """What ``uid``'s failed generations keep for ``retry`` (queue slots, or bytes), and
        what frees it ("" when they keep none). They never drain by themselves: "wait for its
        shards to drain" alone left a user waiting for good on copies only an abort or a retry
        frees (found attacking)."""
        if uid is None or self.held_for_retry is None:
            return 0, ""
        retry_bytes, retry_slots, failed = self.held_for_retry(uid)
        kept = retry_slots if slots else retry_bytes
        if not kept:
            return 0, ""
        steps = ", ".join(f"step {g.step} of job {g.job!r}" for g in failed[:4])
        more = f" and {len(failed) - 4} more" if len(failed) > 4 else ""
        return kept, (f"{kept} of them are copies its failed generations keep for `retry` "
                      f"({steps}{more}), which never drain by themselves: free them with "
                      "`ckptdrain retry JOB STEP` once the destination takes them, or "
                      "`ckptdrain abort JOB STEP` to give them up; else they go after "
                      f"retention.forget_after_s ({self.config.retention.forget_after_s:g} s "
                      "from the step's start) or past retention.keep_failed per job")

    def lending_refused(self, uid: int, amount: int, held: int) -> RequestError:
        """The refusal of an ``open`` that would take what ``uid``'s readers hold open past its
        share (LocalCopies.may_lend)."""
        cap = self.config.limits.max_reserved_bytes_per_uid
        self.metrics.backpressure("rejected", "max_reserved_bytes_per_uid")
        return RequestError(
            wire.BACKPRESSURE, f"backpressure: uid {uid}'s readers already hold {held} bytes of "
            f"this node's local copies open (lent by `open`, or dropped while still held) and "
            f"ask for {amount} more, over limits.max_reserved_bytes_per_uid ({cap}): a copy "
            "held open stays on the node's disk whatever evicts it; close the copies already "
            "read, or read this shard from the destination (fetch_from_destination)",
            {"limit": "max_reserved_bytes_per_uid", "limit_value": cap, "current": held,
             "requested": amount, "retry_after_s": 1.0})

    def backpressure_error(self, exc: BudgetFull | TooLarge, job: str) -> RequestError:
        oldest_path, oldest_age = "", 0.0
        now = time.monotonic()
        # Told to the owner of ``job``: only its owner's shards are named, never another
        # user's jobs.
        owners = self.ledger.jobs
        owner = owners.get(job)
        for g in self.ledger.generations.values():
            if owners.get(g.job) != owner:
                continue
            for s in g.undrained():
                if now - s.staged_mono > oldest_age:
                    oldest_age, oldest_path = now - s.staged_mono, f"{g.job}/{g.step}/{s.path}"
        rate = self._drain_rate()
        retry_after = 1.0
        if isinstance(exc, BudgetFull) and rate > 0 and exc.name == "max_staged_bytes":
            # Bounded: at a crawl the quotient was years (found attacking: 770464737 s), and a
            # client that sleeps what it is told, as the docs' retry loop does, slept for good.
            retry_after = min(MAX_RETRY_AFTER_S, max(1.0, exc.requested / rate))
        details = {
            "limit": exc.name,
            "limit_value": exc.limit,
            "current": getattr(exc, "used", None),
            "requested": exc.requested,
            "oldest_undrained": oldest_path,
            "oldest_undrained_age_s": round(oldest_age, 3),
            "drain_rate_bytes_per_s": round(rate, 1),
            "retry_after_s": round(retry_after, 1),
        }
        if isinstance(exc, TooLarge):
            return RequestError(wire.BAD_REQUEST, f"{exc}; raise limits.{exc.name} or split the shard",
                                details)
        action = "timed_out" if exc.timed_out else "rejected"
        self.metrics.backpressure(action, exc.name)
        if exc.name == "max_generations_in_flight":
            message = self._slots_full(exc, job)
        else:
            message = (
                f"backpressure: {exc}; oldest undrained shard {oldest_path or '-'} is "
                # In units that show a crawl (found attacking: 16 KiB/s read "0.0 MB/s").
                f"{oldest_age:.1f} s old, draining at {human_amount(rate)}/s; retry in about "
                f"{retry_after:.0f} s or checkpoint less often"
            )
            # After a destination outage the node fills with copies failed generations keep
            # for `retry`, which no wait frees; the refusal blamed the drain rate alone (found
            # attacking a full destination). Told to their owner only.
            kept, advice = (self._retry_advice(owner, exc.name == "max_queued_shards")
                            if exc.name in ("max_staged_bytes", "max_queued_shards")
                            else (0, ""))
            if kept:
                details["held_for_retry"] = kept
                message += f"; uid {owner} holds part of it: {advice}"
        return RequestError(wire.BACKPRESSURE, message, details)

    def _slots_full(self, exc: BudgetFull, job: str) -> str:
        """Which of ``job``'s generations hold its slots, and what ends them. Steps drained
        here that wait for other nodes' ranks hold theirs until those commit, or for
        drain.commit_wait_s (an hour by default): after a node was lost, "draining at 0.0
        MB/s; retry in about 1 s" was all the restarted job heard, for the whole hour (found
        attacking). ``retry_after_s`` stays the usual short hint."""
        held = sorted((g for g in self._held if g.job == job), key=lambda g: g.step)
        text = f"backpressure: {exc}; in flight: " + (", ".join(
            f"step {g.step} ({g.state})" for g in held[:8]) or "-")
        # Recorded here with ranks elsewhere: usually a moment's wait for a slower node (the
        # retry hint stays short: found attacking, an hour's hint stalled a healthy job that
        # slept on it), for as long as drain.commit_wait_s when that node is gone.
        waiting = [g for g in held
                   if g.state is GenerationState.RECORDED and len(g.ranks) < g.world_size]
        if not waiting:
            return text + "; retry when one of them commits, or checkpoint less often"
        now = time.monotonic()
        wait_s = self.config.drain.commit_wait_s
        left = max(0.0, min(wait_s - (now - (g.drained_mono or g.created_mono))
                            for g in waiting))
        steps = ", ".join(str(g.step) for g in waiting[:8])
        return (f"{text}; step(s) {steps} drained here and wait for other nodes' ranks: each "
                f"ends when it commits, or, if a node was lost, after drain.commit_wait_s "
                f"({left:.0f} s more at most), or when an operator gives it up with `ckptdrain "
                f"abort {job} STEP`")
