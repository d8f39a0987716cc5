"""The queue of staged shards waiting to drain: jobs take turns, oldest generation first."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ckptdrain.daemon.ledger import ShardRecord

__all__ = ["BatchLanes", "FairQueue"]

# How many queued shards of the first one's directory a batch looks at past those it takes
# (too large, or no longer drainable): a bound on take_more's work on the event loop.
_GROUP_LOOK_AHEAD = 64

_Key = tuple[float, int, int]
_Group = tuple[str, int, str]  # (job, step, directory of the shard's path)


@dataclass(slots=True, eq=False)
class _Entry:
    """One queued shard: in its job's heap, and in its directory's group until it leaves."""

    key: _Key
    job: str
    shard: ShardRecord
    group: _Group
    live: bool = True

    def __lt__(self, other: _Entry) -> bool:
        return self.key < other.key


@dataclass(slots=True)
class _JobQueue:
    """One job's queued shards; entries taken into a batch stay in the heap, not live, until
    they reach its top."""

    heap: list[_Entry] = field(default_factory=list)
    live: int = 0


def _group(job: str, shard: ShardRecord) -> _Group:
    return (job, shard.step, shard.path.rpartition("/")[0])


class FairQueue:
    """Shards waiting to drain. Jobs take turns, so one job's backlog never starves another's
    newer checkpoint; within a job the oldest generation goes first, in hand-off order.

    A batch (:meth:`take_more`) takes whole directories: the queued shards in its first one's
    directory, then those in the directory of the job's next shard. Ranks hand off side by
    side, so the queue interleaves their directories; batching only the shards right behind
    would give each directory of a POSIX destination about one shard per batch, and each
    would pay its own walk to the directory and its own directory fsync."""

    def __init__(self) -> None:
        self._jobs: dict[str, _JobQueue] = {}
        self._turns: collections.deque[str] = collections.deque()
        # Live entries by directory, in the order they were queued (a dict as an ordered set).
        self._groups: dict[_Group, dict[_Entry, None]] = {}
        # Live entries by shard id: a shard is queued once, however often it is put.
        self._entries: dict[int, _Entry] = {}
        self._ready = asyncio.Event()
        self._size = 0

    def put(self, job: str, key: _Key, shard: ShardRecord) -> None:
        """Queue ``shard``, unless it is queued already. A failed generation's shards stay
        queued until a worker finds them no longer drainable, and a retry queues them again:
        queued twice, one batch took the same shard twice and failed the retried generation
        (found attacking)."""
        held = self._entries.get(shard.id)
        if held is not None:
            if held.shard is shard:
                return
            self._leave(self._jobs[held.job], held)  # another record of its id: the newer one
        queue = self._jobs.get(job)
        if queue is None:
            queue = self._jobs[job] = _JobQueue()
            self._turns.append(job)
        entry = _Entry(key, job, shard, _group(job, shard))
        heapq.heappush(queue.heap, entry)
        self._groups.setdefault(entry.group, {})[entry] = None
        self._entries[shard.id] = entry
        queue.live += 1
        self._size += 1
        self._ready.set()

    async def get(self) -> ShardRecord:
        while not self._size:
            self._ready.clear()
            await self._ready.wait()
        job = self._turns.popleft()
        queue = self._jobs[job]
        while True:
            entry = heapq.heappop(queue.heap)
            if entry.live:
                break
        self._leave(queue, entry)
        if queue.live:
            self._turns.append(job)
        return entry.shard

    def take_more(self, first: ShardRecord, count: int, total_bytes: int, shard_bytes: int,
                  usable: Callable[[ShardRecord], bool]) -> list[ShardRecord]:
        """After :meth:`get` returned ``first``: up to ``count`` more shards of its generation,
        each of at most ``shard_bytes`` and ``total_bytes`` together, while ``usable`` says
        each is. They leave the queue. Whole directories go first: those queued in
        ``first``'s, then those in the directory of the job's next queued shard, and so on, so
        a batch writes into as few directories as it can."""
        queue = self._jobs.get(first.job)
        taken: list[ShardRecord] = []

        def fits(shard: ShardRecord) -> bool:
            return (shard.step == first.step and shard.size <= shard_bytes
                    and shard.size <= total_bytes and usable(shard))

        lead = first
        while queue is not None and len(taken) < count:
            picked: list[_Entry] = []
            passed = 0
            for entry in self._groups.get(_group(first.job, lead), ()):
                if len(taken) + len(picked) >= count or passed >= _GROUP_LOOK_AHEAD:
                    break
                if fits(entry.shard):
                    picked.append(entry)
                    total_bytes -= entry.shard.size
                else:
                    passed += 1
            for entry in picked:  # not while iterating over their group
                self._leave(queue, entry)
                taken.append(entry.shard)
            heap = queue.heap
            while heap and not heap[0].live:
                heapq.heappop(heap)
            if (lead is not first and not picked) or not heap or not fits(heap[0].shard):
                break  # (a directory that gave nothing, as for one past the look-ahead)
            lead = heap[0].shard  # the next directory: that of the job's next shard
        return taken

    def _leave(self, queue: _JobQueue, entry: _Entry) -> None:
        """``entry`` leaves the queue (its heap slot, if still there, is skipped from now)."""
        entry.live = False
        del self._entries[entry.shard.id]
        group = self._groups[entry.group]
        del group[entry]
        if not group:
            del self._groups[entry.group]
        queue.live -= 1
        self._size -= 1
        if not queue.live:
            # Its heap holds only entries taken into batches: its queue goes with them.
            del self._jobs[entry.job]
            if entry.job in self._turns:  # (get took the turn already)
                self._turns.remove(entry.job)

    def qsize(self) -> int:
        return self._size


class BatchLanes:
    """How many drains of small shards (a batch, or one alone) run at once: ``limit()``, read
    each time, so it may change as the destination is learnt (Backend.batch_lanes)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._busy = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def full(self) -> bool:
        return self._busy >= max(1, self._limit())

    async def freed(self) -> None:
        """Until a lane is free (another waiter may take it first)."""
        while self.full:
            wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(wake)
            try:
                await wake
            finally:
                if wake in self._waiters:  # cancelled while it waited
                    self._waiters.remove(wake)

    @contextlib.asynccontextmanager
    async def lane(self) -> AsyncIterator[None]:
        """A lane, held for the block; entered without a turn of the loop when one is free."""
        await self.freed()
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            # Every waiter looks again (at most the drain's workers): a waiter woken alone
            # and cancelled before it ran would leave the lane free and the rest asleep.
            waiters, self._waiters = self._waiters, []
            for wake in waiters:
                if not wake.done():
                    wake.set_result(None)
