"""A generation waiting on other nodes (RECORDED) always ends, and its end frees its slot.

Two daemons ("nodes") on one file:// destination, world_size 2: rank 0 on node-a, rank 1 on
node-b. Each way out is checked on node-a: another node's rank aborted (also across a restart
of node-a), a newer step committed, and drain.commit_wait_s passed.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Backpressure, GenerationFailed
from ckptdrain.client.manifest import PartRecord
from ckptdrain.daemon.tombstone import tombstone_json
from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for

JOB = "ends"
# One generation in flight, refused at once when full: a generation that never ends would
# block the job's next step for good, which is what these tests look for.
ONE_SLOT = {"CKPTDRAIN_LIMITS__MAX_GENERATIONS_IN_FLIGHT": "1", "CKPTDRAIN_LIMITS__ON_FULL": "reject"}



def seal(d: DaemonProcess, step: int, rank: int, world_size: int = 2) -> None:
    with d.client().generation(JOB, step, rank=rank, world_size=world_size) as g:
        g.put(f"rank{rank}.bin", bytes([rank]) * 1000)


def abort(d: DaemonProcess, step: int, rank: int) -> None:
    with pytest.raises(RuntimeError), d.client().generation(JOB, step, rank=rank, world_size=2) as g:
        g.put(f"rank{rank}.bin", b"x" * 1000)
        raise RuntimeError("out of GPU memory")


def state(d: DaemonProcess, step: int) -> dict[str, Any]:
    for g in d.client().status()["generations"]:
        if (g["job"], g["step"]) == (JOB, step):
            return g  # type: ignore[no-any-return]
    return {"state": "unknown"}


def recorded(d: DaemonProcess, step: int) -> None:
    wait_for(lambda: state(d, step)["state"] == "recorded", 30, what=f"step {step} recorded")


def part_record(d: DaemonProcess, step: int, node: str) -> PartRecord | None:
    path = d.dest / JOB / f"{step:020d}" / "_parts" / f"{node}.json"
    return PartRecord.from_json(path.read_bytes()) if path.exists() else None


def read_or_nothing(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:  # between retention's delete and its tombstone
        return b""


def fails_quickly(d: DaemonProcess, step: int, match: str, within_s: float = 15.0) -> None:
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match=match):
        d.client().wait(JOB, step, timeout_s=within_s)
    assert time.monotonic() - started < within_s


def next_step_commits(a: DaemonProcess, b: DaemonProcess, step: int) -> None:
    """The job carries on: with one slot, this begins only if the ended step freed it."""
    seal(a, step, 0)
    seal(b, step, 1)
    a.client().wait(JOB, step, timeout_s=30)
    b.client().wait(JOB, step, timeout_s=30)


def test_a_rank_aborted_on_another_node_ends_the_generation_here(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a", **ONE_SLOT)
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)
    recorded(a, 1)
    with pytest.raises(Backpressure):
        seal(a, 2, 0)  # the slot is held while step 1 waits for node-b
    abort(b, 1, 1)
    fails_quickly(a, 1, r"rank 1 aborted on node 'node-b': .*out of GPU memory")
    assert state(a, 1)["state"] == "failed"
    assert "rank 1 aborted on node 'node-b'" in state(a, 1)["error"]
    # Its drained copies can never be retried into a commit: they are released with it.
    wait_for(lambda: a.client().status()["kept_copy_bytes"] == 0, 30, what="node-a's copies released")
    # node-b's record says so, and keeps the layout's promise: no manifest, ever.
    record = part_record(b, 1, "node-b")
    assert record is not None and record.aborted_ranks == (1,) and record.ranks == ()
    assert not (a.dest / JOB / f"{1:020d}" / "MANIFEST.json").exists()
    next_step_commits(a, b, 2)


def test_an_abort_seen_after_a_restart_ends_the_generation(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a", **ONE_SLOT)
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)
    recorded(a, 1)
    assert a.stop() == 0
    abort(b, 1, 1)
    wait_for(lambda: (r := part_record(b, 1, "node-b")) is not None and r.aborted_ranks == (1,),
             30, what="node-b's failure record")
    a.start()
    fails_quickly(a, 1, r"rank 1 aborted on node 'node-b'")
    next_step_commits(a, b, 2)


def test_an_abort_before_this_node_records_ends_it_at_once(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a", **ONE_SLOT)
    b: DaemonProcess = make_daemon("node-b")
    abort(b, 1, 1)
    wait_for(lambda: part_record(b, 1, "node-b") is not None, 30, what="node-b's failure record")
    seal(a, 1, 0)
    fails_quickly(a, 1, r"rank 1 aborted on node 'node-b'")


def test_a_newer_step_committing_here_ends_an_older_one(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a")  # two slots: step 2 begins while step 1 waits
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)  # node-b never saves step 1 (its rank died before it began)
    recorded(a, 1)
    next_step_commits(a, b, 2)
    fails_quickly(a, 1, r"cancelled: step 2 of this job committed first")
    assert state(a, 1)["state"] == "cancelled"


def test_a_newer_step_committed_by_other_nodes_ends_an_older_one(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a", **ONE_SLOT)
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)
    recorded(a, 1)
    # A resized job commits step 2 on node-b alone; node-a learns of it from the destination.
    seal(b, 2, 0, world_size=1)
    b.client().wait(JOB, 2, timeout_s=30)
    fails_quickly(a, 1, r"cancelled: step 2 of this job committed first")
    next_step_commits(a, b, 3)


def test_commit_wait_s_ends_a_generation_whose_other_node_never_comes(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="1", **ONE_SLOT)
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)
    fails_quickly(a, 1, r"not committed within drain.commit_wait_s = 1 s.*rank\(s\) 1 have no part record")
    next_step_commits(a, b, 2)


def test_a_retry_after_the_commit_wait_waits_again(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking: `retry` of a generation that had waited out drain.commit_wait_s for a
    # slow node failed again within one poll (0.1 s), the wait counted from the old drained
    # clock, however soon the other node then came. A retry waits commit_wait_s afresh.
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="5",
                                   CKPTDRAIN_DRAIN__COMMIT_POLL_INTERVAL_S="0.1")
    seal(a, 1, 0)
    fails_quickly(a, 1, r"not committed within drain.commit_wait_s = 5 s")
    a.client().retry(JOB, 1)
    b: DaemonProcess = make_daemon("node-b")
    seal(b, 1, 1)  # the slow node, a second after the retry
    a.client().wait(JOB, 1, timeout_s=30)
    b.client().wait(JOB, 1, timeout_s=30)


def test_commit_wait_s_keeps_counting_across_a_restart(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="600", **ONE_SLOT)
    seal(a, 1, 0)
    recorded(a, 1)
    assert a.stop() == 0
    # As if node-a recorded its part 700 s ago and was down most of that time.
    db = sqlite3.connect(a.staging / "journal.sqlite3")
    db.execute("UPDATE generations SET drained_at = drained_at - 700")
    db.commit()
    db.close()
    a.start()
    fails_quickly(a, 1, r"not committed within drain.commit_wait_s = 600 s")


def test_commit_wait_s_must_be_positive(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_DRAIN__COMMIT_WAIT_S="0")
    with pytest.raises(RuntimeError, match="exited 78"):
        d.start()
    assert "drain.commit_wait_s: must be > 0" in d.log()


def test_a_job_refused_a_slot_hears_which_steps_wait_on_other_nodes_and_what_ends_them(
        make_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Found attacking: after a node was lost, the steps drained here waited for its ranks,
    # holding the job's slots for drain.commit_wait_s (an hour by default), and the restarted
    # job's begin heard "oldest undrained shard - is 0.0 s old, draining at 0.0 MB/s; retry
    # in about 1 s": nothing about why, for how long, or what to do.
    import subprocess

    from tests.conftest import CKPTDRAIN

    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="3600", **ONE_SLOT)
    seal(a, 1, 0)  # rank 1's node is gone
    recorded(a, 1)
    with pytest.raises(Backpressure) as refused:
        seal(a, 2, 0)
    message = str(refused.value)
    assert "in flight: step 1 (recorded)" in message, message
    assert "wait for other nodes' ranks" in message and "drain.commit_wait_s" in message
    assert f"`ckptdrain abort {JOB} STEP`" in message and "draining at" not in message
    assert "s more at most" in message
    # A short hint all the same: the other node is usually only slower (a job that slept an
    # hour on it stalled: found attacking the first version of this message).
    assert refused.value.retry_after_s <= 5
    # What it says to do works.
    out = subprocess.run([CKPTDRAIN, "abort", JOB, "1"], env=a.env(), capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    seal(a, 3, 0, world_size=1)
    a.client().wait(JOB, 3, timeout_s=30)


def test_an_operators_abort_of_a_step_another_node_committed_says_so(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking retention and multi-node commits: node-b had recorded its part and was
    # waiting for its next look at the destination; node-a published the step; then
    # `ckptdrain abort` on node-b said "it will never commit from this attempt" and rewrote
    # node-b's part record of the committed generation. It says the step is committed now.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b", CKPTDRAIN_DRAIN__COMMIT_POLL_INTERVAL_S="600")
    seal(b, 1, 1)
    recorded(b, 1)
    seal(a, 1, 0)
    a.client().wait(JOB, 1, timeout_s=30)
    kept = (b.dest / JOB / f"{1:020d}" / "_parts" / "node-b.json").read_bytes()
    out = subprocess.run([CKPTDRAIN, "abort", JOB, "1", "--reason", "operator"], env=b.env(),
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1 and "is committed at the destination" in out.stderr, out.stderr
    assert (b.dest / JOB / f"{1:020d}" / "_parts" / "node-b.json").read_bytes() == kept
    assert b.client().wait(JOB, 1, timeout_s=30)["committed"] is True


@pytest.mark.parametrize("keep_last", ["3", "1"], ids=["kept", "removed-by-retention"])
def test_a_step_another_node_committed_is_committed_here_though_a_newer_one_followed(
        make_daemon, keep_last) -> None:  # type: ignore[no-untyped-def]
    # node-a recorded its part of step 1 and waited for its next look at the destination
    # (frozen here, as a busy or paused node is); node-b published step 1 from both records,
    # then step 2 on its own (and, with keep_last = 1, its retention removed step 1). node-a
    # saw step 2 committed and cancelled step 1 as "step 2 of this job committed first": its
    # waiters heard that their committed step had failed. It looks at its own step first.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b", CKPTDRAIN_RETENTION__KEEP_LAST=keep_last)
    seal(a, 1, 0)
    recorded(a, 1)
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    try:
        seal(b, 1, 1)
        b.client().wait(JOB, 1, timeout_s=30)
        seal(b, 2, 0, world_size=1)
        b.client().wait(JOB, 2, timeout_s=30)
        manifest = b.dest / JOB / f"{1:020d}" / "MANIFEST.json"
        if keep_last == "1":
            wait_for(lambda: b'"was_committed": true' in read_or_nothing(manifest), 30,
                     what="step 1 removed by retention, its tombstone left")
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert a.client().wait(JOB, 1, timeout_s=15)["committed"] is True
    assert state(a, 1)["state"] == "committed"
    assert "generation_cancelled" not in a.log(), a.log()


def test_a_node_restarted_after_newer_steps_committed_keeps_its_committed_step(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the fix above: node-a, killed after recording its part of step 1, came
    # back after node-b had published step 1 (with node-a's shard) and steps 2 to 4 on its
    # own, and before node-b's retention removed step 1. Its restart went to publish, where
    # "keep_last newer steps committed while it was saved" cancelled the committed step.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)
    recorded(a, 1)
    a.kill()
    seal(b, 1, 1)
    b.client().wait(JOB, 1, timeout_s=30)
    assert b.stop() == 0  # before its retention would remove step 1
    b.start()
    for step in (2, 3, 4):  # keep_last = 3 newer steps, committed by node-b alone
        seal(b, step, 0, world_size=1)
    b.client().wait(JOB, 4, timeout_s=30)
    assert b.proc is not None
    b.proc.send_signal(signal.SIGSTOP)  # its next retention run has not come yet
    try:
        assert (b.dest / JOB / f"{1:020d}" / "MANIFEST.json").exists()
        a.start()
        assert a.client().wait(JOB, 1, timeout_s=15)["committed"] is True
        assert state(a, 1)["state"] == "committed"
    finally:
        b.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize(("saved", "keep_last"),
                         [(True, "3"), (False, "3"), (True, "1"), (False, "1"), (True, "old")],
                         ids=["other-bytes", "no-shard", "other-bytes-removed",
                              "no-shard-removed", "removed-by-an-older-version"])
def test_another_attempts_commit_of_the_step_is_not_this_nodes(make_daemon, saved,  # type: ignore[no-untyped-def]
                                                               keep_last) -> None:
    # The other side of the tests above: a commit of step 1 by another attempt (run-2, a
    # resized job on node-b alone) is no commit of node-a's run-1. Found attacking the first
    # fix: where node-a's rank saved no shard, or retention had replaced the manifest by a
    # tombstone, node-a heard its step committed. The manifest must name node-a and the
    # world size; the tombstone now says both of the manifest.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b", CKPTDRAIN_RETENTION__KEEP_LAST=keep_last
                                   if keep_last != "old" else "3")
    with a.client().generation(JOB, 1, rank=0, world_size=2, attempt="run-1") as g:
        if saved:
            g.put("rank0.bin", b"a" * 1000)
    recorded(a, 1)
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    try:
        for step in (1, 2):
            with b.client().generation(JOB, step, rank=0, world_size=1, attempt="run-2") as g:
                g.put("rank0.bin", b"b" * 1000)
            b.client().wait(JOB, step, timeout_s=30)
        manifest = b.dest / JOB / f"{1:020d}" / "MANIFEST.json"
        if keep_last == "1":
            wait_for(lambda: b'"was_committed": true' in read_or_nothing(manifest), 30,
                     what="step 1 removed by retention, its tombstone left")
            tombstone = json.loads(manifest.read_bytes())
            assert tombstone["world_size"] == 1 and tombstone["nodes"] == ["node-b"]
        if keep_last == "old":
            # Found attacking a rolling upgrade: an older version's retention leaves a
            # tombstone that names neither world size nor nodes, and it was taken as node-a's.
            manifest.write_bytes(tombstone_json(JOB, 1, "old-node", time.time(),
                                                was_committed=True))
    finally:
        a.proc.send_signal(signal.SIGCONT)
    fails_quickly(a, 1, r"cancelled: step 2 of this job committed first")


def test_an_operators_abort_of_a_step_committed_and_since_removed_says_so(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking: after retention replaced step 1's manifest by its tombstone, `abort`
    # on node-a (which had not looked yet) said "it will never commit" of a step committed
    # with node-a's shard, and node-a's waiters heard "aborted by an operator".
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_POLL_INTERVAL_S="600")
    b: DaemonProcess = make_daemon("node-b", CKPTDRAIN_RETENTION__KEEP_LAST="1")
    seal(a, 1, 0)
    recorded(a, 1)
    seal(b, 1, 1)
    b.client().wait(JOB, 1, timeout_s=30)
    seal(b, 2, 0, world_size=1)
    b.client().wait(JOB, 2, timeout_s=30)
    manifest = b.dest / JOB / f"{1:020d}" / "MANIFEST.json"
    wait_for(lambda: b'"was_committed": true' in read_or_nothing(manifest), 30,
             what="step 1 removed by retention, its tombstone left")
    out = subprocess.run([CKPTDRAIN, "abort", JOB, "1"], env=a.env(), capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 1 and "is committed at the destination" in out.stderr, out.stderr
    assert a.client().wait(JOB, 1, timeout_s=30)["committed"] is True


def test_a_step_whose_manifest_key_never_reads_still_ends_at_commit_wait_s(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking multi-node commits: with a newer step committed, node-a asks whether its
    # own step committed first; a MANIFEST.json it can never read (a link here; an object
    # too large on S3) left the question open at every poll, and the poll returned before
    # drain.commit_wait_s was looked at: the generation, and its slot, were held for good.
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="3", **ONE_SLOT)
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)
    recorded(a, 1)
    key = a.dest / JOB / f"{1:020d}" / "MANIFEST.json"
    key.symlink_to("/etc/hostname")
    seal(b, 2, 0, world_size=1)
    b.client().wait(JOB, 2, timeout_s=30)
    fails_quickly(a, 1, r"not committed within drain.commit_wait_s = 3 s")
    key.unlink()
    next_step_commits(a, b, 3)


def test_retention_of_a_step_whose_manifest_was_damaged_says_nothing_was_committed(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking multi-node commits: retention removed a step whose MANIFEST.json held
    # no manifest (damaged) as a committed one, and its tombstone said "was committed" and
    # nothing more, as older tombstones do: node-a, which had recorded its part of it, heard
    # its step committed. Only a key that held the step's manifest makes such a tombstone.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b", CKPTDRAIN_RETENTION__KEEP_LAST="1")
    seal(a, 1, 0)  # rank 1 never saves step 1
    recorded(a, 1)
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    try:
        key = a.dest / JOB / f"{1:020d}" / "MANIFEST.json"
        key.write_bytes(b"not a manifest")
        for step in (2, 3):
            seal(b, step, 0, world_size=1)
            b.client().wait(JOB, step, timeout_s=30)
        wait_for(lambda: b'"kind": "abandoned"' in read_or_nothing(key), 30,
                 what="step 1 removed by retention, its tombstone left")
        assert b"was_committed" not in key.read_bytes()
    finally:
        a.proc.send_signal(signal.SIGCONT)
    fails_quickly(a, 1, r"cancelled: step 3 of this job committed first")


def test_two_daemons_with_one_node_id_end_the_step_at_once_saying_so(make_daemon, tmp_path,  # type: ignore[no-untyped-def]
                                                                     short_tmp) -> None:
    # Found attacking multi-node commits: two daemons running as node-a (containers sharing
    # their host's name) rewrote each other's _parts/node-a.json, so no record ever covered
    # both one's ranks and the other's. Every node waited out drain.commit_wait_s (an hour by
    # default) and then said that the ranks of the overwritten twin had "no part record (is
    # their node down?)", that twin included. The daemon whose record is gone sees it at its
    # next look and aborts its ranks; its failure record ends the step everywhere.
    a: DaemonProcess = make_daemon("node-a")
    (tmp_path / "twin").mkdir()
    twin = DaemonProcess(root=tmp_path / "twin", socket_path=short_tmp / "twin.sock",
                         node_id="node-a", dest_uri=a.dest_uri).start()
    b: DaemonProcess = make_daemon("node-b")
    try:
        seal(a, 1, 0, world_size=3)
        seal(twin, 1, 1, world_size=3)
        seal(b, 1, 2, world_size=3)
        for d in (a, twin, b):
            fails_quickly(d, 1, r"another daemon runs with node_id 'node-a'")
        assert not (a.dest / JOB / f"{1:020d}" / "MANIFEST.json").exists()
    finally:
        twin.stop(timeout_s=20)


def test_commit_wait_s_names_ranks_saved_under_another_attempt(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking multi-node commits: torchrun counts restarts per node, so the ranks of
    # one run saved step 1 as attempts ...:0 and ...:1. Each node waited out
    # drain.commit_wait_s for the other's record of its own attempt and then asked "is their
    # node down?" of a node that was up and had saved its rank.
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__COMMIT_WAIT_S="2")
    b: DaemonProcess = make_daemon("node-b")
    for d, rank in ((a, 0), (b, 1)):  # rank 2's node never saves
        with d.client().generation(JOB, 1, rank=rank, world_size=3,
                                   attempt=f"torchelastic:job7:{rank}") as g:
            g.put(f"rank{rank}.bin", bytes([rank]) * 1000)
    fails_quickly(a, 1, r"rank\(s\) 2 have no part record \(is their node down\?\); node "
                        r"'node-b' saved rank\(s\) 1 as attempt 'torchelastic:job7:1', not as "
                        r"this node's attempt: .*agreed_attempt")
