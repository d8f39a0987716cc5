"""Running one coroutine function over many items, a bounded number at a time.

Used wherever the daemon or a command works through every shard of a generation (verify,
restore, stat, delete): workers pull from one iterator, so 100,000 shards cost ``concurrency``
tasks, not 100,000, and one TaskGroup owns them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

__all__ = ["for_each_bounded"]

_T = TypeVar("_T")


async def for_each_bounded(
    items: Sequence[_T], fn: Callable[[_T], Awaitable[object]], concurrency: int
) -> None:
    """Run ``fn`` over ``items`` with at most ``concurrency`` in flight, all owned by one
    TaskGroup; the first failure cancels the rest and is raised as itself."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, not {concurrency}")
    work: Iterator[_T] = iter(items)

    async def worker() -> None:
        # Workers pull from one iterator: no task per shard, so 100,000 shards cost
        # `concurrency` tasks, not 100,000.
        for item in work:
            await fn(item)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(items))):
                group.create_task(worker())
    except BaseExceptionGroup as group_exc:
        raise group_exc.exceptions[0] from None
