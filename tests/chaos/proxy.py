"""The S3 fault proxy (tests/integration/faultproxy.py) on its own event loop in a thread, so a
daemon subprocess can talk through it while the trial itself stays synchronous."""

from __future__ import annotations

import random
from collections.abc import Callable

from tests.integration.faultproxy import ProxiedRequest, ThreadedProxy

# What a flaky network and an overloaded server do to requests: reset connections, stall
# them (the daemon's read timeout must fire), cut responses half-way, drop them after the
# server acted, or answer 503. (error200/corrupt are left to targeted tests: real S3 never
# answers PutObject 200 with an error body.)
RANDOM_FAULTS = ("reset", "stall", "truncate", "drop_response", "slowdown")


class ChaosProxy(ThreadedProxy):
    """The threaded fault proxy, with the chaos suites' seeded fault mixes."""

    def __init__(self, upstream_url: str, *, seed: int, stall_s: float = 4.0) -> None:
        super().__init__(upstream_url, seed=seed, stall_s=stall_s)

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
