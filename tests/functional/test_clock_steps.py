"""Real daemons whose wall clock a test steps mid-run (tests/clockshift: ``time.time`` runs
the seconds in a file off the real clock; the monotonic clock is untouched, as under NTP).

Found attacking the clocks: `drain.commit_wait_s` was timed on the wall clock, so a step
forward failed a generation waiting for another node at once (paging `timeout`, though the
other node then committed it), and a step back held it for hours past its wait. The expiry
of failed generations is covered in tests/unit/test_clock_steps.py."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import GenerationFailed, Timeout
from tests.conftest import DaemonProcess, wait_for

CLOCKSHIFT = Path(__file__).resolve().parents[1] / "clockshift"
JOB = "clocks"


class Clock:
    """One daemon's wall clock offset, in seconds from the real one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.set(0.0)

    def set(self, offset_s: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(repr(offset_s))
        os.replace(tmp, self.path)

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(CLOCKSHIFT), os.environ.get("PYTHONPATH")) if p)
        return {"PYTHONPATH": path, "CKPTDRAIN_TEST_CLOCK_FILE": str(self.path)}


def shifted_by(d: DaemonProcess, offset_s: float) -> bool:
    """Whether the daemon's newest log line was stamped ``offset_s`` off the real clock."""
    stamps = re.findall(r"^ts=(\S+)Z", d.log(), re.M)
    if not stamps:
        return False
    logged = datetime.fromisoformat(stamps[-1] + "+00:00").timestamp()
    return abs(logged - time.time() - offset_s) < 60


def stepped(d: DaemonProcess, offset_s: float) -> bool:
    """Ask for a reload (logged, stamped by the daemon's clock); whether the last one logged
    was stamped ``offset_s`` off the real clock."""
    assert d.proc is not None
    shifted = shifted_by(d, offset_s)
    if not shifted:
        d.proc.send_signal(signal.SIGHUP)
    return shifted


def state(d: DaemonProcess, step: int) -> str:
    gens = d.client().status(JOB)["generations"]
    return next((g["state"] for g in gens if g["step"] == step), "absent")


def rank_recorded(d: DaemonProcess, step: int, rank: int) -> None:
    """Rank ``rank`` of a two-rank generation saved on ``d``, its part recorded."""
    with d.client().generation(JOB, step, rank=rank, world_size=2) as g:
        g.put(f"rank{rank}.bin", bytes([rank]) * 4096)
    wait_for(lambda: state(d, step) == "recorded", timeout_s=30)


@pytest.mark.parametrize("offset_s", [7200.0, -7200.0])
def test_the_commit_wait_is_not_moved_by_a_step_of_the_clock(
        make_daemon: Any, tmp_path: Path, offset_s: float) -> None:
    clock = Clock(tmp_path / "clock-a")
    # Forward: a wait of ten minutes must not end at the step. Back: one of two seconds must
    # end after two seconds, not two hours and two seconds.
    wait_s = "600" if offset_s > 0 else "2"
    a: DaemonProcess = make_daemon(**clock.env(), CKPTDRAIN_DRAIN__COMMIT_WAIT_S=wait_s,
                                   CKPTDRAIN_DRAIN__COMMIT_POLL_INTERVAL_S="0.1")
    rank_recorded(a, 1, rank=0)
    clock.set(offset_s)
    wait_for(lambda: stepped(a, offset_s), timeout_s=10, interval_s=0.2)
    if offset_s > 0:
        with pytest.raises(Timeout):  # twenty polls: still waiting, not failed
            a.client().wait(JOB, 1, timeout_s=2)
        assert state(a, 1) == "recorded"
        b: DaemonProcess = make_daemon(node_id="node-b")
        with b.client().generation(JOB, 1, rank=1, world_size=2) as g:
            g.put("rank1.bin", b"\x01" * 4096)
        a.client().wait(JOB, 1, timeout_s=30)  # committed, as node A reports it
        assert state(a, 1) == "committed"
    else:
        with pytest.raises(GenerationFailed, match=r"not committed within drain\.commit_wait_s"):
            a.client().wait(JOB, 1, timeout_s=30)


def last_commit_time(d: DaemonProcess) -> float | None:
    with urllib.request.urlopen(d.client().status()["metrics"], timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f'ckptdrain_last_commit_timestamp_seconds{{job="{JOB}"}}'):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_the_last_commit_time_after_a_restart_is_still_this_nodes(
        make_daemon: Any, tmp_path: Path) -> None:
    # Found attacking the clocks, twice: the last-commit gauge was the manifest's clock (the
    # publishing node's), and after the fix, a restart set it from the journal, which held the
    # manifest's clock again: a publisher two hours behind paged CkptdrainNoRecentCommit on
    # this node as soon as it restarted. The journal holds when this node saw the commit.
    clock = Clock(tmp_path / "clock-c")
    d: DaemonProcess = make_daemon("node-d")
    c: DaemonProcess = make_daemon("node-c", **clock.env())
    clock.set(-7200.0)
    wait_for(lambda: stepped(c, -7200.0), timeout_s=10, interval_s=0.2)
    rank_recorded(d, 1, rank=0)
    # node-d stopped while node-c records the last rank: node-c publishes, not a poll of
    # node-d's that read node-c's record first (the test failed so now and then).
    assert d.proc is not None
    d.proc.send_signal(signal.SIGSTOP)
    try:
        with c.client().generation(JOB, 1, rank=1, world_size=2) as g:  # the last: it publishes
            g.put("rank1.bin", b"\x01" * 4096)
        c.client().wait(JOB, 1, timeout_s=30)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    d.client().wait(JOB, 1, timeout_s=30)
    manifest = json.loads((d.dest / JOB / f"{1:020d}" / "MANIFEST.json").read_text())
    assert manifest["clocks"]["committed"] < time.time() - 7000  # node-c's clock published it
    assert d.stop() == 0
    d.start()
    wait_for(lambda: last_commit_time(d) is not None)
    seen = last_commit_time(d)
    assert seen is not None and abs(seen - time.time()) < 120
