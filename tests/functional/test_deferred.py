"""Deferred shards (DCP's .metadata): written only once every rank's data is at the
destination, right before the manifest, so the directory never looks loadable early."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path

from ckptdrain.client.manifest import Manifest
from tests.conftest import DaemonProcess


def test_deferred_shard_waits_for_every_rank(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b")
    root: Path = a.dest / "dcp" / f"{4:020d}"
    with a.client().generation("dcp", 4, rank=0, world_size=2) as gen:
        gen.put("__0_0.distcp", b"rank zero data" * 100)
        gen.put(".metadata", b"the metadata", deferred=True)
    deadline = time.monotonic() + 30
    while not (root / "_parts" / "node-a.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.5)  # several commit polls: still nothing may drain .metadata
    assert (root / "__0_0.distcp").exists()
    assert not (root / ".metadata").exists(), ".metadata drained before rank 1's data"
    with b.client().generation("dcp", 4, rank=1, world_size=2) as gen:
        gen.put("__1_0.distcp", b"rank one data" * 100)
    a.client().wait("dcp", 4, timeout_s=30)
    b.client().wait("dcp", 4, timeout_s=30)
    assert (root / ".metadata").read_bytes() == b"the metadata"
    assert (root / ".metadata").stat().st_mtime_ns >= (root / "__1_0.distcp").stat().st_mtime_ns
    manifest = Manifest.from_json((root / "MANIFEST.json").read_bytes())
    assert {s.path for s in manifest.shards} == {"__0_0.distcp", "__1_0.distcp", ".metadata"}


def test_deferred_shard_on_a_single_node_survives_a_restart(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    with d.client().generation("dcp1", 1, rank=0, world_size=1) as gen:
        gen.put("__0_0.distcp", b"x" * 1000)
        gen.put(".metadata", b"meta", deferred=True)
    d.kill()
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    d.start()
    d.client().wait("dcp1", 1, timeout_s=30)
    assert (d.dest / "dcp1" / f"{1:020d}" / ".metadata").read_bytes() == b"meta"


def test_a_deferred_shard_of_a_step_superseded_by_a_newer_commit_is_not_left_undrained(  # type: ignore[no-untyped-def]
        make_daemon) -> None:
    # Found attacking what operators see: step 1 recorded here, waiting for another node's
    # rank, was cancelled when step 2 committed first; its deferred .metadata (DCP's) stayed
    # "staged". It was the job's oldest undrained shard on a node that drained fine
    # (CkptdrainOldestUndrainedTooOld fired until the step was forgotten, an hour or more
    # later), ckptdrain_queue_shards{state="staged"} showed a stuck drain, and `ckptdrain
    # drain` called it a failed shard kept for `ckptdrain retry`, which refuses a cancelled
    # step.
    from tests.conftest import wait_for
    from tests.functional.test_startup import scrape

    d: DaemonProcess = make_daemon()
    c = d.client()
    with c.generation("dcp", 1, rank=0, world_size=2) as gen:
        gen.put("__0_0.distcp", b"rank zero data" * 100)
        gen.put(".metadata", b"the metadata", deferred=True)
    wait_for(lambda: c.status()["generations"][0]["state"] == "recorded")
    with c.generation("dcp", 2) as gen:
        gen.put("__0_0.distcp", b"step two" * 100)
    c.wait("dcp", 2, timeout_s=30)
    wait_for(lambda: c.status(job="dcp")["generations"][0]["state"] == "cancelled")
    status = c.status()
    (one,) = [g for g in status["generations"] if g["step"] == 1]
    assert "staged" not in one["shards"] and one["oldest_undrained_age_s"] == 0.0, one
    assert "dcp" not in status["oldest_undrained_age_s"]
    report = c.drain()
    assert report["done"] and report["left"]["shards_failed"] == 0, report
    # The gauges: read once the refresh loop has seen step 2's commit.
    wait_for(lambda: scrape(d).get('ckptdrain_queue_shards{state="drained"}') == 2.0)
    metrics = scrape(d)
    assert metrics['ckptdrain_oldest_undrained_age_seconds{job="dcp"}'] == 0.0
    assert metrics['ckptdrain_queue_shards{state="staged"}'] == 0.0
    # The records too, in the journal a restart goes by: the deferred one discarded, not
    # "staged"; the drained one says where it went.
    journal = d.staging / "journal.sqlite3"

    def states() -> set[str]:
        with contextlib.closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as db:
            return {r[0] for r in db.execute("SELECT state FROM shards WHERE step = 1")}

    wait_for(lambda: states() == {"discarded", "drained"})
    # Overtaken, which does not page: it was counted as "superseded", which pages
    # CkptdrainGenerationFailed with a runbook saying staging was full.
    assert metrics['ckptdrain_generations_failed_total{job="dcp",reason="overtaken"}'] == 1.0
    assert metrics.get('ckptdrain_generations_failed_total{job="dcp",reason="superseded"}',
                       0.0) == 0.0
