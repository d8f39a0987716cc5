"""Every local copy counts: staging never holds more than max_staged_bytes, kept copies are
evicted oldest first when a hand-off needs the room, and nothing undrained is ever evicted."""

from __future__ import annotations

import pytest

from ckptdrain.client import Backpressure
from tests.conftest import DaemonProcess, wait_for

MiB = 1 << 20


def on_disk(d: DaemonProcess) -> int:
    return sum(p.stat().st_size for p in (d.staging / "shards").iterdir() if p.suffix == ".data")


def state(d: DaemonProcess, job: str, step: int) -> str:
    for g in d.client().status()["generations"]:
        if (g["job"], g["step"]) == (job, step):
            return str(g["state"])
    return "gone"


def test_copies_of_generations_waiting_on_other_nodes_stay_inside_the_limit(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(
        CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="4MiB",
        CKPTDRAIN_LIMITS__MAX_GENERATIONS_IN_FLIGHT="4",
        CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY="true",
    )
    c = d.client()
    for step in (1, 2, 3):
        # Rank 1 never comes: each generation drains here and waits on the other node.
        with c.generation("waiting", step, rank=0, world_size=2) as gen:
            gen.put("r0", bytes([step]) * (3 * MiB))
        wait_for(lambda step=step: state(d, "waiting", step) == "recorded")  # type: ignore[misc]
        status = c.status()
        assert status["staged_bytes"] <= 4 * MiB, status
    wait_for(lambda: on_disk(d) <= 4 * MiB)
    # The newest one's copy is the one left; the older ones were evicted for it.
    assert c.status()["kept_copy_bytes"] == 3 * MiB
    assert "event=local_copies_evicted" in d.log()


def test_undrained_shards_are_never_evicted(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(
        CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="4MiB",
        CKPTDRAIN_LIMITS__ON_FULL="reject",
        CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1",  # nothing drains
    )
    c = d.client()
    with c.generation("slow", 1) as gen:
        gen.put("a", b"a" * (3 * MiB))
        with pytest.raises(Backpressure) as refused:
            gen.put("b", b"b" * (3 * MiB))  # cannot fit while the first is undrained
        assert refused.value.details["limit"] == "max_staged_bytes"
        gen.abort("test over")
    assert on_disk(d) <= 3 * MiB


def test_a_restart_with_keep_local_copy_off_keeps_no_drained_copy(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Drained copies dropped with keep_local_copy off are unlinked in gathered batches: a
    # stop may come first. The next start must not take the files found for kept copies.
    # The same holds for copies kept under keep_local_copy = true when it is turned off.
    d: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY="true")
    c = d.client()
    with c.generation("kept", 1) as gen:
        for i in range(4):
            gen.put(f"s{i}", bytes([i]) * (256 << 10))
    c.wait("kept", 1, timeout_s=30)
    assert c.status()["kept_copy_bytes"] == 4 * (256 << 10)
    assert on_disk(d) == 4 * (256 << 10)
    assert d.stop() == 0
    d.overrides["CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY"] = "false"
    d.start()
    status = d.client().status()
    assert status["kept_copy_bytes"] == 0 and status["staged_bytes"] == 0, status
    assert on_disk(d) == 0
    assert state(d, "kept", 1) == "committed"
