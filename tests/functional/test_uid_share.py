"""limits.max_reserved_bytes_per_uid: what one uid's shards may hold on this node until they
drain, and nothing more, in whatever order its hand-offs, drains and restarts come.

Each case was found attacking the per-uid limit: a kept local copy counted against the share
for good; puts queued behind a full budget passed the check together and took three times it;
and a restart forgot what its recovered shards held.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Backpressure, Client, DrainError, GenerationFailed, RejectedInput, wire
from tests.conftest import DaemonProcess, wait_for
from tests.functional.otheruser import answer, start_as
from tests.functional.test_bad_input import RawClient, frame

MiB = 1 << 20
OTHER_UID = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs a client as another uid (root)")


def ended(child: tuple[int, int]) -> bool:
    """Whether a child of start_as has exited (not reaped: answer() does that)."""
    with open(f"/proc/{child[0]}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "Z"


def shared_node(make_daemon: Any, **limits: str) -> DaemonProcess:
    """A daemon that OTHER_UID may use too (a node two users share), with ``limits``."""
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}]", **limits)
    os.chmod(d.socket_path.parent, 0o755)
    return d


def other_user_saves(d: DaemonProcess, data: bytes) -> str:
    """OTHER_UID saves ``data`` as job "victim" step 1: "SAVED", or what it was told."""
    def save() -> str:
        with Client(d.socket_path, timeout_s=30).generation("victim", 1) as gen:
            gen.put("w", data)
        return "SAVED"

    return answer(start_as(OTHER_UID, save))


def test_a_kept_local_copy_is_not_held_against_its_uids_share(make_daemon: Any) -> None:
    # A checkpoint over half the share: its drained copy, kept for a fast restore
    # (keep_local_copy), refused every later save of the job until a restart.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="256MiB",
                                   CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="128MiB")
    c = d.client(timeout_s=60)
    data = os.urandom(80 * MiB)
    for step in (1, 2, 3):
        with c.generation("big", step) as gen:
            gen.put("model.pt", data)
        c.wait("big", step, timeout_s=120)
    assert c.status()["kept_copy_bytes"] > 0  # kept: inside max_staged_bytes, not the share


def test_a_restart_holds_recovered_shards_against_their_uids_share(make_daemon: Any) -> None:
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="40MiB",
                                   CKPTDRAIN_LIMITS__ON_FULL="reject",  # refused, not waiting
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    c = d.client(timeout_s=30)
    with c.generation("j", 1) as gen:
        gen.put("a", os.urandom(30 * MiB))  # staged, not drained (the drain is held)
    with pytest.raises(Backpressure), c.generation("j", 2) as gen:
        gen.put("a", os.urandom(30 * MiB))
    d.kill()
    d.start()
    c = d.client(timeout_s=30)
    with pytest.raises(Backpressure) as info, c.generation("j", 3) as gen:
        gen.put("a", os.urandom(30 * MiB))
    assert info.value.details["limit"] == "max_reserved_bytes_per_uid"
    assert info.value.details["current"] == 30 * MiB


@needs_root
def test_puts_queued_for_room_take_no_more_than_the_uids_share(make_daemon: Any) -> None:
    d = shared_node(make_daemon, CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="100MiB",
                    CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="60MiB",
                    # The third waits this long for its share (its own shards never drain).
                    CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="8",
                    CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    c = d.client(timeout_s=60)
    filler = c.generation("filler", 1, world_size=2)
    filler.__enter__()
    filler.put("x", os.urandom(50 * MiB), deferred=True)  # root's: held until aborted

    def put(job: int) -> str:
        try:
            with Client(d.socket_path, timeout_s=90).generation(f"theirs-{job}", 1) as gen:
                gen.put("shard", os.urandom(30 * MiB))
        except Backpressure as exc:
            return f"REFUSED {exc.details['limit']}"
        return "OK"

    # The first fits at once; the second waits for max_staged_bytes, and so would the third
    # if the second's bytes did not count against the share until it was let in.
    children = []
    for j, then in enumerate((lambda: c.status()["staged_bytes"] == 80 * MiB,
                              lambda: c.status()["blocked_handoffs"] == 1,
                              lambda: c.status()["blocked_handoffs"] == 2 or ended(children[2]))):
        children.append(start_as(OTHER_UID, lambda j=j: put(j)))  # type: ignore[misc]
        wait_for(then, timeout_s=30)
    filler.abort("making room")
    filler.__exit__(None, None, None)
    answers = sorted(answer(child) for child in children)
    assert answers.count("OK") * 30 * MiB <= 60 * MiB, answers
    assert answers == ["OK", "OK", "REFUSED max_reserved_bytes_per_uid"], answers


def test_a_failed_generations_copies_kept_for_retry_hold_the_share_until_retried(
    make_daemon: Any, tmp_path: Path
) -> None:
    # Step 1 failed while the destination was unmounted; its copies, kept for `retry`, hold
    # 60 of the uid's 100 MiB until it is retried (or aborted, or forgotten). Found attacking
    # the share: left out of it (so that they would not refuse the job's later saves), such
    # copies let one user fill the node through failed generations (see the next test); a
    # save they refuse now says what holds the room and how to free it.
    mount = tmp_path / "mnt"
    # keep_last 4: step 1, retried after 2 committed, is kept (retention would otherwise
    # refuse the retry: it would remove it as soon as it committed).
    d: DaemonProcess = make_daemon(dest=f"file://{mount}/dest",
                                   CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="100MiB",
                                   CKPTDRAIN_DRAIN__RETRY_BUDGET_S="0.5",
                                   CKPTDRAIN_RETENTION__KEEP_LAST="4")
    c = d.client(timeout_s=60)
    with c.generation("j", 1) as gen:
        gen.put("a", os.urandom(60 * MiB))
    with pytest.raises(GenerationFailed):
        c.wait("j", 1, timeout_s=60)
    mount.mkdir()
    d.kill()  # a restart charges them again, once
    d.start()
    c = d.client(timeout_s=60)
    with c.generation("j", 2) as gen:
        gen.put("a", os.urandom(30 * MiB))  # 60 + 30 of 100: fits (counted twice, it would not)
    c.wait("j", 2, timeout_s=120)
    with pytest.raises(Backpressure) as info, c.generation("j", 3) as gen:
        gen.put("a", os.urandom(60 * MiB))
    assert info.value.details["limit"] == "max_reserved_bytes_per_uid"
    assert info.value.details["current"] == 60 * MiB
    assert info.value.details["held_for_retry"] == 60 * MiB
    message = str(info.value)
    assert "step 1 of job 'j'" in message, message
    assert "ckptdrain retry" in message and "ckptdrain abort" in message, message
    c.retry("j", 1)  # the kept copy drains, and gives the share back
    c.wait("j", 1, timeout_s=120)
    with c.generation("j", 4) as gen:  # (step 3 failed with its refused hand-off)
        gen.put("a", os.urandom(60 * MiB))
    c.wait("j", 4, timeout_s=120)


@needs_root
@pytest.mark.parametrize("share", ["bytes", "shards"])
def test_failed_generations_kept_for_retry_hold_no_more_than_the_uids_share(
    make_daemon: Any, tmp_path: Path, share: str
) -> None:
    # Found attacking: copies of failed generations kept for `retry` were left out of their
    # uid's share, but stayed in max_staged_bytes and max_queued_shards, and no eviction
    # touches them. One user failing its own saves again and again (a drain that fails for
    # good) filled the node's staging and shard queue, and every other user was refused.
    limits = ({"CKPTDRAIN_LIMITS__MAX_STAGED_BYTES": "64MiB",
               "CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID": "24MiB"} if share == "bytes" else
              {"CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS": "12",
               "CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS_PER_UID": "4"})
    d = shared_node(make_daemon, dest=f"file://{tmp_path}/unmounted/dest",  # every drain fails
                    CKPTDRAIN_DRAIN__RETRY_BUDGET_S="0.5",
                    CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="5", **limits)
    c = d.client(timeout_s=60)
    failed = 0
    with pytest.raises(Backpressure) as info:
        for step in range(1, 9):
            with c.generation("failing", step) as gen:
                if share == "bytes":
                    gen.put("w", os.urandom(8 * MiB))
                else:
                    gen.put("a", b"a")
                    gen.put("b", b"b")
            with pytest.raises(GenerationFailed):
                c.wait("failing", step, timeout_s=60)
            failed += 1
    assert failed == (3 if share == "bytes" else 2)  # the share, and no more
    limit = "max_reserved_bytes_per_uid" if share == "bytes" else "max_queued_shards_per_uid"
    assert info.value.details["limit"] == limit
    assert "failed generations" in str(info.value), str(info.value)

    assert other_user_saves(d, os.urandom(16 * MiB) if share == "bytes" else b"x") == "SAVED"
    c.abort_generation("failing", 1)  # what frees the share (as retry would)
    with c.generation("failing", 10) as gen:
        gen.put("w", os.urandom(8 * MiB) if share == "bytes" else b"w")


def test_a_memory_handoff_is_charged_once_while_it_is_written(
    make_daemon: Any, small_tmpfs: Path
) -> None:
    # Found attacking the share: the RAM and then the staged room were both charged while an
    # acknowledged memfd waited for disk room and was written: 25 MiB counted as 50.
    d: DaemonProcess = make_daemon(CKPTDRAIN_STAGING_DIR=str(small_tmpfs / "staging"),
                                   CKPTDRAIN_ACK="memory",
                                   CKPTDRAIN_LIMITS__MAX_MEMORY_BYTES="256MiB",
                                   CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="40MiB",
                                   CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="60")
    c = d.client(timeout_s=60)
    other = small_tmpfs / "someone-else"
    other.write_bytes(os.urandom(45 * MiB))  # no room to write it to staging yet
    first = os.urandom(25 * MiB)
    with c.generation("mem", 1) as gen:
        gen.put("a", first)
    wait_for(lambda: "event=memory_handoff_waits_for_disk" in d.log(), timeout_s=30)
    with c.generation("mem2", 1) as gen:
        gen.put("b", os.urandom(10 * MiB))  # 25 + 10 MiB: within the 40 MiB share
    other.unlink()
    c.wait("mem", 1, timeout_s=120)
    c.wait("mem2", 1, timeout_s=120)


def asleep_in_io(pid: int) -> bool:
    """Whether process ``pid`` sleeps reading a socket or polling it (a client waiting for
    its reply, with or without a timeout)."""
    with open(f"/proc/{pid}/wchan") as f:
        return f.read().startswith(("unix_stream_read_generic", "poll_schedule_timeout"))


@needs_root
def test_a_wait_begun_before_another_user_owns_the_job_is_not_told_its_commit(
    make_daemon: Any,
) -> None:
    # Found attacking: who may see a job was checked only when a `wait` began. A user
    # waiting on a job name nobody used yet was told another user's commit of it, with its
    # time and attempt id, as soon as that user saved it. The answer is checked against the
    # job's owner when it comes, as it is when the wait begins.
    d = shared_node(make_daemon)
    c = d.client(timeout_s=30)
    ready_r, ready_w = os.pipe()

    def wait_first() -> str:
        theirs = Client(d.socket_path, timeout_s=60)
        theirs.status()  # connected: the wait's request is the next one on this connection
        os.write(ready_w, b"1")
        reply = theirs.wait("later", 1, timeout_s=30)
        return f"TOLD {reply}"

    waiter = start_as(OTHER_UID, wait_first)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
    finally:
        os.close(ready_r)
    wait_for(lambda: asleep_in_io(waiter[0]), timeout_s=10)  # its wait was sent
    with c.generation("later", 1, attempt="secret-attempt") as gen:
        gen.put("w", b"root's bytes")
    c.wait("later", 1, timeout_s=30)
    told = answer(waiter)
    assert told.startswith("DENIED"), told
    assert "secret-attempt" not in told


@needs_root
def test_an_operators_handoff_counts_against_the_jobs_owner(make_daemon: Any) -> None:
    # Found attacking the share: root saving into a user's job was charged to root at the
    # hand-off, and to the user after a restart (recovery goes by the job's owner).
    d = shared_node(make_daemon, CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="40MiB",
                    CKPTDRAIN_LIMITS__ON_FULL="reject",  # refused at once, not waiting
                    CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")

    def begin_theirs() -> str:
        with Client(d.socket_path, timeout_s=30).generation("theirs", 1) as gen:
            gen.put("tiny", b"x")
        return "OK"

    assert answer(start_as(OTHER_UID, begin_theirs)) == "OK"  # the job is theirs

    def their_second_job(step: int) -> str:
        try:
            with Client(d.socket_path, timeout_s=30).generation("theirs-too", step) as gen:
                gen.put("b", os.urandom(20 * MiB))
        except Backpressure as exc:
            return f"REFUSED {exc.details['current']}"
        return "OK"

    with d.client(timeout_s=30).generation("theirs", 2) as gen:
        gen.put("big", os.urandom(30 * MiB))  # root, saving it for them
    for step in (1, 2):  # before a restart, and after it
        assert (answer(start_as(OTHER_UID, lambda: their_second_job(step)))  # noqa: B023
                == f"REFUSED {30 * MiB + 1}")
        d.kill()
        d.start()


def test_a_retry_that_fails_again_leaves_nothing_charged(make_daemon: Any) -> None:
    # Found attacking retry: a retry's loop re-queues one failed shard after another, a
    # journal write each; the first ones drained, failed and failed the generation again
    # meanwhile, and the loop went on charging the rest to the uid's share, for good. (What
    # the failed generation keeps for `retry` is charged, and nothing more.)
    ranks = 16
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="64MiB",
                                   CKPTDRAIN_DESTINATION__MAX_CONCURRENCY=str(ranks))
    blocker = d.dest / "j" / f"{1:020d}"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory: every drain of step 1 fails at once, for good")
    c = d.client(timeout_s=60)
    gens = [c.generation("j", 1, rank=rank, world_size=ranks) for rank in range(ranks)]
    for gen in gens:
        gen.__enter__()
    together = threading.Barrier(ranks)

    def hand_off(rank: int) -> None:
        together.wait()
        with contextlib.suppress(DrainError):  # the generation may fail before this rank seals
            gens[rank].put(f"r{rank}", os.urandom(2 * MiB))
            gens[rank].seal()

    threads = [threading.Thread(target=hand_off, args=(rank,)) for rank in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        with pytest.raises(GenerationFailed):
            c.wait("j", 1, timeout_s=60)
        for probe in range(3):
            c.retry("j", 1)
            with pytest.raises(GenerationFailed):
                c.wait("j", 1, timeout_s=60)
            with pytest.raises(Backpressure) as info, c.generation("probe", probe) as gen:
                gen.put("all", os.urandom(64 * MiB))  # the whole share: told what holds it
            held = info.value.details
            assert held["current"] == held["held_for_retry"] > 0, held  # its copies, no more
        c.abort_generation("j", 1)  # gives them back: the whole share is free again
        with c.generation("probe", 3) as gen:
            gen.put("all", os.urandom(64 * MiB))
        c.wait("probe", 3, timeout_s=60)
    finally:
        # Only now: a rank whose connection goes unsealed is aborted, and no retry then.
        for gen in gens:
            with contextlib.suppress(DrainError):
                gen.__exit__(None, None, None)


@needs_root
def test_one_uid_cannot_hold_every_queue_slot(make_daemon: Any) -> None:
    # Found attacking: empty shards pass any byte share. A user put 0-byte deferred shards
    # into a generation whose second rank never came, held every max_queued_shards slot (for
    # open_rank_idle_timeout_s, an hour), and every other user's hand-off was refused.
    d = shared_node(make_daemon, CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS="20",
                    CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS_PER_UID="10",
                    CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="1MiB",
                    CKPTDRAIN_LIMITS__ON_FULL="reject")
    c = d.client(timeout_s=30)
    hog = c.generation("hog", 1, world_size=2)
    hog.__enter__()
    held = 0
    with pytest.raises(Backpressure) as info:
        for i in range(20):
            hog.put(f"empty-{i}", b"", deferred=True)
            held += 1
    assert held == 10
    assert info.value.details["limit"] == "max_queued_shards_per_uid"

    assert other_user_saves(d, b"the other user's bytes") == "SAVED"
    hog.abort("done")
    hog.__exit__(None, None, None)
    wait_for(lambda: c.status()["queued_shards"] == 0)  # every slot and share given back
    with c.generation("hog", 2) as gen:
        for i in range(10):
            gen.put(f"w-{i}", b"")
    c.wait("hog", 2, timeout_s=30)


@needs_root
def test_copies_a_reader_holds_open_count_against_its_share_until_closed(make_daemon: Any) -> None:
    # Found attacking: a user kept the fds `open_local` lent them of one committed step after
    # another. Each newer commit dropped the older copies, and the daemon counted their room
    # free, but an unlinked file a reader holds keeps its blocks: the staging disk filled past
    # the user's share and refused another user's hand-off. A dropped copy a reader holds now
    # stays on the disk, counted against its job owner's share, until it is closed.
    d = shared_node(make_daemon, CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="256MiB",
                    CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="24MiB",
                    CKPTDRAIN_LIMITS__ON_FULL="reject")
    c = d.client(timeout_s=30)
    held: list[int] = []
    try:
        with pytest.raises(Backpressure) as info:
            for step in range(1, 10):
                with c.generation("hoarder", step) as gen:
                    gen.put("w.bin", os.urandom(8 * MiB))
                c.wait("hoarder", step, timeout_s=60)
                held.append(c.open_local("hoarder", step, "w.bin"))
        assert info.value.details["limit"] == "max_reserved_bytes_per_uid"
        # Three copies held open (dropped, as newer steps committed), and the fourth refused:
        # opened, it would take what the reader holds past its share (see the next test).
        assert len(held) == 3
        assert c.status()["held_open_copy_bytes"] == 3 * 8 * MiB

        assert other_user_saves(d, os.urandom(8 * MiB)) == "SAVED"
    finally:
        for fd in held:
            os.close(fd)
    # Closed: each is removed and its room given back within the recheck period.
    wait_for(lambda: c.status()["held_open_copy_bytes"] == 0, timeout_s=30)
    with c.generation("hoarder", 20) as gen:
        gen.put("w.bin", os.urandom(8 * MiB))
    c.wait("hoarder", 20, timeout_s=60)


@needs_root
def test_a_reader_may_hold_open_no_more_of_its_copies_than_its_share(make_daemon: Any) -> None:
    # Found attacking: a user saved one job after another within its share, then opened
    # every kept copy (`open_local`) and held the fds. Another user's hand-off evicted them
    # for room, but a copy a reader holds stays on the disk and in max_staged_bytes until it
    # is closed: the other user was refused. An `open` that would take what a uid holds open
    # (lent, or dropped and still held) past its share is refused now.
    d = shared_node(make_daemon, CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="64MiB",
                    CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="24MiB",
                    CKPTDRAIN_LIMITS__ON_FULL="reject",
                    CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY="true")
    c = d.client(timeout_s=30)
    for j in range(6):  # 48 MiB of kept copies, each saved within the share
        with c.generation(f"hoard-{j}", 1) as gen:
            gen.put("w.bin", os.urandom(8 * MiB))
        c.wait(f"hoard-{j}", 1, timeout_s=60)
    for j in range(6):  # a restore reads and closes each: more than the share, one at a time
        os.close(c.open_local(f"hoard-{j}", 1, "w.bin"))
    held: list[int] = []
    try:
        with pytest.raises(Backpressure) as info:
            for j in range(6):
                held.append(c.open_local(f"hoard-{j}", 1, "w.bin"))
        assert len(held) == 3  # 24 MiB held open: the share
        assert info.value.details["limit"] == "max_reserved_bytes_per_uid"
        assert info.value.details["current"] == 24 * MiB
        assert "close" in str(info.value), str(info.value)

        assert other_user_saves(d, os.urandom(24 * MiB)) == "SAVED"  # room: 64 - 24 held
        os.close(held.pop())  # closed (and removed: it was evicted): room for another
        wait_for(lambda: c.status()["held_open_copy_bytes"] == 16 * MiB, timeout_s=30)
        held.append(c.open_local("hoard-5", 1, "w.bin"))
    finally:
        for fd in held:
            os.close(fd)


def test_memory_hand_offs_waiting_to_be_staged_count_against_the_slot_share(
    make_daemon: Any,
) -> None:
    # Found attacking the slot share: an ack=memory hand-off takes its queue slot when it is
    # staged, and was only checked against the share before; held in RAM while staging was
    # full, every later one passed the check, and one uid held every slot.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="4MiB",
                                   CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS="8",
                                   CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS_PER_UID="2",
                                   CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="20",
                                   CKPTDRAIN_ACK="memory")
    c = d.client(timeout_s=30)
    filler = c.generation("filler", 1, rank=0, world_size=2, ack="local")
    filler.__enter__()
    filler.put("meta", os.urandom(4 * MiB), deferred=True)  # max_staged_bytes full; 1 slot
    held = c.generation("held", 1)
    held.__enter__()
    accepted = 0
    with pytest.raises(Backpressure) as info:
        for i in range(6):
            held.put(f"s{i}", b"x")  # acknowledged in RAM, not staged: no room
            accepted += 1
    assert accepted == 1  # the filler's slot and this one: the share of 2
    assert info.value.details["limit"] == "max_queued_shards_per_uid"
    filler.abort("done")
    filler.__exit__(None, None, None)
    held.__exit__(None, None, None)
    c.wait("held", 1, timeout_s=30)
    wait_for(lambda: c.status()["queued_shards"] == 0)
    with c.generation("again", 1) as gen:  # the share came back
        gen.put("a", b"a")
        gen.put("b", b"b")
    c.wait("again", 1, timeout_s=30)


@needs_root
@pytest.mark.parametrize("keep_last", ["1", "3"])
def test_copies_held_open_across_a_restart_still_count_against_the_share(
    make_daemon: Any, keep_last: str
) -> None:
    # Found attacking: copies a reader held across a restart came back charged to no uid:
    # with their generations forgotten (keep_last = 1) as strays counted on the disk only,
    # and with them remembered (keep_last = 3: whether a copy is kept is not journalled) as
    # kept copies. Each restart gave the hoarder a new share; another user's save was refused.
    d = shared_node(make_daemon, CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="64MiB",
                    CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="24MiB",
                    CKPTDRAIN_LIMITS__ON_FULL="reject",
                    CKPTDRAIN_RETENTION__KEEP_LAST=keep_last,
                    CKPTDRAIN_RETENTION__KEEP_LOCAL_COPY="true")
    held: list[int] = []

    def hoard(c: Client, first: int) -> int:
        step = first
        with pytest.raises(Backpressure) as info:
            while step < first + 10:
                with c.generation("hoarder", step) as gen:
                    gen.put("w.bin", os.urandom(8 * MiB))
                c.wait("hoarder", step, timeout_s=60)
                held.append(c.open_local("hoarder", step, "w.bin"))
                step += 1
        assert info.value.details["limit"] == "max_reserved_bytes_per_uid"
        return step

    try:
        step = hoard(d.client(timeout_s=30), 1)
        d.stop()
        d.start()
        assert hoard(d.client(timeout_s=30), step + 1) == step + 1  # refused at once

        assert other_user_saves(d, os.urandom(16 * MiB)) == "SAVED"
    finally:
        for fd in held:
            os.close(fd)


def save_in_the_background(d: DaemonProcess, job: str, step: int, size: int, *,
                           timeout_s: float) -> tuple[threading.Thread, list[str]]:
    """One shard of ``size`` saved as ``job`` ``step`` in a thread (started); the list reads
    ``["handed off"]`` once its hand-off returned."""
    done: list[str] = []

    def save() -> None:
        with Client(d.socket_path, timeout_s=timeout_s).generation(job, step) as gen:
            gen.put("a", os.urandom(size))
        done.append("handed off")

    saver = threading.Thread(target=save)
    saver.start()
    return saver, done


def test_a_save_over_its_share_waits_for_its_own_shards_to_drain(make_daemon: Any) -> None:
    # Refused at once under every on_full before: one user's save on a busy node failed as
    # soon as its earlier, still draining shards and its new one passed the share, where the
    # node would have had room a few seconds later. Under on_full = "block" it waits for its
    # own shards to drain (up to block_timeout_s, shown as blocked on the share), as a
    # hand-off waits for room; "reject" still refuses at once.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="40MiB",
                                   CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="60",
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S=str(10 * MiB))
    c = d.client(timeout_s=90)
    with c.generation("j", 1) as gen:
        gen.put("a", os.urandom(30 * MiB))  # draining at 10 MiB/s: about 3 s
    saver, done = save_in_the_background(d, "j", 2, 30 * MiB, timeout_s=90)
    try:
        # 30 + 30 MiB is over the share until the first drains (about 3 s): seen waiting.
        wait_for(lambda: c.status()["blocked_by_limit"].get("max_reserved_bytes_per_uid") == 1,
                 timeout_s=30)
        assert not done
        saver.join(60)
        assert done == ["handed off"]
        c.wait("j", 2, timeout_s=60)
    finally:
        saver.join(60)
    # Larger than the share itself: it could never fit, refused at once (not backpressure).
    with pytest.raises(RejectedInput, match="per-uid share"), \
            c.generation("j", 3) as gen:
        gen.put("a", os.urandom(41 * MiB))


def test_a_reload_raising_the_share_lets_its_waiters_in(make_daemon: Any, tmp_path: Path) -> None:
    # Found attacking the waiting share: a reload raising max_reserved_bytes_per_uid woke no
    # waiter; it got in only when block_timeout_s ran out.
    config = tmp_path / "ckptdrain.toml"
    config.write_text('[limits]\nmax_reserved_bytes_per_uid = "40MiB"\nblock_timeout_s = 120\n'
                      '[drain]\nmax_bandwidth_bytes_per_s = 1\n')
    d: DaemonProcess = make_daemon(CKPTDRAIN_CONFIG=str(config))
    c = d.client(timeout_s=150)
    with c.generation("j", 1) as gen:
        gen.put("a", os.urandom(30 * MiB))  # held: the drain barely moves
    saver, done = save_in_the_background(d, "j", 2, 30 * MiB, timeout_s=150)
    try:
        wait_for(lambda: c.status()["blocked_by_limit"].get("max_reserved_bytes_per_uid") == 1)
        config.write_text(config.read_text().replace('"40MiB"', '"200MiB"'))
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: done == ["handed off"], timeout_s=30)  # not the 120 s timeout
    finally:
        saver.join(150)


@needs_root
def test_a_hand_off_waiting_for_its_share_holds_no_queue_slot(make_daemon: Any) -> None:
    # Found attacking the waiting share: it waited holding a max_queued_shards slot, so one
    # user over their byte share kept another user's small save out of a small queue.
    d = shared_node(make_daemon, CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS="2",
                    CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="40MiB",
                    CKPTDRAIN_LIMITS__BLOCK_TIMEOUT_S="60",
                    CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    c = d.client(timeout_s=90)
    with c.generation("mine", 1) as gen:
        gen.put("a", os.urandom(30 * MiB))  # one slot, 30 of root's 40 MiB, not draining
    waiter = threading.Thread(target=_second_of_mine, args=(d,), daemon=True)
    waiter.start()
    wait_for(lambda: c.status()["blocked_by_limit"].get("max_reserved_bytes_per_uid") == 1)

    def theirs() -> str:
        with Client(d.socket_path, timeout_s=10).generation("theirs", 1) as gen:
            gen.put("tiny", b"x" * 1000)
        return "OK"

    assert answer(start_as(OTHER_UID, theirs)) == "OK"  # at once: the second slot was free
    d.kill()  # the waiter still waits for its share: no graceful stop to wait out for it
    waiter.join(30)


def _second_of_mine(d: DaemonProcess) -> None:
    with contextlib.suppress(Backpressure, DrainError), \
            Client(d.socket_path, timeout_s=90).generation("mine", 2) as gen:
        gen.put("a", os.urandom(30 * MiB))  # over root's share: waits for it


def test_a_rank_over_its_uids_share_waits_for_another_ranks_shard_still_coming_in(
        make_daemon: Any) -> None:
    # Found attacking the training-job path: with a per-uid share, the second of two ranks
    # handing off at once (as DCP does) was refused at once while the first rank's bytes were
    # still coming: only shards already in the ledger counted as "will drain". Every save of a
    # 2-rank job failed on such a node. It waits for the first to drain now.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="64MiB")
    size = 40 * MiB
    data = os.urandom(size)
    outcome: list[str] = []

    def second_rank() -> None:
        try:
            with Client(d.socket_path, timeout_s=60).generation("two", 1, rank=1,
                                                                world_size=2) as gen:
                gen.put("r1", data)
            outcome.append("OK")
        except DrainError as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    with RawClient(d.socket_path) as first:
        assert first.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        assert first.call("begin", job="two", step=1, rank=0, world_size=2).kind == "ok"
        # Admitted (its share taken); its bytes are still to come.
        assert first.call("put", job="two", step=1, rank=0, path="r0", size=size).kind == "ok"
        rank = threading.Thread(target=second_rank)
        rank.start()
        with d.client() as c:
            wait_for(lambda: outcome or c.status()["blocked_handoffs"] == 1, timeout_s=30)
        first.sock.sendall(frame({"type": "data"}, payload_len=size) + data)
        assert first.reply().kind == "ok"
        rank.join(60)
    assert outcome == ["OK"], outcome


def test_a_shard_larger_than_the_whole_share_is_rejected_not_backpressure(
        make_daemon: Any) -> None:
    # Found attacking: it was backpressure (retry_after_s 1.0, "wait for its shards to
    # drain"), and the retry loop the client docs show spun for good on a shard that can never
    # fit. A shard larger than a whole node-wide limit was already RejectedInput.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_RESERVED_BYTES_PER_UID="1MiB")
    with d.client() as c, c.generation("big", 1) as gen:
        with pytest.raises(RejectedInput, match="exceeds the whole per-uid share"):
            gen.put("w", os.urandom(2 * MiB))
        gen.put("fits", os.urandom(MiB // 2))  # the conversation goes on
    assert d.client().wait("big", 1, timeout_s=60)["committed"]


def test_a_node_full_of_copies_kept_for_retry_says_so(make_daemon: Any, tmp_path: Path) -> None:
    # Found attacking a full destination: after an outage the node's max_staged_bytes held
    # the copies failed generations keep for `retry`, which no wait frees, and a save refused
    # at that limit heard only of the oldest shard and the drain rate.
    mount = tmp_path / "mnt"
    d: DaemonProcess = make_daemon(dest=f"file://{mount}/dest",
                                   CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="100MiB",
                                   CKPTDRAIN_LIMITS__ON_FULL="reject",
                                   CKPTDRAIN_DRAIN__RETRY_BUDGET_S="0.5")
    c = d.client(timeout_s=60)
    with c.generation("j", 1) as gen:
        gen.put("a", os.urandom(60 * MiB))
    with pytest.raises(GenerationFailed):
        c.wait("j", 1, timeout_s=60)
    with pytest.raises(Backpressure) as info, c.generation("j", 2) as gen:
        gen.put("a", os.urandom(60 * MiB))
    assert info.value.details["limit"] == "max_staged_bytes"
    assert info.value.details["held_for_retry"] == 60 * MiB
    message = str(info.value)
    assert "step 1 of job 'j'" in message, message
    assert "ckptdrain retry" in message and "ckptdrain abort" in message, message
