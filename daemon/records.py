"""The records of what this node holds: a generation, its ranks' states and its shards.

Plain data with the bookkeeping that must stay in step with it (shards not yet settled per
rank, the directories shard paths imply); only :class:`~ckptdrain.daemon.ledger.Ledger`
changes their lifecycle state.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

from ckptdrain.client.manifest import entry_bytes
from ckptdrain.client.shardentries import parents
from ckptdrain.daemon.locks import HeldBy
from ckptdrain.daemon.state import (
    INITIAL_GENERATION,
    TERMINAL_GENERATION,
    UNDRAINED_SHARD,
    GenerationState,
    RankState,
    ShardState,
    settled,
)

GenKey = tuple[str, int]

# What one generation's status summary may take: `status` replies are one bounded frame.
SUMMARY_RANKS = 32
SUMMARY_ERROR_CHARS = 300
# What an error text may keep, in memory and in the journal: a reason is the client's text
# or an exception's, and neither may grow what this node holds without bound.
MAX_ERROR_CHARS = 2000
# What a job does about a generation that failed: the same attempt may not take a failed step
# again (its shards would mix with the failed ones), a new attempt may.
SAVE_AGAIN = ("save this step again as a new attempt (a restart under torchrun, srun or mpirun "
              "is one; else pass attempt= or set $CKPTDRAIN_ATTEMPT), or save a new step")


def cap_error(text: str) -> str:
    return shortened(text, MAX_ERROR_CHARS)


def shortened(text: str, limit: int = SUMMARY_ERROR_CHARS) -> str:
    """``text`` in at most ``limit`` characters, cut in the middle: an error's start says what
    failed and its end what to do (and how often it was tried), and a cut at the end took that
    off whenever a long destination path came between (found when the suite first ran in two
    workers, whose temp paths are longer: a retried error lost its "(try N, retrying)")."""
    if len(text) <= limit:
        return text
    head = (limit - 1) * 2 // 3
    return text[:head] + "…" + text[len(text) - (limit - 1 - head):]


def retrying_note(exc: Exception, attempt: int) -> str:
    """What a generation shows in `status` while its drains or commit retry ``exc`` (a
    destination error: its kind, its message, how many tries so far), bounded."""
    return shortened(f"{getattr(exc, 'kind', 'error')}: {exc} (try {attempt}, retrying)")


def monotonic_of(wall_at: float) -> float:
    """``wall_at``, a wall-clock moment that has passed (stamped now, or journalled), on this
    process's monotonic clock. Every age the daemon acts on is measured from this, never by
    reading the wall clock again: the wall clock steps (NTP; a daemon started before its
    node's clock was set), and ages read from it jumped by hours: failed generations were
    forgotten, their copies with them, a minute after failing, commit waits ended at once or
    ran two hours late, and the newest failures were dropped before older ones (found
    attacking). A moment in the future (the clock stepped back since) counts as now."""
    return time.monotonic() - max(0.0, time.time() - wall_at)


# The journalled wall-clock moments a record ages by, and the monotonic twin of each.
_TWINS = {"created_at": "created_mono", "staged_at": "staged_mono", "drained_at": "drained_mono"}


def assign(record: object, name: str, value: Any) -> None:
    """Set a record's field; a moment it ages by takes its monotonic twin along."""
    setattr(record, name, value)
    twin = _TWINS.get(name)
    if twin is not None and hasattr(record, twin):
        setattr(record, twin, None if value is None else monotonic_of(value))


@dataclass(eq=False)
class ShardRecord:
    id: int
    job: str
    step: int
    rank: int
    path: str
    size: int
    staged_name: str
    state: ShardState
    handed_at: float
    staged_at: float
    checksum: str = ""
    drained_at: float | None = None
    error: str = ""
    # Drained only after every rank's shards are at the destination, right before the manifest.
    deferred: bool = False
    local_copy: bool = True  # the staged file still exists
    # Bytes of the drain in progress already at the destination (not journalled: progress).
    moved_bytes: int = 0
    # When the drain in progress last moved bytes, or began (time.monotonic()): how long a
    # copy has made no progress, which tells a hung destination from a slow one.
    progress_mono: float = 0.0
    # staged_at on this process's monotonic clock (monotonic_of): what its age is read from.
    staged_mono: float = field(init=False)
    # Its line in a part record or manifest, its node name left out (manifest.entry_bytes):
    # path, size and rank never change, so worked out once, not at every state change.
    line_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.staged_mono = monotonic_of(self.staged_at)
        self.line_bytes = entry_bytes(self.path, self.size, self.rank, "")
    # (identity of the staged file, checksum) when a read of the file unchanged throughout
    # gave that checksum (reads.identity; not journalled: a restarted daemon hashes again).
    vouched: tuple[tuple[int, int, int, int, int], str] | None = None

    def row(self) -> dict[str, Any]:
        return {
            "id": self.id, "job": self.job, "step": self.step, "rank": self.rank,
            "path": self.path, "size": self.size, "staged_name": self.staged_name,
            "state": str(self.state), "checksum": self.checksum, "handed_at": self.handed_at,
            "staged_at": self.staged_at, "drained_at": self.drained_at, "error": self.error,
            "deferred": self.deferred,
        }

    @property
    def settled(self) -> bool:
        return settled(self.state, self.deferred, bool(self.checksum))


@dataclass(eq=False)
class GenerationRecord:
    job: str
    step: int
    world_size: int
    ack: str
    created_at: float
    attempt: str = ""
    state: GenerationState = INITIAL_GENERATION
    handoff_at: float | None = None
    staged_at: float | None = None
    drained_at: float | None = None
    committed_at: float | None = None
    error: str = ""
    ranks: dict[int, RankState] = field(default_factory=dict)
    shards: dict[str, ShardRecord] = field(default_factory=dict)
    # Paths being received right now: reserved so a concurrent duplicate is refused early.
    receiving: set[str] = field(default_factory=set)
    # Every directory the shard paths (held or being received) imply, counted: 'x' may not be
    # a shard once 'x/y' is one, nor the reverse (the destination cannot hold both).
    dirs: collections.Counter[str] = field(default_factory=collections.Counter)
    # Shards per rank not yet settled (drained, or deferred with a checksum): kept by the
    # ledger so "has this rank drained?" costs O(1), not a scan of every shard per drain.
    unsettled: dict[int, int] = field(default_factory=dict)
    # Shards and their bytes per state, and the shards not yet drained (by id): kept by
    # count() as the ledger adds, moves and drops shards, so `status`, the metrics snapshot
    # and a refusal's details cost O(generations + undrained shards) on the event loop, not a
    # walk of every shard of every generation (a 100,000-shard generation stays cheap to show).
    by_state: collections.Counter[ShardState] = field(default_factory=collections.Counter)
    bytes_by_state: collections.Counter[ShardState] = field(
        default_factory=collections.Counter)
    open_shards: dict[int, ShardRecord] = field(default_factory=dict)
    # What the shards' lines of a part record or manifest weigh, their node names left out
    # (manifest.entry_bytes): a hand-off that would take the records past what a reader
    # takes is refused.
    line_bytes: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Held around the manifest's create only, and by an abort (Generations.give_up): an abort
    # never lands in the middle of the commit point, and waits for nothing longer (`lock` is held
    # across paced drains of deferred shards and part-record retries). It knows its holder:
    # Endings.end takes it, and is also called with it held.
    commit_point: HeldBy = field(default_factory=HeldBy)
    # An abort (Generations.give_up) is under way: the advance writes no part record saying
    # "recorded" over the failure record the abort writes first (Endings.record_abort_first).
    aborting: bool = False
    # The destination named no other owner of the job before the first write (owners.py).
    owner_checked: bool = False
    # The destination error its drains or commit are retrying right now, and how often they
    # met it ("" when none): in `status` during an outage, which showed nothing but 0 B/s
    # until the generation failed (found attacking). Not journalled: it is about now.
    retrying: str = ""
    # created_at and drained_at on this process's monotonic clock (monotonic_of): what the
    # generation's ages (expiry, the commit wait) are read from.
    created_mono: float = field(init=False)
    drained_mono: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.created_mono = monotonic_of(self.created_at)
        self.drained_mono = None if self.drained_at is None else monotonic_of(self.drained_at)

    @property
    def key(self) -> GenKey:
        return (self.job, self.step)

    def path_clash(self, path: str) -> str | None:
        """The shard path that ``path`` cannot live beside (one is a directory of the other),
        or None. O(depth), not a scan of the generation's shards."""
        if path in self.dirs:
            return next((p for p in (*self.shards, *self.receiving) if p.startswith(path + "/")),
                        path + "/...")
        for parent in parents(path):
            if parent in self.shards or parent in self.receiving:
                return parent
        return None

    def reserve_path(self, path: str) -> None:
        """``path`` is being received: refused to a concurrent duplicate or clash."""
        self.receiving.add(path)
        self.dirs.update(parents(path))

    def release_path(self, path: str) -> None:
        """The hand-off of ``path`` is over; its directories stay counted if it became a
        shard record."""
        self.receiving.discard(path)
        if path not in self.shards:
            self.dirs.subtract(parents(path))
            for parent in parents(path):
                if self.dirs[parent] <= 0:
                    del self.dirs[parent]

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_GENERATION

    def row(self) -> dict[str, Any]:
        return {
            "job": self.job, "step": self.step, "world_size": self.world_size,
            "state": str(self.state), "ack": self.ack, "created_at": self.created_at,
            "handoff_at": self.handoff_at, "staged_at": self.staged_at,
            "drained_at": self.drained_at, "committed_at": self.committed_at, "error": self.error,
            "attempt": self.attempt,
        }

    def undrained(self) -> list[ShardRecord]:
        return list(self.open_shards.values())

    @property
    def never_drains(self) -> bool:
        """Ended for good: cancelled (superseded, replaced), or failed with a rank aborted
        here or a shard lost before local storage (ack=memory), which no ``retry`` can save
        (why_not_retryable, but for copies gone missing, which recovery gives up: from the
        tallies, O(ranks)). What it staged is given up (its copies went as it ended) whatever
        state a shard's record still reads: a deferred shard of a step superseded by a newer
        commit stays "staged", a failed one beside a lost memory hand-off "failed" (found
        attacking what operators see)."""
        if self.state is GenerationState.CANCELLED:
            return True
        return self.state is GenerationState.FAILED and (
            RankState.ABORTED in self.ranks.values()
            or self.by_state[ShardState.HELD] > 0 or self.by_state[ShardState.DISCARDED] > 0)

    def oldest_undrained_since(self) -> float | None:
        """When the oldest shard not yet drained was staged, on the monotonic clock (None:
        none, or none that will ever drain)."""
        if self.never_drains:
            return None
        times = [s.staged_mono for s in self.undrained()]
        return min(times) if times else None

    def rank_drained(self, rank: int) -> bool:
        return self.unsettled.get(rank, 0) == 0

    def count(self, shard: ShardRecord, delta: int) -> None:
        """``shard`` joins (+1) or leaves (-1) the generation's tallies as it is now: the
        ledger calls it around every change of a shard's state or fields, and when it adds or
        drops one, so the tallies always match ``shards``."""
        if not shard.settled:
            self.unsettled[shard.rank] = self.unsettled.get(shard.rank, 0) + delta
        self.by_state[shard.state] += delta
        self.bytes_by_state[shard.state] += delta * shard.size
        self.line_bytes += delta * shard.line_bytes
        if shard.state in UNDRAINED_SHARD:
            if delta > 0:
                self.open_shards[shard.id] = shard
            else:
                self.open_shards.pop(shard.id, None)

    def pending_deferred(self) -> list[ShardRecord]:
        return [s for s in self.shards.values() if s.deferred and s.state is ShardState.STAGED]

    def why_not_retryable(self) -> str:
        """Why ``retry`` could never save this generation ("" when it could)."""
        if any(st is RankState.ABORTED for st in self.ranks.values()):
            return "had an aborted rank; it cannot be retried, save a new step"
        lost = [s.path for s in self.shards.values()
                if s.state in (ShardState.HELD, ShardState.DISCARDED)]
        if lost:
            return f"lost shards {lost[:5]} before they reached local storage; save a new step"
        missing = [s.path for s in self.shards.values()
                   if s.state is ShardState.FAILED and not s.local_copy]
        if missing:
            return f"lost the local copies of {missing[:5]}; save a new step"
        return ""

    def summary(self) -> dict[str, Any]:
        held = [st for st, n in self.by_state.items() if n]
        given_up = self.never_drains
        by_state: dict[str, int] = {}
        bytes_by_state: dict[str, int] = {}
        for st in held:
            # Given up: shown as what they are, not "staged" (the runbook's stuck drain).
            name = str(ShardState.DISCARDED if given_up and st in UNDRAINED_SHARD else st)
            by_state[name] = by_state.get(name, 0) + self.by_state[st]
            bytes_by_state[name] = bytes_by_state.get(name, 0) + self.bytes_by_state[st]
        since = self.oldest_undrained_since()
        return {
            "job": self.job,
            "step": self.step,
            "state": str(self.state),
            "world_size": self.world_size,
            "ack": self.ack,
            "ranks": self._ranks_summary(),
            "shards": by_state,
            "bytes": bytes_by_state,
            "oldest_undrained_age_s": round(time.monotonic() - since, 3) if since else 0.0,
            "retrying": "" if self.terminal else self.retrying,
            "error": shortened(self.error),
        }

    def _ranks_summary(self) -> dict[str, Any]:
        # Bounded: a node serving many ranks shows how many are in each state instead.
        if len(self.ranks) <= SUMMARY_RANKS:
            return {str(r): str(st) for r, st in sorted(self.ranks.items())}
        counts: dict[str, Any] = {}
        for st in self.ranks.values():
            counts[str(st)] = counts.get(str(st), 0) + 1
        return {"count_by_state": counts}

