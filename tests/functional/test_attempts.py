"""A restarted job saving the same step again: a new attempt replaces the old one, and the
commit never mixes shards of two attempts."""

from __future__ import annotations

import os
import time

import pytest

from ckptdrain.client import DrainError, GenerationFailed
from ckptdrain.client.manifest import Manifest
from tests.conftest import DaemonProcess


def manifest_path(d: DaemonProcess, job: str, step: int):  # type: ignore[no-untyped-def]
    return d.dest / job / f"{step:020d}" / "MANIFEST.json"


def test_a_new_attempt_replaces_a_failed_one(daemon: DaemonProcess) -> None:
    c = daemon.client()
    with c.generation("again", 20, rank=1, world_size=2, attempt="run-1") as g:
        g.put("b", b"old rank 1")
    with pytest.raises(RuntimeError), c.generation("again", 20, rank=0, world_size=2, attempt="run-1") as g:
        g.put("a", b"old rank 0")
        raise RuntimeError("killed mid-save")
    with pytest.raises(GenerationFailed):
        c.wait("again", 20, timeout_s=5)
    # The same attempt may not reuse the failed step ...
    with pytest.raises(GenerationFailed, match="failed"):
        c.generation("again", 20, rank=0, world_size=2, attempt="run-1").__enter__()
    # ... a new attempt replaces it.
    for rank in (0, 1):
        with c.generation("again", 20, rank=rank, world_size=2, attempt="run-2") as g:
            g.put("a" if rank == 0 else "b", f"new rank {rank}".encode())
    c.wait("again", 20, timeout_s=30)
    root = manifest_path(daemon, "again", 20).parent
    assert (root / "a").read_bytes() == b"new rank 0" and (root / "b").read_bytes() == b"new rank 1"
    assert "event=generation_replaced" in daemon.log()
    status = c.status()  # only the new attempt's kept copies are left on staging
    assert status["staged_bytes"] == status["kept_copy_bytes"] == len(b"new rank 0") * 2


def test_records_of_two_attempts_never_make_one_manifest(make_daemon) -> None:  # type: ignore[no-untyped-def]
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b")
    # Attempt 1: rank 1 (node-b) finishes; rank 0 (node-a) dies mid-save.
    with b.client().generation("mix", 7, rank=1, world_size=2, attempt="one") as g:
        g.put("r1", b"rank 1 from attempt one")
    parts = a.dest / "mix" / f"{7:020d}" / "_parts"
    deadline = time.monotonic() + 30
    while not (parts / "node-b.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(RuntimeError), a.client().generation("mix", 7, rank=0, world_size=2, attempt="one") as g:
        raise RuntimeError("died")
    # Attempt 2 on node-a only: node-b's record of attempt one must not complete it.
    with a.client().generation("mix", 7, rank=0, world_size=2, attempt="two") as g:
        g.put("r0", b"rank 0 from attempt two")
    time.sleep(1.0)  # several commit polls on both nodes
    assert not manifest_path(a, "mix", 7).exists(), "mixed two attempts into one commit"
    # Attempt 2 reaches node-b: it replaces attempt one there, and the step commits.
    with b.client().generation("mix", 7, rank=1, world_size=2, attempt="two") as g:
        g.put("r1", b"rank 1 from attempt two")
    a.client().wait("mix", 7, timeout_s=30)
    b.client().wait("mix", 7, timeout_s=30)
    m = Manifest.from_json(manifest_path(a, "mix", 7).read_bytes())
    root = manifest_path(a, "mix", 7).parent
    assert {s.path for s in m.shards} == {"r0", "r1"}
    assert (root / "r1").read_bytes() == b"rank 1 from attempt two"


def test_torchrun_restarts_are_new_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptdrain.client.generation import default_attempt

    monkeypatch.delenv("CKPTDRAIN_ATTEMPT", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = default_attempt()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert default_attempt() != first
    monkeypatch.setenv("CKPTDRAIN_ATTEMPT", "mine")
    assert default_attempt() == "mine"


def test_a_new_attempt_is_not_disturbed_by_the_old_attempts_queued_shards(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The old attempt's shards are still queued (a slow drain) when the new attempt begins.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="4000",
                                   CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1")
    c = d.client()
    with c.generation("queued", 5, attempt="one") as g:
        for i in range(6):
            g.put(f"s{i}", b"x" * 2000)
    with c.generation("queued", 5, attempt="two") as g:
        g.put("s0", b"y" * 100)
    c.wait("queued", 5, timeout_s=30)
    root = manifest_path(d, "queued", 5).parent
    assert (root / "s0").read_bytes() == b"y" * 100
    assert {s.path for s in Manifest.from_json(manifest_path(d, "queued", 5).read_bytes()).shards} == {"s0"}
    status = c.status()  # the replaced attempt's six queued shards hold nothing any more
    assert status["staged_bytes"] == status["kept_copy_bytes"] == 100
    assert status["queued_shards"] == 0


def test_ranks_of_a_new_attempt_that_begin_at_once_join_one_generation(daemon: DaemonProcess) -> None:
    """Attempt A1 of step 25 failed (rank 0 aborted). A2's two ranks begin at the same moment:
    exactly one replaces A1, both join A2, and it commits (it used to wedge: the second
    replacement forgot the generation the first had just opened)."""
    import threading

    c = daemon.client()
    with c.generation("race", 25, rank=1, world_size=2, attempt="A1") as g:
        g.put("b", b"old 1")
    with pytest.raises(RuntimeError), c.generation("race", 25, rank=0, world_size=2, attempt="A1") as g:
        raise RuntimeError("rank 0 died")
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with daemon.client().generation("race", 25, rank=r, world_size=2, attempt="A2") as gen:
                barrier.wait(10)
                gen.put("a" if r == 0 else "b", f"new {r}".encode())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    c.wait("race", 25, timeout_s=30)
    root = manifest_path(daemon, "race", 25).parent
    assert (root / "a").read_bytes() == b"new 0" and (root / "b").read_bytes() == b"new 1"


def test_ranks_of_a_new_attempt_that_begin_behind_a_barrier_commit_every_time(
        daemon: DaemonProcess) -> None:
    """The issue's reproducer, as quoted: A1 of step 25 (rank 1 seals, rank 0 aborts); A2:
    two threads behind a barrier each begin and put rank 0 and rank 1; wait commits."""
    import threading

    c = daemon.client()
    for i in range(10):
        job = f"barrier{i}"
        with c.generation(job, 25, rank=1, world_size=2, attempt="A1") as g:
            g.put("b", b"old 1")
        with pytest.raises(RuntimeError), c.generation(job, 25, rank=0, world_size=2, attempt="A1"):
            raise RuntimeError("rank 0 died")
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def rank(r: int, job: str = job, barrier: threading.Barrier = barrier,
                 errors: list[BaseException] = errors) -> None:
            try:
                barrier.wait(10)
                with daemon.client().generation(job, 25, rank=r, world_size=2, attempt="A2") as gen:
                    gen.put("a" if r == 0 else "b", f"new {r}".encode())
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert c.wait(job, 25, timeout_s=30, attempt="A2")["committed"]


def test_wait_before_the_resave_begins_waits_for_the_resave(daemon: DaemonProcess) -> None:
    """A wait of attempt A2 that starts while this node holds only A1's failure waits for A2
    (it used to answer A1's GenerationFailed within 2 ms)."""
    import concurrent.futures

    c = daemon.client()
    with pytest.raises(RuntimeError), c.generation("resave", 30, attempt="A1") as g:
        g.put("a", b"old")
        raise RuntimeError("killed mid-save")
    with pytest.raises(GenerationFailed):
        c.wait("resave", 30, timeout_s=5, attempt="A1")  # A1's own waiter is told it failed
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(daemon.client().wait, "resave", 30, 60, attempt="A2")
        with pytest.raises(concurrent.futures.TimeoutError):
            waiting.result(timeout=1.0)  # still waiting: A2 has not begun
        with c.generation("resave", 30, attempt="A2") as g:
            g.put("a", b"new")
        answer = waiting.result(timeout=60)
    assert answer["committed"] and answer["attempt"] == "A2"
    # A sub-attempt (DrainWriter's "<run>/dcp:<token>") answers its run's waiter.
    with c.generation("resave", 31, attempt="run-7/dcp:x") as g:
        g.put("a", b"sub")
    assert c.wait("resave", 31, timeout_s=30, attempt="run-7")["committed"]


def test_wait_learns_of_a_commit_at_once(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """A wait that starts before the daemon knows the step answers when the step commits,
    not up to a full commit_poll_interval_s later."""
    import concurrent.futures

    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__COMMIT_POLL_INTERVAL_S="6")
    c = d.client()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(d.client().wait, "prompt", 1, 60)
        with pytest.raises(concurrent.futures.TimeoutError):
            waiting.result(timeout=0.5)  # asked the destination once, and now asleep
        with c.generation("prompt", 1) as g:
            g.put("a", b"x")
        sealed = time.monotonic()
        waiting.result(timeout=60)
        late = time.monotonic() - sealed
    assert late < 3.0, f"wait answered {late:.2f} s after the seal (poll interval 6 s)"


def test_an_attempt_from_the_environment_is_checked_where_it_can_be_named(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found attacking: a long or unprintable $CKPTDRAIN_ATTEMPT or torchrun run id was sent as
    # it was, and every begin and wait failed as an `internal` error that named neither.
    from ckptdrain.client import RejectedInput
    from ckptdrain.client.generation import default_attempt
    from ckptdrain.client.wire import MAX_ATTEMPT_CHARS

    c = daemon.client()
    for bad in ("x" * 200, "run\n1", "run\t1"):
        monkeypatch.setenv("CKPTDRAIN_ATTEMPT", bad)
        with pytest.raises(RejectedInput, match=r"\$CKPTDRAIN_ATTEMPT must be printable"):
            c.generation("envjob", 1).__enter__()
        with pytest.raises(RejectedInput, match=r"\$CKPTDRAIN_ATTEMPT"):
            c.wait("envjob", 1, timeout_s=1)
    monkeypatch.delenv("CKPTDRAIN_ATTEMPT")
    # torchrun takes any --rdzv-id: a long or odd one is named by its digest, alike on every
    # rank, and still new at each restart.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    for run_id in ("r" * 130, "run\t7"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        first = default_attempt()
        assert first == default_attempt()
        assert len(first) <= MAX_ATTEMPT_CHARS and first.isprintable()
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        assert default_attempt() != first
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with c.generation("envjob", 2) as gen:
        gen.put("a", b"saved under a long run id")
    assert c.wait("envjob", 2, timeout_s=60)["committed"]


def test_a_failure_says_how_to_save_the_step_again(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking: after a restart the failure said "save this generation again", and
    # saving it again (the same attempt) was refused, "...; save a new step".
    d: DaemonProcess = make_daemon()
    c = d.client(timeout_s=30)
    with pytest.raises(DrainError), c.generation("resave", 5, attempt="run-1") as gen:
        gen.put("a.bin", b"a" * 1000)
        d.kill()
        d.start()  # the seal then finds its connection gone
    with pytest.raises(GenerationFailed) as failed:
        c.wait("resave", 5, timeout_s=30, attempt="run-1")
    assert "save this generation again" not in str(failed.value)
    assert "as a new attempt" in str(failed.value) and "save a new step" in str(failed.value)
    with pytest.raises(GenerationFailed, match=r"for this attempt.*as a new attempt") as again:
        c.generation("resave", 5, attempt="run-1").__enter__()
    # Said once (found attacking: the restart's reason carried it, and the begin added it).
    assert str(again.value).count("as a new attempt") == 1, again.value
    # What it says works.
    with c.generation("resave", 5, attempt="run-2") as again:
        again.put("a.bin", b"a" * 1000)
    assert c.wait("resave", 5, timeout_s=60, attempt="run-2")["committed"]


def test_a_rank_open_when_the_daemon_stops_says_the_daemon_stopped(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking: a SIGTERM stop aborted open ranks as "the client disconnected before
    # sealing the rank", sending operators after the training job.
    d: DaemonProcess = make_daemon()
    c = d.client(timeout_s=30)
    with pytest.raises(DrainError), c.generation("stopped", 3) as gen:
        gen.put("a.bin", b"a" * 1000)
        d.stop()
        d.start()
    with pytest.raises(GenerationFailed) as failed:
        c.wait("stopped", 3, timeout_s=30)
    assert "daemon stopped while the rank was handing off" in str(failed.value)
    assert "client disconnected" not in str(failed.value)


LAUNCH_VARIABLES = ("CKPTDRAIN_ATTEMPT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "PMIX_NAMESPACE")


def test_a_job_restarted_by_srun_never_commits_with_the_killed_runs_shards(
        make_daemon, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the client: without $CKPTDRAIN_ATTEMPT or torchrun the attempt was ""
    # in every run. Run 1's rank 1 sealed on node-b; its rank 0 died before its save reached
    # node-a. The restarted run's rank 0 sealed on node-a, and step 5 committed at once with
    # run 2's rank 0 beside run 1's rank 1; run 2's own rank 1 then heard "already committed".
    # Slurm names each srun (its job step) and each requeue: a new run is a new attempt.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b")
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    with b.client().generation("srun", 5, rank=1, world_size=2) as g:
        g.put("rank1.bin", b"OLD rank 1")
    monkeypatch.setenv("SLURM_STEP_ID", "1")  # the job script's next srun: the restarted run
    with a.client().generation("srun", 5, rank=0, world_size=2) as g:
        g.put("rank0.bin", b"NEW rank 0")
    with pytest.raises(DrainError):  # a Timeout: it waits for run 2's rank 1
        a.client().wait("srun", 5, timeout_s=2)
    assert not manifest_path(a, "srun", 5).exists(), "committed two runs' ranks as one"
    with b.client().generation("srun", 5, rank=1, world_size=2) as g:
        g.put("rank1.bin", b"NEW rank 1")
    a.client().wait("srun", 5, timeout_s=30)
    root = manifest_path(a, "srun", 5).parent
    assert (root / "rank0.bin").read_bytes() == b"NEW rank 0"
    assert (root / "rank1.bin").read_bytes() == b"NEW rank 1"


def test_each_launchers_name_for_a_run_is_part_of_the_default_attempt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptdrain.client.generation import default_attempt

    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert default_attempt() == ""  # none: a restart must set $CKPTDRAIN_ATTEMPT (docs)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    batch = default_attempt()
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    first = default_attempt()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: same job id and step
    requeued = default_attempt()
    assert len({batch, first, requeued}) == 3
    # torchrun under srun: a fixed --rdzv-id restarts its count at 0 after a requeue, and
    # the requeue still makes a new attempt.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fixed")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    before = default_attempt()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert default_attempt() not in (before, requeued)
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-node1-1234@1")  # mpirun
    mpirun = default_attempt()
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-node1-5678@1")
    assert default_attempt() != mpirun
    # torchrun alone names its attempts as it always did: a waiter of an older client agrees.
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert default_attempt() == "torchelastic:abc:2"


def test_a_launchers_variable_that_is_not_utf8_still_names_an_attempt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Found attacking: bytes that are not UTF-8 come into os.environ as surrogates, and
    # default_attempt() raised a bare UnicodeEncodeError from every begin and wait.
    from ckptdrain.client.generation import default_attempt
    from ckptdrain.client.wire import MAX_ATTEMPT_CHARS

    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    seen = set()
    for value in (b"\xff\xfe", b"ns\xc3", b"\xed\xa0\x80"):
        monkeypatch.setenv("SLURM_JOB_ID", os.fsdecode(value))
        attempt = default_attempt()
        assert attempt == default_attempt()
        assert attempt.isprintable() and len(attempt) <= MAX_ATTEMPT_CHARS
        seen.add(attempt)
    assert len(seen) == 3
