"""The queue of staged shards waiting to drain: jobs take turns, oldest generation first."""

from __future__ import annotations

import asyncio
import collections
import heapq
from collections.abc import Callable

from ckptdrain.daemon.ledger import ShardRecord

__all__ = ["FairQueue"]


class FairQueue:
    """Shards waiting to drain. Jobs take turns, so one job's backlog never starves another's
    newer checkpoint; within a job the oldest generation goes first, in hand-off order."""

    def __init__(self) -> None:
        self._heaps: dict[str, list[tuple[tuple[float, int, int], ShardRecord]]] = {}
        self._turns: collections.deque[str] = collections.deque()
        self._ready = asyncio.Event()
        self._size = 0

    def put(self, job: str, key: tuple[float, int, int], shard: ShardRecord) -> None:
        heap = self._heaps.get(job)
        if heap is None:
            heap = self._heaps[job] = []
            self._turns.append(job)
        heapq.heappush(heap, (key, shard))
        self._size += 1
        self._ready.set()

    async def get(self) -> ShardRecord:
        while not self._size:
            self._ready.clear()
            await self._ready.wait()
        job = self._turns.popleft()
        heap = self._heaps[job]
        _, shard = heapq.heappop(heap)
        self._size -= 1
        if heap:
            self._turns.append(job)
        else:
            del self._heaps[job]
        return shard

    def take_more(self, first: ShardRecord, count: int, total_bytes: int, shard_bytes: int,
                  usable: Callable[[ShardRecord], bool]) -> list[ShardRecord]:
        """After :meth:`get` returned ``first``: up to ``count`` more shards of its generation
        queued right behind it (its job's next ones), each of at most ``shard_bytes`` and
        ``total_bytes`` together, while ``usable`` says each is; they leave the queue."""
        heap = self._heaps.get(first.job)
        taken: list[ShardRecord] = []
        while heap and len(taken) < count:
            shard = heap[0][1]
            if (shard.step != first.step or shard.size > shard_bytes
                    or shard.size > total_bytes or not usable(shard)):
                break
            heapq.heappop(heap)
            self._size -= 1
            total_bytes -= shard.size
            taken.append(shard)
        if heap is not None and not heap:
            del self._heaps[first.job]
            self._turns.remove(first.job)
        return taken

    def qsize(self) -> int:
        return self._size
