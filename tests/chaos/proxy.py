"""The S3 fault proxy (tests/integration/faultproxy.py) on its own event loop in a thread, so a
daemon subprocess can talk through it while the trial itself stays synchronous."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tests.integration.faultproxy import FaultProxy, ProxiedRequest

# What a flaky network and an overloaded server do to requests: reset connections, stall
# them (the daemon's read timeout must fire), cut responses half-way, drop them after the
# server acted, or answer 503. (error200/corrupt are left to targeted tests: real S3 never
# answers PutObject 200 with an error body.)
RANDOM_FAULTS = ("reset", "stall", "truncate", "drop_response", "slowdown")


class ThreadedProxy:
    def __init__(self, upstream_url: str, *, seed: int, stall_s: float = 4.0) -> None:
        host, port = upstream_url.removeprefix("http://").split(":")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="faultproxy",
                                       daemon=True)
        self.thread.start()
        self.proxy = FaultProxy(host, int(port), seed=seed, stall_s=stall_s)
        self._call(self.proxy.start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def do(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the proxy's loop (its state is not thread-safe)."""
        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return fut.result(10)

    @property
    def endpoint_url(self) -> str:
        return self.proxy.endpoint_url

    def random_faults(self, rng: random.Random, total_rate: float) -> dict[str, float]:
        """Spread ``total_rate`` over a seeded subset of the random faults."""
        chosen = rng.sample(RANDOM_FAULTS, rng.randint(1, len(RANDOM_FAULTS)))
        rates = {f: total_rate / len(chosen) for f in chosen}
        self.do(lambda: self.proxy.set_rates(**rates))
        return rates

    def calm(self) -> None:
        """No more faults: recovery runs against a healthy server."""
        def clear() -> None:
            self.proxy.set_rates()
            self.proxy._script.clear()  # scripted faults not yet used up

        self.do(clear)

    def inject(self, fault: str, *, times: int, match: Callable[[ProxiedRequest], bool]) -> None:
        self.do(lambda: self.proxy.inject(fault, times=times, match=match))

    def close(self) -> None:
        self._call(self.proxy.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
