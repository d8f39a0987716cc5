"""Admission for a bounded resource (staged bytes, RAM bytes, queued shards), FIFO-fair.

A hand-off reserves what it needs *before* a byte is accepted. When the budget is full it
either fails at once (``reject``) or waits its turn in arrival order (``block``) up to a
timeout. A waiter holds nothing while it waits, and a release wakes waiters strictly in order,
so a large request is never starved by a stream of small ones.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from ckptdrain.daemon.errors import DaemonError


class BudgetFull(DaemonError):
    """The resource is full (or the wait for room timed out)."""

    def __init__(self, budget: Budget, requested: int, *, timed_out: bool) -> None:
        self.name = budget.name
        self.used = budget.used
        self.limit = budget.limit
        self.requested = requested
        self.timed_out = timed_out
        verb = "stayed full" if timed_out else "is full"
        super().__init__(
            f"{budget.name} {verb}: {budget.used} of {budget.limit} in use, {requested} requested"
        )


class AccountingError(DaemonError):
    """A budget was given back more than was taken: a bug (a double release), never a user
    error. It raises instead of clamping at zero, so tests catch the leak's twin."""


class TooLarge(DaemonError):
    """The request can never fit, however long it waits."""

    def __init__(self, budget: Budget, requested: int) -> None:
        self.name = budget.name
        self.limit = budget.limit
        self.requested = requested
        super().__init__(f"{requested} exceeds the whole {budget.name} limit of {budget.limit}")


@dataclass(slots=True)
class _Waiter:
    amount: int
    future: asyncio.Future[None]


class Budget:
    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def head_request(self) -> int:
        """What the first waiter asks for (0 when nobody waits): eviction frees room for it."""
        for waiter in self._waiters:
            if not waiter.future.done():
                return waiter.amount
        return 0

    def set_limit(self, limit: int) -> None:
        """A reload may raise or lower the limit; waiters that now fit are admitted."""
        self.limit = limit
        self._wake()

    def try_acquire(self, amount: int) -> bool:
        if amount > self.limit:
            raise TooLarge(self, amount)
        if not self._waiters and self.used + amount <= self.limit:
            self.used += amount
            return True
        return False

    async def acquire(self, amount: int, *, block: bool, timeout_s: float,
                      on_wait: Callable[[], None] | None = None) -> None:
        """Take ``amount``, waiting in arrival order (``block``) up to ``timeout_s``;
        ``on_wait`` is called once if it has to wait."""
        if self.try_acquire(amount):
            return
        if not block:
            raise BudgetFull(self, amount, timed_out=False)
        if on_wait is not None:
            on_wait()
        waiter = _Waiter(amount, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(waiter.future)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                # Admitted just as we gave up: hand the room back so nothing leaks.
                self.release(amount)
            else:
                waiter.future.cancel()
                self._remove(waiter)
            if isinstance(exc, TimeoutError):
                raise BudgetFull(self, amount, timed_out=True) from None
            raise

    def release(self, amount: int) -> None:
        if amount < 0 or amount > self.used:
            raise AccountingError(f"{self.name}: releasing {amount} with only {self.used} in use")
        self.used -= amount
        self._wake()

    def force(self, amount: int) -> None:
        """Take ``amount`` even past the limit: what recovery finds on disk is held whatever
        the limit says now; hand-offs wait until eviction or draining brings it back under."""
        self.used += amount

    async def reserve(self, amount: int, *, block: bool, timeout_s: float,
                      on_wait: Callable[[], None] | None = None) -> Reservation:
        await self.acquire(amount, block=block, timeout_s=timeout_s, on_wait=on_wait)
        return Reservation(self, amount)

    def reserve_now(self, amount: int) -> Reservation | None:
        return Reservation(self, amount) if self.try_acquire(amount) else None

    def adopt(self, amount: int) -> Reservation:
        """A reservation for room recovery found in use (see :meth:`force`)."""
        self.force(amount)
        return Reservation(self, amount)

    def _remove(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():
                self._waiters.popleft()
                continue
            if self.used + head.amount > self.limit:
                return
            self._waiters.popleft()
            self.used += head.amount
            head.future.set_result(None)


class Reservation:
    """Room held on one budget by exactly one owner, released exactly once.

    Whoever holds the object owns the room; handing it on is handing the object on. A second
    :meth:`release` raises :class:`AccountingError`: the owner model makes a double release a
    bug to find, not a count to clamp.
    """

    __slots__ = ("amount", "budget", "released", "then")

    def __init__(self, budget: Budget, amount: int) -> None:
        self.budget = budget
        self.amount = amount
        self.released = False
        # Other accounting the same room is charged to (a uid's share), given back with it.
        self.then: Callable[[], None] | None = None

    def release(self) -> None:
        if self.released:
            raise AccountingError(f"{self.budget.name}: reservation of {self.amount} released twice")
        self.released = True
        self.budget.release(self.amount)
        self.settle()

    def settle(self) -> None:
        """Give back the other accounting now, and keep the room (a drained shard's local
        copy stays inside the budget, but no longer counts against its uid's share)."""
        then, self.then = self.then, None
        if then is not None:
            then()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"Reservation({self.budget.name}, {self.amount}, {state})"
