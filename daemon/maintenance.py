"""Taking a node out of service and back (``ckptdrain drain / resume / abort``), and a
failed generation drained again (``ckptdrain retry``).

While draining, a new generation (or a new attempt at one) is refused with the typed
``draining`` error; ranks joining a generation that already began here are still served, so
it can commit, and everything staged keeps draining. The report says what is left, so the
operator knows when stopping the daemon loses nothing. Draining lives in memory: a restarted
daemon takes new generations again (``drain`` again after an upgrade if that is not wanted).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from ckptdrain.client import wire
from ckptdrain.client.manifest import ManifestError
from ckptdrain.daemon import permissions
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.beginchecks import COMMITTED_CHECK_TIMEOUT_S
from ckptdrain.daemon.budget import BudgetFull, TooLarge
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.latest import overtaken
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.state import (
    GenerationEvent,
    GenerationState,
    RankState,
    ShardEvent,
    ShardState,
)

if TYPE_CHECKING:
    from ckptdrain.daemon.access import Peer
    from ckptdrain.daemon.connection import ClientHandler
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger("ckptdrain.maintenance")

_UNDRAINED = (ShardState.HELD, ShardState.STAGED, ShardState.DRAINING)
_UNRECORDED = (RankState.OPEN, RankState.SEALED)


def check_operator(peer: Peer) -> None:
    """Draining the node is for operators (root, the daemon's own user), not a training job."""
    if not peer.operator:
        # "as root or as uid 0" when the daemon runs as root (found as a new operator).
        also = f" or as uid {os.getuid()} (the daemon's user)" if os.getuid() != 0 else ""
        raise RequestError(wire.PERMISSION_DENIED, f"uid {peer.uid} may not drain or resume "
                           f"this node; run the command as root{also}")


def refuse_new_generation(d: Daemon, job: str, step: int) -> None:
    if d.draining:
        raise RequestError(wire.DRAINING, f"node {d.node_id} is being drained for maintenance "
                           f"and takes no new generation (job {job!r} step {step}); save "
                           "through another node, or retry after `ckptdrain resume`",
                           {"retry_after_s": 30.0})


def report(d: Daemon) -> dict[str, Any]:
    """What this node still has to do before it can stop without losing anything."""
    shards = undrained = receiving = failed = failed_bytes = open_generations = 0
    for gen in d.ledger.generations.values():
        receiving += len(gen.receiving)
        # From the generation's tallies (records.py), not a walk of its shards.
        if gen.never_drains:
            continue  # given up for good: nothing of it is kept, nothing left to drain
        if gen.terminal:
            # A failed generation's copies kept for `retry`: its failed shards and those it
            # never drained (staged ones were left out, and `drain` said "nothing left" over
            # a failed checkpoint's only copies: found attacking). A committed one has none.
            for state in (ShardState.FAILED, *_UNDRAINED):
                failed += gen.by_state[state]
                failed_bytes += gen.bytes_by_state[state]
            continue
        if any(st in _UNRECORDED for st in gen.ranks.values()):
            open_generations += 1
        for state in _UNDRAINED:
            shards += gen.by_state[state]
            undrained += gen.bytes_by_state[state]
    left = {"generations_unrecorded": open_generations, "shards_undrained": shards,
            "bytes_undrained": undrained, "shards_receiving": receiving,
            "shards_failed": failed, "bytes_failed": failed_bytes}
    done = shards == 0 and receiving == 0 and open_generations == 0
    return {"draining": d.draining, "done": done, "left": left}


def drain(d: Daemon, peer: Peer) -> dict[str, Any]:
    check_operator(peer)
    uid = peer.uid
    if not d.draining:
        d.draining = True
        log_event(log, logging.WARNING, "draining", uid=uid,
                  action="new generations are refused until `ckptdrain resume`")
    return report(d)


def resume(d: Daemon, peer: Peer) -> dict[str, Any]:
    check_operator(peer)
    uid = peer.uid
    if d.draining:
        d.draining = False
        log_event(log, logging.INFO, "resumed", uid=uid)
    return report(d)


async def abort_generation(d: Daemon, uid: int, job: str, step: int, reason: str) -> dict[str, Any]:
    gen = d.ledger.get(job, step)
    if gen is None:
        raise RequestError(wire.NOT_FOUND, f"this node holds no step {step} of job {job!r}; "
                           "`ckptdrain status` lists what it holds")
    # A failed generation that `retry` could still bring back holds its undrained copies for
    # it: giving it up lets them go (they stayed until it was forgotten, a day later).
    if gen.terminal and (gen.state is not GenerationState.FAILED or gen.why_not_retryable()):
        raise RequestError(wire.BAD_REQUEST, f"step {step} of job {job!r} is already "
                           f"{gen.state}; nothing to abort")
    if not gen.terminal and RankState.RECORDED in gen.ranks.values():
        # This node's part is at the destination, where another node may have published the
        # step from it before this node's next look (found attacking: the abort said "it
        # will never commit", and rewrote the part record of a committed generation).
        # Committed with this node's part, that is: another attempt's manifest of the step is
        # not this one's, and one that retention has removed since still is (found attacking:
        # after the removal the abort said "it will never commit" of a committed step).
        try:
            async with asyncio.timeout(COMMITTED_CHECK_TIMEOUT_S):
                committed = await d.scheduler.publisher.committed_here(gen)
        except (BackendError, ManifestError, OSError, TimeoutError):
            committed = False  # cannot tell in time: the abort goes ahead, as before
        if committed:
            d.scheduler.poke_commits()  # so that this node sees it now, not at its next poll
            raise RequestError(wire.BAD_REQUEST, f"step {step} of job {job!r} is committed at "
                               "the destination (another node published it); nothing to "
                               "abort")
    why = f"aborted by an operator (uid {uid})" + (f": {reason}" if reason else "")
    if not await d.generations.give_up(gen, why):
        raise RequestError(wire.BAD_REQUEST, f"step {step} of job {job!r} committed while "
                           "the abort waited for its commit to finish; nothing to abort")
    log_event(log, logging.WARNING, "generation_aborted", job=job, step=step, uid=uid,
              reason=reason)
    return {"job": job, "step": step, "state": str(gen.state)}


async def retry(h: ClientHandler, job: str, step: int) -> dict[str, Any]:
    """``ckptdrain retry JOB STEP``: a failed generation whose local copies are kept drains
    again, with a fresh ``commit_wait_s``."""
    permissions.check_job_owner(h, job, "retry it")
    d = h.d
    gen = d.ledger.get(job, step)
    if gen is None:
        raise RequestError(wire.NOT_FOUND, f"this node holds no step {step} of job {job!r}; "
                           "`ckptdrain status` lists what it holds (retry runs on the node "
                           "whose generation failed)")
    if gen.state is not GenerationState.FAILED:
        raise RequestError(wire.BAD_REQUEST, f"step {step} of job {job!r} is {gen.state}, not failed")
    unretryable = gen.why_not_retryable()
    if unretryable:
        raise RequestError(wire.GENERATION_FAILED, f"step {step} of job {job!r} {unretryable}")
    # Refused now rather than drained again and cancelled at its commit (found attacking:
    # it committed, and retention removed it a second later).
    keep = d.config.retention.keep_last
    try:
        async with asyncio.timeout(COMMITTED_CHECK_TIMEOUT_S):
            above = await overtaken(d.backend, job, step, keep=keep)
    except (BackendError, ManifestError, OSError, TimeoutError):
        above = []  # cannot tell in time: the commit checks again (Publisher)
    if above:
        raise RequestError(wire.GENERATION_FAILED, f"step {step} of job {job!r} is older than "
                           f"its {keep} newest committed steps ({', '.join(map(str, above))}): "
                           f"retention.keep_last = {keep} would remove it as soon as it "
                           "committed, and a restart resumes from the newest step anyway; "
                           f"give it up with `ckptdrain abort {job} {step}`")
    try:
        slot = await d.admission.slots(job).reserve(1, block=False, timeout_s=0)
    except (BudgetFull, TooLarge) as exc:
        raise d.admission.backpressure_error(exc, job) from None
    # A fresh drain.commit_wait_s from the retry: counted from the old drained clock, a
    # generation that had waited out its wait for a slow node failed again within one
    # poll of being retried, however soon that node came (found attacking).
    fresh = {} if gen.drained_at is None else {"drained_at": time.time()}
    try:
        await d.ledger.apply(gen, GenerationEvent.RETRIED, error="", **fresh)
    except BaseException:
        slot.release()
        raise
    # Held once it is open again: hold_generation gives an ended generation's slot back
    # at once (an abort may have ended it meanwhile), and held before, it let the retried
    # generation run with no slot at all.
    d.admission.hold_generation(gen, slot)
    requeued = 0
    for shard in gen.shards.values():
        if shard.state is ShardState.FAILED:
            await d.ledger.apply(shard, ShardEvent.RETRIED, error="")
        if shard.state is ShardState.STAGED:
            d.copies.retried(shard)
            d.scheduler.enqueue(gen, shard)
            requeued += 1
    d.spawn_advance(gen)
    return {"job": job, "step": step, "requeued": requeued}
