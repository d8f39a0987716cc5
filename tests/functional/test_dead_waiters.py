"""A hand-off waiting for room goes when its client does.

Found attacking backpressure: a job killed (preempted, ``scancel``) while its ranks' hand-offs
waited for room left those waits queued, first in line, for ``limits.block_timeout_s`` (300 s
by default). They showed in ``status`` as blocked hand-offs, and, the queue being served in
order, the first room that came went to a client that was no longer there. A wait for room now
ends when its client hangs up (``Channel.unless_hung_up``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import DaemonProcess, wait_for

MiB = 1 << 20

# A process that begins a generation and hands off one shard, then waits (it is killed).
_RANK = """
import sys
from ckptdrain.client import Client
c = Client(sys.argv[1], timeout_s=600)
with c.generation(sys.argv[2], 1, rank=0, world_size=1, ack=sys.argv[3]) as g:
    g.put("big", b"k" * int(sys.argv[4]))
"""


def _blocked(d: DaemonProcess) -> int:
    return int(d.client().status()["blocked_handoffs"])


def _kill_while_blocked(d: DaemonProcess, script: str, *args: str) -> None:
    """Run ``script`` (a client) until the daemon counts it blocked, kill -9 it, and see the
    daemon stop counting it: before, it stayed blocked till limits.block_timeout_s (300 s)."""
    rank = subprocess.Popen([sys.executable, "-c", script, str(d.socket_path), *args])
    try:
        wait_for(lambda: _blocked(d) == 1, timeout_s=30)
        rank.send_signal(signal.SIGKILL)
        rank.wait(10)
        wait_for(lambda: _blocked(d) == 0, timeout_s=20)
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


@pytest.mark.parametrize("ack", ["local", "memory"])
def test_a_killed_clients_wait_for_room_ends_with_it(make_daemon: Any, ack: str) -> None:
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="8MiB",
                                   CKPTDRAIN_LIMITS__MAX_MEMORY_BYTES="8MiB",
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    with d.client().generation("occupant", 1, ack=ack) as gen:
        gen.put("occupant", os.urandom(8 * MiB))  # fills the room; the drain is held
    _kill_while_blocked(d, _RANK, "killed", ack, str(4 * MiB))
    assert "hung up while its hand-off waited for" in d.log()

    def killed_state() -> str:
        [killed] = [g for g in d.client().status()["generations"] if g["job"] == "killed"]
        return str(killed["state"])

    # The rank is aborted as its connection ends, a moment after its wait does (seen "open"
    # for that moment in a run with two test workers).
    wait_for(lambda: killed_state() == "failed", timeout_s=20)


_BEGIN = """
import sys
from ckptdrain.client import Client
c = Client(sys.argv[1], timeout_s=600)
with c.generation(sys.argv[2], 2, rank=0, world_size=1) as g:
    g.put("late", b"x")
"""


def test_a_killed_clients_wait_for_a_generation_slot_ends_with_it(make_daemon: Any) -> None:
    # The wait held the step's begin lock too: a restarted job beginning the same step
    # waited behind a client that was gone, till block_timeout_s.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_GENERATIONS_IN_FLIGHT="1",
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    with d.client().generation("wedge", 1) as gen:
        gen.put("first", os.urandom(MiB))  # in flight until it drains: the drain is held
    _kill_while_blocked(d, _BEGIN, "wedge")
    assert "hung up while its begin waited for a generation slot" in d.log()
    assert [g["step"] for g in d.client().status()["generations"]] == [1]
