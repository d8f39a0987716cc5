"""One Generation used by several threads at once (a DCP writer's thread pool, a user's own):
its requests take turns on its one connection.

Found attacking from the training side: 8 threads putting into one Generation interleaved
their frames on its connection, and the save failed (GenerationFailed, "Bad file
descriptor"); small shards sent in one frame happened to pass.
"""

from __future__ import annotations

import os
import threading

import pytest

from tests.conftest import DaemonProcess


@pytest.mark.parametrize("ack", ["local", "memory"])
def test_threads_putting_into_one_generation_all_commit(make_daemon, ack: str) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK=ack)
    c = d.client()
    # Larger than one inline frame (256 KiB), so each put takes two round trips.
    shards = {f"t{t}/s{i}": os.urandom(300_000) for t in range(8) for i in range(5)}
    errors: list[BaseException] = []
    with c.generation("threads", 1, rank=0, world_size=1) as gen:
        def work(t: int) -> None:
            try:
                for i in range(5):
                    gen.put(f"t{t}/s{i}", shards[f"t{t}/s{i}"])
            except BaseException as exc:  # asserted on below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors[:3]
    c.wait("threads", 1, timeout_s=60)
    step = d.dest / "threads" / f"{1:020d}"
    for path, data in shards.items():
        assert (step / path).read_bytes() == data


@pytest.mark.timeout(30)
def test_a_call_from_a_signal_handler_while_the_pool_is_taken_completes(
        daemon: DaemonProcess) -> None:
    # A signal handler runs between two bytecodes of whatever the thread was doing, which may
    # be the few lines where the client takes an idle connection out of its pool under the
    # pool's lock; a plain lock made the handler's own call wait for good. Held here by hand,
    # where a handler would find it held.
    c = daemon.client()
    assert c.latest("none") is None  # a connection in the pool
    with c._lock:
        assert c.latest("none") is None
        assert c.status()["node_id"] == daemon.node_id
