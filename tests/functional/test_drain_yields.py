"""The drain yields to hand-offs: while a rank waits on one that moves, no new drain range
starts (up to ``drain.yield_to_handoffs_s``), and the drain goes on once it ends; a hand-off
whose client sends nothing holds nothing back."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ckptdrain.client import wire
from tests.conftest import DaemonProcess, wait_for
from tests.functional.test_bad_input import RawClient

MiB = 1 << 20


def _backlog(d: DaemonProcess, job: str) -> None:
    with d.client().generation(job, 1) as gen:
        gen.put("big.bin", os.urandom(96 * MiB))


def _draining(d: DaemonProcess) -> list[dict[str, Any]]:
    return list(d.client().status()["shards_draining"])


def test_a_hand_off_in_flight_holds_new_drain_ranges_back(make_daemon: Any) -> None:
    # 16 MiB ranges at 24 MiB/s: the 96 MiB backlog drains over ~4 s, range by range.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S=str(24 * MiB),
                                   CKPTDRAIN_DRAIN__YIELD_TO_HANDOFFS_S="60")
    _backlog(d, "backlog")
    wait_for(lambda: _draining(d), timeout_s=30)
    assert d.client().status()["drain_yields"] == 0
    # A hand-off whose client sends its bytes steadily (32 MiB at 12.8 MiB/s, three times
    # the rate the drain yields to): the drain yields to it.
    size, chunk = 32 * MiB, 256 * 1024
    with RawClient(d.socket_path) as raw:
        raw.hello_begin(job="ranks", step=1)
        reply = raw.call("put", job="ranks", step=1, rank=0, path="w.bin", size=size)
        assert reply.kind == "ok" and reply.fields.get("ready") is True
        raw.sock.sendall(wire.encode_message("data", {}, payload_len=size))

        def send() -> None:
            for _ in range(size // chunk):
                raw.sock.sendall(b"x" * chunk)
                time.sleep(0.02)

        sender = threading.Thread(target=send)
        sender.start()
        try:
            wait_for(lambda: d.client().status()["drain_yields"] >= 1, timeout_s=30)
            moved = [s["drained_bytes"] for s in _draining(d)]
            assert moved and all(m < 96 * MiB for m in moved)
        finally:
            sender.join(60)
        assert raw.reply().kind == "ok"
    # The hand-off ended: the drain goes on and the backlog commits.
    d.client().wait("backlog", 1, timeout_s=120)
    assert (d.dest / "backlog").exists()
    assert d.client().status()["drain_yields"] >= 1


def test_with_yield_off_the_drain_never_waits(make_daemon: Any) -> None:
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S=str(24 * MiB),
                                   CKPTDRAIN_DRAIN__YIELD_TO_HANDOFFS_S="0")
    _backlog(d, "backlog")
    wait_for(lambda: _draining(d), timeout_s=30)
    with d.client().generation("ranks", 1) as gen:
        for i in range(4):
            gen.put(f"w{i}.bin", os.urandom(8 * MiB))
    d.client().wait("backlog", 1, timeout_s=120)
    d.client().wait("ranks", 1, timeout_s=120)
    assert d.client().status()["drain_yields"] == 0


def test_a_hand_off_that_sends_nothing_holds_no_drain_back(make_daemon: Any) -> None:
    # Found attacking the daemon as a second user: a client that opened a put and sent
    # nothing held every job's drain to one 16 MiB range per yield_to_handoffs_s, again
    # after each cut-off. Here the stalled put stays open (no cut-off for minutes) while a
    # 96 MiB backlog drains and commits; before, with a 60 s yield, its six ranges waited
    # 60 s each.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__YIELD_TO_HANDOFFS_S="60",
                                   CKPTDRAIN_LIMITS__CLIENT_RATE_GRACE_S="600",
                                   CKPTDRAIN_LIMITS__CLIENT_IDLE_TIMEOUT_S="600")
    with RawClient(d.socket_path) as raw:
        raw.hello_begin(job="stalled", step=1)
        reply = raw.call("put", job="stalled", step=1, rank=0, path="w.bin", size=4 * MiB)
        assert reply.kind == "ok" and reply.fields.get("ready") is True
        raw.sock.sendall(wire.encode_message("data", {}, payload_len=4 * MiB))
        _backlog(d, "backlog")
        d.client().wait("backlog", 1, timeout_s=120)
        stalled = [g for g in d.client().status()["generations"] if g["job"] == "stalled"]
        assert stalled and stalled[0]["state"] not in ("failed", "committed"), stalled
    assert (d.dest / "backlog" / f"{1:020d}" / "big.bin").stat().st_size == 96 * MiB


def test_a_hand_off_that_keeps_moving_holds_the_drain_back_half_the_time_at_most(
        make_daemon: Any) -> None:
    # Found attacking the fix: one connection sending 5 MiB/s (over the rate the drain
    # yields to) in 64 KiB chunks held every job's drain to one 16 MiB range per 2 s wait:
    # a 256 MiB shard took 32 s to commit instead of 0.35 s. Now after a whole wait the
    # drain yields to nothing for as long. Here a 96 MiB backlog (six ranges) drains beside
    # such a hand-off: before, all six ranges waited.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__YIELD_TO_HANDOFFS_S="2")
    size, chunk = 512 * MiB, 64 * 1024
    with RawClient(d.socket_path) as raw:
        raw.hello_begin(job="steady", step=1)
        reply = raw.call("put", job="steady", step=1, rank=0, path="w.bin", size=size)
        assert reply.kind == "ok" and reply.fields.get("ready") is True
        raw.sock.sendall(wire.encode_message("data", {}, payload_len=size))
        stop = threading.Event()

        def send() -> None:  # 6 MiB/s until stopped
            # On a schedule, not a sleep per chunk: under a loaded test run the sleeps
            # overshot, the average fell below the 4 MiB/s the drain yields to, and it never
            # yielded (a fresh-clone run measured 0 yields).
            due = time.monotonic()
            while not stop.is_set():
                raw.sock.sendall(b"x" * chunk)
                due += chunk / (6 * MiB)
                time.sleep(max(0.0, due - time.monotonic()))

        sender = threading.Thread(target=send)
        sender.start()
        try:
            _backlog(d, "backlog")
            d.client().wait("backlog", 1, timeout_s=120)
            yields = d.client().status()["drain_yields"]
        finally:
            stop.set()
            sender.join(30)
    assert 1 <= yields <= 3, yields
