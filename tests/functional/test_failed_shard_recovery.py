"""A crash between a shard's failure and its generation's: the restarted daemon ends the
generation (the client's `wait` says so and `retry` commits it), instead of leaving it open
for good on a shard that never drains. Found by the chaos trial CHAOS_SEED=39036 (S3, EIO
injected into reads of staged copies), which failed about half its runs."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import DrainError, GenerationFailed
from tests.conftest import DaemonProcess


def test_a_failed_shard_in_an_open_generation_fails_it_at_restart(make_daemon: Any,
                                                                   tmp_path: Path) -> None:
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the destination's parent should be")
    d: DaemonProcess = make_daemon(dest=f"file://{blocker}/dest",
                                   CKPTDRAIN_DRAIN__RETRY_BUDGET_S="1")
    with d.client() as c:
        # The shard's copy fails for good at once (no directory can be made there): on a
        # loaded machine the generation failed before the seal came, and the seal said so
        # (a fresh-clone CI run). Either way the generation fails; the restart is the point.
        with contextlib.suppress(GenerationFailed), c.generation("job", 1, rank=0,
                                                                  world_size=1) as gen:
            gen.put("w.bin", b"x" * 4096)
        with pytest.raises(GenerationFailed):
            c.wait("job", 1, timeout_s=60)
    d.stop()
    # The crash window: the shard's failure journalled, the generation's not.
    with sqlite3.connect(d.staging / "journal.sqlite3") as db:
        assert db.execute("SELECT state FROM shards WHERE job = 'job'").fetchall() == [("failed",)]
        db.execute("UPDATE generations SET state = 'open', error = '' WHERE job = 'job'")
    blocker.unlink()
    blocker.mkdir()
    d.start()
    with d.client() as c:
        with pytest.raises(GenerationFailed, match="Not a directory"):
            c.wait("job", 1, timeout_s=30)
        c.retry("job", 1)
        c.wait("job", 1, timeout_s=60)
    assert (blocker / "dest" / "job" / f"{1:020d}" / "w.bin").read_bytes() == b"x" * 4096


def test_a_generation_given_up_before_a_crash_gives_its_shards_back_at_restart(
        make_daemon: Any) -> None:
    # Found racing aborts with kill -9: giving a generation up is several journal writes (the
    # rank aborted, the generation failed, each shard discarded), and a kill between them left
    # its shards staged on a generation no retry could save, across every restart after (the
    # oldest-undrained age climbing from 5 s to 66 s over 15 restarts). Recovery discards
    # them now.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    c = d.client()
    rank = c.generation("job", 4, rank=0, world_size=1)
    rank.__enter__()
    rank.put("a.bin", b"a" * 300_000)
    rank.put("b.bin", b"b" * 200_000)
    d.kill()
    with contextlib.suppress(DrainError):
        rank.__exit__(None, None, None)  # its connection went with the daemon
    c.close()
    # The crash window: the rank aborted and the generation failed, the shards not yet.
    with sqlite3.connect(d.staging / "journal.sqlite3") as db:
        db.execute("UPDATE ranks SET state = 'aborted' WHERE job = 'job'")
        db.execute("UPDATE generations SET state = 'failed', error = 'aborted by an operator' "
                   "WHERE job = 'job'")
        assert db.execute("SELECT state FROM shards WHERE job = 'job'").fetchall() == \
            [("staged",), ("staged",)]
    d.start()
    status = d.client().status()
    assert status["staged_bytes"] == 0 and status["queued_shards"] == 0, status
    assert not status["oldest_undrained_age_s"], status
    with pytest.raises(GenerationFailed, match="cannot be retried"):
        d.client().retry("job", 4)
    assert not list((d.staging / "shards").glob("*.data"))


def test_a_failed_generation_whose_kept_copies_vanished_is_given_up_at_restart(
        make_daemon: Any, tmp_path: Path) -> None:
    # Found attacking what operators see: a failed generation's copies kept for `retry`,
    # removed from staging while the daemon was down, left its shards "failed" with no copy
    # behind them, across every restart: the job's oldest undrained shard for good (the alert
    # fired until the job committed a newer step, or for a day), `ckptdrain drain` said their
    # only copy was kept on this node for `retry`, `retry` refused ("lost the local copies")
    # and `abort` said "already failed; nothing to abort". Recovery gives it up now.
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the destination's parent should be")
    d: DaemonProcess = make_daemon(dest=f"file://{blocker}/dest",
                                   CKPTDRAIN_DRAIN__RETRY_BUDGET_S="1")
    with d.client() as c:
        with contextlib.suppress(GenerationFailed), c.generation("job", 1) as gen:
            gen.put("w.bin", b"x" * 4096)
        with pytest.raises(GenerationFailed):
            c.wait("job", 1, timeout_s=60)
    d.stop()
    for copy in (d.staging / "shards").iterdir():
        copy.unlink()
    d.start()
    with d.client() as c:
        status = c.status()
        (one,) = status["generations"]
        assert one["state"] == "failed" and "failed" not in one["shards"], one
        assert "job" not in status["oldest_undrained_age_s"]
        report = c.drain()
        assert report["done"] and report["left"]["shards_failed"] == 0, report
