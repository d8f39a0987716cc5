"""Waiting on work handed to a thread (or to another task) so that a cancelled caller cannot
return while that work still uses what the caller frees next: an fd it closes, a buffer it
reuses, a memfd it hands on.

The one rule: a cancelled caller first waits for the work to end, *however often it is
cancelled meanwhile*. A drain task can be cancelled twice (its own timeout, then the shutdown's
TaskGroup); a plain ``await asyncio.wait([future])`` in an ``except CancelledError`` ends at the
second cancel, and the caller's ``finally`` closed the fd under a thread still reading it. Every
such wait in the daemon goes through :func:`outlast`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def outlast(future: asyncio.Future[T], timeout_s: float | None = None) -> None:
    """Return once ``future`` is done (or ``timeout_s`` has passed), through any number of
    cancellations of the caller. Meant for a caller that is already handling a cancellation
    and re-raises it afterwards, so no cancel is lost: each one that arrives here is one more
    request for what the caller is doing anyway."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while not future.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            return
        try:
            await asyncio.wait([future], timeout=left)
        except asyncio.CancelledError:
            continue


async def settled(future: asyncio.Future[T], *, stop: threading.Event | None = None,
                  grace_s: float | None = None) -> T:
    """``await future`` (a thread's work, from ``run_in_executor``); cancelled, tell the thread
    to ``stop`` (when it polls an Event) and wait for it to end (up to ``grace_s``, for work
    that may be stuck in the kernel), then re-raise the cancellation."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if stop is not None:
            stop.set()
        await outlast(future, grace_s)
        if future.done() and not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller sees
        raise


async def in_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in the loop's executor; if cancelled, wait for the thread to finish before
    re-raising, so no thread still writes to an fd the caller is about to close."""
    return await settled(asyncio.get_running_loop().run_in_executor(None, fn, *args))
