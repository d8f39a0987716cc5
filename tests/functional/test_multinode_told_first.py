"""No node commits a multi-node step whose ranks on another node were told it failed.

Two daemons ("nodes") on one file:// destination, world_size 2: rank 0 on node-a, rank 1 on
node-b. node-a records its part first; each test ends the step on node-a while node-b has
not come yet, and checks that node-a's part record says its rank aborted by the time node-a
answers, so node-b, coming later, ends the step rather than publish it from node-a's record.
strace slows (or fails) node-a's renames, its part record writes: the window the end must
not leave open, made wide enough to see.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest

from ckptdrain.client import GenerationFailed
from ckptdrain.client.manifest import PartRecord
from tests.conftest import CKPTDRAIN, DaemonProcess, strace_attached, wait_for
from tests.functional.test_commit_ends import JOB, part_record, recorded, seal, state

# Every part record write (posix backend: a temp file renamed over the key) waits this long.
SLOW_RENAMES = ("-e", "trace=rename,renameat,renameat2",
                "-e", "inject=rename,renameat,renameat2:delay_enter=3000000")


def manifest_exists(d: DaemonProcess, step: int) -> bool:
    return (d.dest / JOB / f"{step:020d}" / "MANIFEST.json").exists()


def test_an_operators_abort_of_a_recorded_step_rewrites_the_record_before_it_answers(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found reviewing multi-node commits: `ckptdrain abort` of a step node-a had recorded
    # aborted its ranks and answered (its waiters heard "failed") first, and queued the
    # failure record after; node-b, sealing meanwhile, read node-a's record still saying
    # "recorded" and published the step.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b")
    seal(a, 1, 0)
    recorded(a, 1)
    with strace_attached(a.pid, *SLOW_RENAMES):
        out = subprocess.run([CKPTDRAIN, "abort", JOB, "1", "--reason", "bad node"],
                             env=a.env(), capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 0, out.stderr
        mine = part_record(a, 1, "node-a")
        assert mine is not None and (mine.ranks, mine.aborted_ranks) == ((), (0,)), mine
        assert "bad node" in mine.abort_reason
        with pytest.raises(GenerationFailed, match="aborted by an operator"):
            a.client().wait(JOB, 1, timeout_s=5)
        seal(b, 1, 1)
        with pytest.raises(GenerationFailed, match="rank 0 aborted on node 'node-a'"):
            b.client().wait(JOB, 1, timeout_s=30)
    assert not manifest_exists(a, 1)
    assert state(a, 1)["state"] == "failed"


# Every part record write fails (EIO, retried for drain.retry_budget_s, then given up).
FAILED_RENAMES = ("-e", "trace=rename,renameat,renameat2",
                  "-e", "inject=rename,renameat,renameat2:error=EIO")


def recorded_on_node_a(make_daemon: Any, *, retry_budget_s: str,
                       backoff: bool = True) -> DaemonProcess:
    """node-a, its commit wait 2 s, its rank 0 of step 1 sealed and recorded; ``backoff``:
    destination retries 0.2 s, at most 0.5 s apart (a retry lands soon after a fault ends)."""
    env = {"CKPTDRAIN_DRAIN__COMMIT_WAIT_S": "2", "CKPTDRAIN_DRAIN__RETRY_BUDGET_S": retry_budget_s}
    if backoff:
        env |= {"CKPTDRAIN_DRAIN__RETRY_INITIAL_BACKOFF_S": "0.2",
                "CKPTDRAIN_DRAIN__RETRY_MAX_BACKOFF_S": "0.5"}
    a: DaemonProcess = make_daemon("node-a", **env)
    seal(a, 1, 0)
    recorded(a, 1)
    return a


def expired_with_its_failure_record_owed(make_daemon: Any) -> DaemonProcess:
    """node-a, its rank 0 of step 1 recorded, its commit wait run out while every part record
    write failed: its failure record given up twice (before the end, write_told, and the one
    queued after it), so still owed, and its record still saying "recorded"."""
    a = recorded_on_node_a(make_daemon, retry_budget_s="0.5", backoff=False)
    with strace_attached(a.pid, *FAILED_RENAMES):
        with pytest.raises(GenerationFailed, match=r"drain\.commit_wait_s"):
            a.client().wait(JOB, 1, timeout_s=30)
        wait_for(lambda: a.log().count('event=failure_record_failed') >= 2, 30,
                 what="node-a gave up writing its failure record twice")
    return a


def test_a_failure_record_not_written_before_a_kill_is_written_at_the_restart(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found reviewing multi-node commits: node-a's commit wait ran out and its ranks heard
    # the step failed, but its failure record (every rank aborted) could not be written then,
    # and was still owed when node-a was killed. The restart's resend wrote only the ranks
    # not recorded (none), so node-a's record kept saying "recorded", and node-b, coming
    # later, published the step from it.
    a = expired_with_its_failure_record_owed(make_daemon)
    mine = part_record(a, 1, "node-a")
    assert mine is not None and mine.ranks == (0,), mine  # as the expiry left it
    a.kill()
    a.start()
    wait_for(lambda: (part_record(a, 1, "node-a") or mine).aborted_ranks == (0,), 15,
             what="node-a's restart wrote its failure record, every rank aborted")
    b: DaemonProcess = make_daemon("node-b")
    seal(b, 1, 1)
    with pytest.raises(GenerationFailed, match="rank 0 aborted on node 'node-a'"):
        b.client().wait(JOB, 1, timeout_s=30)
    assert not manifest_exists(a, 1)


def test_a_failure_record_owed_at_a_restart_is_not_written_into_a_step_committed_meanwhile(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking multi-node ends: node-a's commit wait ran out while its part record
    # writes failed, and it was killed with its failure record owed; node-b then sealed and
    # committed the step from node-a's record, which still said "recorded". node-a's restart
    # rewrote that record, every rank aborted, inside the committed step (nothing may
    # overwrite what is committed), and its status kept saying "failed" for a step whose
    # MANIFEST.json held its part. It now asks the destination first: committed with its part,
    # the record is left as it is and the step is committed on node-a too.
    a = expired_with_its_failure_record_owed(make_daemon)
    a.kill()
    b: DaemonProcess = make_daemon("node-b")
    seal(b, 1, 1)
    assert b.client().wait(JOB, 1, timeout_s=30)["committed"]
    before = part_record(a, 1, "node-a")
    assert before is not None and (before.ranks, before.aborted_ranks) == ((0,), ()), before
    a.start()
    wait_for(lambda: state(a, 1)["state"] == "committed" or "event=failure_recorded" in a.log(),
             15, what="node-a's restart settled its owed failure record")
    assert "event=failure_recorded" not in a.log()
    assert part_record(a, 1, "node-a") == before  # the committed step's record, untouched
    assert (state(a, 1)["state"], state(a, 1)["error"]) == ("committed", "")
    assert a.client().wait(JOB, 1, timeout_s=5)["committed"]
    assert manifest_exists(a, 1)
    a.kill()
    a.start()  # journalled so: committed across a restart, nothing owed any more
    assert (state(a, 1)["state"], state(a, 1)["error"]) == ("committed", "")


def test_a_failure_record_retried_at_run_time_is_not_written_into_a_step_committed_meanwhile(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking multi-node ends: node-a's commit wait ran out while its part record
    # writes failed (EIO), so its failure record was queued after the end and retried for
    # drain.retry_budget_s. node-b sealed and committed the step meanwhile, from node-a's
    # record still saying "recorded"; once the destination took writes again, a retry rewrote
    # that record, every rank aborted, inside the committed step, and node-a's status kept
    # saying "failed". The queued write now looks for the commit before each try, as the
    # restart's resend does: nothing is written, and the step is committed on node-a too.
    a = recorded_on_node_a(make_daemon, retry_budget_s="15")
    with strace_attached(a.pid, *FAILED_RENAMES):
        with pytest.raises(GenerationFailed, match=r"drain\.commit_wait_s"):
            a.client().wait(JOB, 1, timeout_s=60)
        # Given up before the end (write_told); the one queued after it retries for 15 s
        # (room for node-b to start and commit on a loaded machine: 10 s was too little once).
        assert a.log().count("event=failure_record_failed") == 1
        b: DaemonProcess = make_daemon("node-b")
        seal(b, 1, 1)
        assert b.client().wait(JOB, 1, timeout_s=30)["committed"]
        before = part_record(a, 1, "node-a")
        assert before is not None and (before.ranks, before.aborted_ranks) == ((0,), ()), before
        assert a.log().count("event=failure_record_failed") == 1, "the queued write gave up"
    # The destination takes writes again: the queued write's next try lands, unless it looks.
    wait_for(lambda: state(a, 1)["state"] == "committed" or "event=failure_recorded" in a.log(),
             20, what="node-a's queued failure record settled")
    assert "event=failure_recorded" not in a.log()
    assert "event=failure_record_not_sent" in a.log()
    assert part_record(a, 1, "node-a") == before  # the committed step's record, untouched
    assert (state(a, 1)["state"], state(a, 1)["error"]) == ("committed", "")
    assert a.client().wait(JOB, 1, timeout_s=5)["committed"]


def test_a_step_committed_while_the_failure_record_is_refused_ends_committed(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking multi-node ends: node-a's commit wait ran out and its failure record's
    # write retried against a destination refusing it (EIO); node-b committed the step
    # meanwhile from node-a's record saying "recorded". Once the write gave up, node-a ended
    # the step failed without looking again (it looked only after a record it wrote): an
    # error logged and a failure counted for a step whose MANIFEST.json held its part, its
    # status "failed" until the failure record queued after the end found the commit.
    a = recorded_on_node_a(make_daemon, retry_budget_s="8")
    with strace_attached(a.pid, *FAILED_RENAMES):
        wait_for(lambda: "event=destination_error" in a.log(), 30,
                 what="node-a's commit wait ran out and its failure record's write retries")
        b: DaemonProcess = make_daemon("node-b")
        seal(b, 1, 1)
        assert b.client().wait(JOB, 1, timeout_s=30)["committed"]
        assert "event=failure_record_failed" not in a.log(), "the write gave up before"
        assert a.client().wait(JOB, 1, timeout_s=30)["committed"]
        assert (state(a, 1)["state"], state(a, 1)["error"]) == ("committed", "")
    assert "event=generation_failed" not in a.log()


def test_a_failure_record_retried_after_an_abort_is_not_written_into_a_step_committed_meanwhile(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The same, after an operator's abort that gave its record 10 s: its failure record
    # (rank 0 aborted), queued after the abort, landed inside the step node-b had committed
    # meanwhile. Not written now; node-a's step stays as the abort left it.
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_DRAIN__RETRY_BUDGET_S="20",
                                   CKPTDRAIN_DRAIN__RETRY_INITIAL_BACKOFF_S="0.2",
                                   CKPTDRAIN_DRAIN__RETRY_MAX_BACKOFF_S="0.5")
    seal(a, 1, 0)
    recorded(a, 1)
    with strace_attached(a.pid, *FAILED_RENAMES):
        out = subprocess.run([CKPTDRAIN, "abort", JOB, "1"], env=a.env(), capture_output=True,
                             text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert "not written within" in a.log()
        b: DaemonProcess = make_daemon("node-b")
        seal(b, 1, 1)
        assert b.client().wait(JOB, 1, timeout_s=30)["committed"]
        before = part_record(a, 1, "node-a")
        assert before is not None and (before.ranks, before.aborted_ranks) == ((0,), ()), before
        # The abort's "not written within 10 s" only: the queued write still retries.
        assert a.log().count("event=failure_record_failed") == 1, "the queued write gave up"
    wait_for(lambda: "event=failure_record_not_sent" in a.log()
             or "event=failure_recorded" in a.log(), 20,
             what="node-a's queued failure record settled")
    assert "event=failure_recorded" not in a.log()
    assert part_record(a, 1, "node-a") == before  # the committed step's record, untouched
    assert state(a, 1)["state"] == "failed"  # as the abort left it


def test_an_abort_on_a_destination_refusing_the_record_still_answers(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the record-first abort above: its failure record's write retried for
    # drain.retry_budget_s (300 s by default) before the abort answered, and `ckptdrain abort`
    # gave up after 30 s on a destination that refused writes. The record gets a bounded
    # while; past it the abort goes ahead, the record written after it (as before).
    a: DaemonProcess = make_daemon("node-a")
    seal(a, 1, 0)
    recorded(a, 1)
    with strace_attached(a.pid, *FAILED_RENAMES):
        started = time.monotonic()
        out = subprocess.run([CKPTDRAIN, "abort", JOB, "1"], env=a.env(), capture_output=True,
                             text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert time.monotonic() - started < 25
        with pytest.raises(GenerationFailed, match="aborted by an operator"):
            a.client().wait(JOB, 1, timeout_s=5)
    assert "not written within" in a.log()


def test_an_abort_while_the_part_record_is_being_written_rewrites_it_before_it_answers(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the record-first abort: node-a's ranks had sealed and drained and its
    # advance was writing the part record (ranks=(0,)) when `ckptdrain abort` came. The rank
    # was still SEALED in the ledger (RECORDED is applied once the write is in), so the abort
    # took the plain path: it answered and its waiters heard "failed" while the record saying
    # "recorded" landed, and the failure record came only after it. node-b, sealing
    # meanwhile, read node-a's record saying "recorded" and published the step.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b")
    parts = a.dest / JOB / f"{1:020d}" / "_parts"
    with strace_attached(a.pid, *SLOW_RENAMES):
        seal(a, 1, 0)
        wait_for(lambda: parts.is_dir() and any(p.name.startswith(".node-a.json")
                                                for p in parts.iterdir()), 30,
                 what="node-a writing its part record")
        out = subprocess.run([CKPTDRAIN, "abort", JOB, "1", "--reason", "bad node"],
                             env=a.env(), capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 0, out.stderr
        mine = part_record(a, 1, "node-a")
        assert mine is not None and (mine.ranks, mine.aborted_ranks) == ((), (0,)), mine
        with pytest.raises(GenerationFailed, match="aborted by an operator"):
            a.client().wait(JOB, 1, timeout_s=5)
        seal(b, 1, 1)
        with pytest.raises(GenerationFailed, match="rank 0 aborted on node 'node-a'"):
            b.client().wait(JOB, 1, timeout_s=30)
    assert not manifest_exists(a, 1)


# Every create-once write (posix backend: link() of a temp file to its key) fails with EIO.
FAILED_LINKS = ("-e", "trace=link,linkat", "-e", "inject=link,linkat:error=EIO")


def test_an_abort_during_a_create_the_destination_refuses_still_answers(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the record-first abort: node-a held its generation's commit point
    # across every retry of its manifest create (drain.retry_budget_s, 300 s by default), so
    # `ckptdrain abort`, which waits for the commit point, said "did not finish
    # 'abort_generation' within 30 s" on a destination refusing the create, and the step
    # committed once the destination took it. The commit point is held for one try at a time.
    a: DaemonProcess = make_daemon("node-a")
    seal(a, 1, 0)
    recorded(a, 1)
    mine = part_record(a, 1, "node-a")
    assert mine is not None
    # node-b's record of rank 1 (no shards), so that node-a's next poll publishes.
    other = PartRecord(JOB, 1, 2, "node-b", (1,), (), dict(mine.clocks), attempt=mine.attempt,
                       owner_uid=mine.owner_uid)
    parts = a.dest / JOB / f"{1:020d}" / "_parts"
    with strace_attached(a.pid, *FAILED_LINKS):
        (parts / ".node-b.json.tmp").write_bytes(other.to_json())
        (parts / ".node-b.json.tmp").rename(parts / "node-b.json")
        wait_for(lambda: "MANIFEST.json at" in a.log(), 30,
                 what="node-a's manifest create refused")
        started = time.monotonic()
        out = subprocess.run([CKPTDRAIN, "abort", JOB, "1"], env=a.env(), capture_output=True,
                             text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert time.monotonic() - started < 25
        with pytest.raises(GenerationFailed, match="aborted by an operator"):
            a.client().wait(JOB, 1, timeout_s=5)
    assert not manifest_exists(a, 1)
    assert state(a, 1)["state"] == "failed"


def test_supersede_passes_over_a_step_whose_part_record_is_being_written(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the record-first abort's window: under on_full = "supersede", a begin
    # short of a generation slot cancelled the oldest OPEN step of the job, which was node-a's
    # step 1 while its part record (ranks=(0,), every shard drained) was being written. Its
    # waiter heard "cancelled: superseded by step 3", the record landed saying "recorded", and
    # node-b committed step 1 from it with node-a's part. A step that drained everything here
    # is passed over, as a recorded one is.
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_LIMITS__ON_FULL="supersede",
                                   CKPTDRAIN_LIMITS__MAX_GENERATIONS_IN_FLIGHT="2",
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="2")
    b: DaemonProcess = make_daemon("node-b")
    parts = a.dest / JOB / f"{1:020d}" / "_parts"
    parts.mkdir(parents=True)
    # Only the renames in step 1's _parts (its part record) wait; the staging's go on.
    with strace_attached(a.pid, "-P", str(parts), *SLOW_RENAMES):
        c = a.client()
        with c.generation(JOB, 1, rank=0, world_size=2) as g:
            g.put("rank0.bin", b"z")  # one byte: drains at once even at 2 B/s
        wait_for(lambda: any(p.name.startswith(".node-a.json") for p in parts.iterdir()), 30,
                 what="node-a writing its part record")
        with c.generation(JOB, 2, rank=0, world_size=1) as g:
            g.put("w", b"y" * 1000)  # stays undrained at 2 B/s: a step to supersede
        with c.generation(JOB, 3, rank=0, world_size=1) as g:  # the slots are full
            g.put("w", b"x")
        assert state(a, 1)["state"] in ("open", "recorded"), state(a, 1)
        assert state(a, 2)["state"] == "cancelled"
    seal(b, 1, 1)
    assert b.client().wait(JOB, 1, timeout_s=30)["committed"]
    assert a.client().wait(JOB, 1, timeout_s=30)["committed"]
