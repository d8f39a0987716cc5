"""Which hand-offs the drain yields to: those not waiting on their client, and those whose
client sends fast enough; not a stalled or trickling one (found attacking the daemon)."""

from __future__ import annotations

from dataclasses import dataclass

from ckptdrain.daemon.dataplane import RateFloor
from ckptdrain.daemon.yielding import GRACE_S, MIN_BYTES_PER_S, HandoffYield


@dataclass
class Conn:
    transfer: RateFloor | None


def floor(started: float, got: int) -> RateFloor:
    return RateFloor(rate=1, grace_s=10.0, started=started, got=got)


def test_only_hand_offs_that_move_are_yielded_to() -> None:
    yielding = HandoffYield()
    now = 1000.0
    assert not yielding.moving(now)  # none in flight
    with yielding.handoff(Conn(floor(started=now - 5, got=0))):  # sent nothing for 5 s
        assert not yielding.moving(now)
        with yielding.handoff(Conn(floor(started=now - 5, got=5 * 300_000))):  # a trickle
            assert not yielding.moving(now)
        with yielding.handoff(Conn(floor(started=now - GRACE_S / 2, got=0))):  # just due
            assert yielding.moving(now)
        with yielding.handoff(Conn(floor(started=now - 2, got=2 * MIN_BYTES_PER_S))):
            assert yielding.moving(now)
        with yielding.handoff(Conn(None)):  # staging, fsyncing, journalling: our own work
            assert yielding.moving(now)
        with yielding.handoff():  # nothing to watch
            assert yielding.moving(now)
        assert not yielding.moving(now)
    assert not yielding.moving(now)
