"""The core path end to end: hand-off over the socket, staging, drain to file://, commit."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ckptdrain.client import AlreadyCommitted, GenerationFailed, RejectedInput, Timeout
from ckptdrain.client.manifest import Manifest
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.tombstone import is_tombstone
from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for


def gen_dir(d: DaemonProcess, job: str, step: int) -> Path:
    return d.dest / job / f"{step:020d}"


def sha(data: bytes) -> str:
    return of_bytes(data)


def test_two_ranks_commit_with_every_byte_and_checksum(daemon: DaemonProcess, tmp_path: Path) -> None:
    blobs = {r: os.urandom(3 << 20) + bytes([r]) for r in range(2)}
    fd_file = tmp_path / "optim.bin"
    fd_file.write_bytes(b"optimizer-state" * 1000)
    c = daemon.client()
    for r in range(2):
        with c.generation("job1", 7, rank=r, world_size=2) as gen:
            reply = gen.put(f"model/rank{r}.pt", blobs[r])
            assert reply["size"] == len(blobs[r])
            gen.put(f"empty/rank{r}", b"")
            if r == 1:
                gen.put_file("optim/rank1.pt", fd_file)
    result = c.wait("job1", 7, timeout_s=60)
    assert result["committed"] is True
    root = gen_dir(daemon, "job1", 7)
    manifest = Manifest.from_json((root / "MANIFEST.json").read_bytes())
    assert manifest.world_size == 2 and manifest.generation == 7
    by_path = {s.path: s for s in manifest.shards}
    assert set(by_path) == {"model/rank0.pt", "model/rank1.pt", "empty/rank0", "empty/rank1",
                            "optim/rank1.pt"}
    for r in range(2):
        assert (root / f"model/rank{r}.pt").read_bytes() == blobs[r]
        assert by_path[f"model/rank{r}.pt"].checksum == sha(blobs[r])
        assert by_path[f"model/rank{r}.pt"].rank == r
        assert by_path[f"model/rank{r}.pt"].node == "node-a"
    assert (root / "optim/rank1.pt").read_bytes() == fd_file.read_bytes()
    assert (root / "empty/rank0").read_bytes() == b""
    assert set(manifest.clocks) == {"handoff", "staged", "drained", "committed"}
    assert manifest.clocks["handoff"] <= manifest.clocks["staged"] <= manifest.clocks["drained"] <= manifest.clocks["committed"]
    assert (daemon.dest / "job1" / "LATEST").read_text().strip() == "7"
    assert c.latest("job1") == 7
    assert not list(daemon.dest.rglob("*.ckptdrain-tmp"))


def test_cli_ls_verify_and_corruption_named(daemon: DaemonProcess) -> None:
    c = daemon.client()
    for step in (1, 2):
        with c.generation("cli-job", step) as gen:
            gen.put("weights.bin", os.urandom(4096))
        c.wait("cli-job", step, timeout_s=60)
    env = daemon.env()
    out = subprocess.run([CKPTDRAIN, "ls", daemon.dest_uri, "--json"], env=env, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    assert [(r["job"], r["generation"]) for r in rows] == [("cli-job", 2), ("cli-job", 1)]
    out = subprocess.run([CKPTDRAIN, "verify", daemon.dest_uri, "--job", "cli-job"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "generation 2" in out.stdout
    victim = gen_dir(daemon, "cli-job", 2) / "weights.bin"
    data = victim.read_bytes()  # random: its first byte is b"x" one time in 256, so flip it
    victim.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    out = subprocess.run([CKPTDRAIN, "verify", daemon.dest_uri, "--job", "cli-job", "--generation", "2"], env=env, capture_output=True, text=True)
    assert out.returncode == 1
    assert "weights.bin" in out.stderr and "Traceback" not in out.stderr
    status = subprocess.run([CKPTDRAIN, "status", "--json", "--socket", str(daemon.socket_path)], env=env,
                            capture_output=True, text=True, check=True)
    doc = json.loads(status.stdout)
    assert {g["state"] for g in doc["generations"]} == {"committed"}


def test_missing_rank_is_never_published(daemon: DaemonProcess) -> None:
    c = daemon.client()
    for r in (0, 2):
        with c.generation("partial", 5, rank=r, world_size=3) as gen:
            gen.put(f"rank{r}", b"data")
    with pytest.raises(Timeout):
        c.wait("partial", 5, timeout_s=2)
    root = gen_dir(daemon, "partial", 5)
    assert (root / "rank0").exists() and (root / "rank2").exists()
    assert not (root / "MANIFEST.json").exists()
    assert c.latest("partial") is None


def test_exception_in_block_aborts_the_generation(daemon: DaemonProcess) -> None:
    c = daemon.client()
    with pytest.raises(RuntimeError, match="boom"), c.generation("aborting", 1) as gen:
        gen.put("a", b"12345")
        raise RuntimeError("boom")
    with pytest.raises(GenerationFailed, match="aborted"):
        c.wait("aborting", 1, timeout_s=10)
    assert not (gen_dir(daemon, "aborting", 1) / "MANIFEST.json").exists()
    status = c.status()
    assert status["staged_bytes"] == 0
    assert not list((daemon.staging / "shards").iterdir())


def test_many_clients_at_once(daemon: DaemonProcess) -> None:
    world = 8
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with daemon.client().generation("wide", 3, rank=r, world_size=world) as gen:
                for i in range(5):
                    gen.put(f"r{r}/s{i}", os.urandom(50_000))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    daemon.client().wait("wide", 3, timeout_s=60)
    manifest = Manifest.from_json((gen_dir(daemon, "wide", 3) / "MANIFEST.json").read_bytes())
    assert len(manifest.shards) == world * 5
    assert sorted({s.rank for s in manifest.shards}) == list(range(world))


def test_sigterm_stops_cleanly_and_restart_keeps_committed(daemon: DaemonProcess) -> None:
    c = daemon.client()
    with c.generation("restart", 1) as gen:
        gen.put("w", b"abc")
    c.wait("restart", 1, timeout_s=30)
    assert daemon.stop() == 0
    assert not daemon.socket_path.exists()
    daemon.start()
    assert daemon.client().latest("restart") == 1
    status = daemon.client().status()
    assert [g["state"] for g in status["generations"]] == ["committed"]


def live_generations(job_dir: Path) -> list[str]:
    """The generation directories of a job that are more than retention's tombstone: what is
    left of a generation it removed, for a grace period, is its MANIFEST.json holding one."""
    def removed(d: Path) -> bool:
        files = [f for f in d.rglob("*") if f.is_file()]
        return files == [d / "MANIFEST.json"] and is_tombstone(files[0].read_bytes())

    return sorted(p.name for p in job_dir.iterdir() if p.is_dir() and not removed(p))


def test_retention_runs_after_each_commit(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__KEEP_LAST="2")
    c = d.client()
    for step in range(1, 5):
        with c.generation("kept", step) as gen:
            gen.put("w.bin", os.urandom(1000))
        c.wait("kept", step, timeout_s=30)
    deadline = time.monotonic() + 30
    while live_generations(d.dest / "kept") != [f"{3:020d}", f"{4:020d}"]:
        assert time.monotonic() < deadline, sorted((d.dest / "kept").iterdir())
        time.sleep(0.05)
    assert c.latest("kept") == 4
    steps = [g["step"] for g in c.status()["generations"]]
    assert steps == [3, 4] or steps == [2, 3, 4]  # forgotten once retention removed them


def test_a_late_wait_for_a_step_retention_removed_hears_it_committed(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the S3 drain: with keep_last 1, `wait` for step 1 after step 2 had
    # committed (DrainWriter waiting on a save while the next one commits) took its whole
    # timeout and raised Timeout, "not committed; it may still commit": the node had
    # forgotten the step and its manifest was gone. A committed step is final.
    d: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__KEEP_LAST="1")
    c = d.client()
    for step in (1, 2):
        with c.generation("late", step) as gen:
            gen.put("w.bin", os.urandom(1000))
        committed = c.wait("late", step, timeout_s=30)
    wait_for(lambda: live_generations(d.dest / "late") == [f"{2:020d}"]
             and [g["step"] for g in c.status()["generations"]] == [2], timeout_s=30)
    again = c.wait("late", 1, timeout_s=5)
    assert again["committed"] is True and again["attempt"] == committed["attempt"], again
    with pytest.raises(Timeout):  # a step nothing ever saved still waits, as before
        c.wait("late", 3, timeout_s=1)
    # A restarted daemon has forgotten the step: the tombstone retention left says it
    # committed (found attacking the first version of this fix, which timed out here).
    assert d.stop() == 0
    d.start()
    assert d.client().wait("late", 1, timeout_s=5)["committed"] is True
    # A new save of the step is refused, and says why.
    with pytest.raises(AlreadyCommitted, match="was committed, and retention has since "
                                               "removed it"), d.client().generation("late", 1):
        pass


def test_a_step_retention_would_remove_at_once_is_refused(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking retention: a job rolled back and saved step 25 below its committed 30
    # and 40 (keep_last 2); `wait` said committed, and retention removed it a second later.
    d: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__KEEP_LAST="2")
    c = d.client()
    for step in (10, 20, 30, 40):
        with c.generation("roll", step) as gen:
            gen.put("w.bin", os.urandom(1000))
        c.wait("roll", step, timeout_s=30)
    with pytest.raises(RejectedInput, match="above 40") as info, c.generation("roll", 25):
        pass
    assert info.value.code == "bad_request"
    # LATEST is a hint that can be missing or behind (found attacking the refusal, which
    # had trusted it): refused all the same.
    latest = d.dest / "roll" / "LATEST"
    for hint in (None, b"not-a-step", b"20"):
        _set_latest(latest, hint)
        with pytest.raises(RejectedInput, match="above 40"), c.generation("roll", 26):
            pass
    latest.write_bytes(b"40")
    # One committed step above it: the newest two are then 40 and 35, and it stays.
    with c.generation("roll", 35) as gen:
        gen.put("w.bin", b"kept")
    c.wait("roll", 35, timeout_s=30)
    wait_for(lambda: live_generations(d.dest / "roll")
             == [f"{35:020d}", f"{40:020d}"], timeout_s=30)
    assert (d.dest / "roll" / f"{35:020d}" / "w.bin").read_bytes() == b"kept"


def test_a_step_newer_commits_overtook_while_it_was_saved_is_not_committed_to_be_removed(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking retention: step 60 began with one committed step above it (allowed at
    # keep_last 2), then 200 and 150 committed while it was saved; its `wait` said committed
    # and retention removed it a second later. It ends (cancelled) instead of publishing.
    d: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__KEEP_LAST="2",
                                   CKPTDRAIN_LIMITS__MAX_GENERATIONS_IN_FLIGHT="4")
    c = d.client()
    with c.generation("over", 100) as gen:
        gen.put("w.bin", b"100")
    c.wait("over", 100, timeout_s=30)
    with c.generation("over", 60) as slow:
        slow.put("w.bin", b"60")
        for step in (200, 150):
            with d.client().generation("over", step) as gen:
                gen.put("w.bin", str(step).encode())
            c.wait("over", step, timeout_s=30)
    with pytest.raises(GenerationFailed, match=r"steps 200, 150 of this job committed while it "
                                                r"was saved: retention.keep_last = 2 would "
                                                r"remove it"):
        c.wait("over", 60, timeout_s=30)
    assert not (d.dest / "over" / f"{60:020d}" / "MANIFEST.json").exists()
    assert c.latest("over") == 200


def test_a_retry_that_retention_would_remove_at_once_is_refused(make_daemon,
                                                                  tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Found attacking retention: `retry` of step 10, failed while the destination was away,
    # after 20 and 30 committed (keep_last 2): it drained again, its wait said committed, and
    # retention removed it a second later. Refused now, saying why and what to do.
    mount = tmp_path / "mnt"
    d: DaemonProcess = make_daemon(dest=f"file://{mount}/dest",
                                   CKPTDRAIN_RETENTION__KEEP_LAST="2",
                                   CKPTDRAIN_DRAIN__RETRY_BUDGET_S="0.5")
    c = d.client(timeout_s=60)
    with c.generation("late", 10) as gen:
        gen.put("w.bin", b"10")
    with pytest.raises(GenerationFailed):
        c.wait("late", 10, timeout_s=60)
    mount.mkdir()
    for step in (20, 30):
        with c.generation("late", step) as gen:
            gen.put("w.bin", str(step).encode())
        c.wait("late", step, timeout_s=60)
    with pytest.raises(GenerationFailed, match=r"older than its 2 newest committed steps "
                                                r"\(30, 20\).*ckptdrain abort late 10"):
        c.retry("late", 10)
    assert not (mount / "dest" / "late" / f"{10:020d}" / "MANIFEST.json").exists()


def test_a_rollback_is_refused_behind_many_uncommitted_directories(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the bounded check: nine directories of saves that never committed
    # above the newest commit (retention leaves those alone) used up the reads, and step 15
    # was taken, reported committed, and removed a second later.
    d: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__KEEP_LAST="2")
    c = d.client()
    for step in (10, 20, 30):
        with c.generation("roll", step) as gen:
            gen.put("w.bin", b"x")
        c.wait("roll", step, timeout_s=30)
    for step in range(31, 51):  # a crashed run's partial saves
        partial = d.dest / "roll" / f"{step:020d}"
        partial.mkdir()
        (partial / "w.bin").write_bytes(b"never committed")
    latest = d.dest / "roll" / "LATEST"
    for hint in (b"30", None, b"xx"):  # ... whatever LATEST says, or if it is gone
        _set_latest(latest, hint)
        with pytest.raises(RejectedInput, match="above 30"), c.generation("roll", 15):
            pass


def _set_latest(latest: Path, hint: bytes | None) -> None:
    """LATEST as a hint that is wrong: ``hint``, or removed (None)."""
    if hint is None:
        latest.unlink()
    else:
        latest.write_bytes(hint)


def test_two_nodes_one_retention_run_per_commit_and_both_forget_older(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """Retention runs on the node that published each manifest; the other node still forgets
    the older committed generations it holds, so neither node's journal grows with the job."""
    a: DaemonProcess = make_daemon("node-a", CKPTDRAIN_RETENTION__KEEP_LAST="1")
    b: DaemonProcess = make_daemon("node-b", CKPTDRAIN_RETENTION__KEEP_LAST="1")
    for step in range(1, 4):
        for rank, node in enumerate((a, b)):
            with node.client().generation("pair", step, rank=rank, world_size=2) as gen:
                gen.put(f"r{rank}.bin", os.urandom(1000))
        a.client().wait("pair", step, timeout_s=30)
        b.client().wait("pair", step, timeout_s=30)
    deadline = time.monotonic() + 30
    while (live_generations(a.dest / "pair") != [f"{3:020d}"]
           or [g["step"] for g in a.client().status()["generations"]] != [3]
           or [g["step"] for g in b.client().status()["generations"]] != [3]):
        assert time.monotonic() < deadline, sorted((a.dest / "pair").iterdir())
        time.sleep(0.05)
    published = [line for node in (a, b) for line in node.log().splitlines()
                 if "event=generation_committed" in line and "outcome=published" in line]
    assert len(published) == 3, published


def test_old_failed_generations_are_forgotten_after_the_grace(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__ABANDONED_GRACE_S="0")
    c = d.client()
    with pytest.raises(RuntimeError), c.generation("forget", 1) as gen:
        gen.put("w", b"lost")
        raise RuntimeError("crashed")
    for step in (2, 3):
        with c.generation("forget", step) as gen:
            gen.put("w", b"kept")
        c.wait("forget", step, timeout_s=30)
    deadline = time.monotonic() + 30
    while 1 in [g["step"] for g in c.status()["generations"]]:
        assert time.monotonic() < deadline, c.status()["generations"]
        time.sleep(0.05)
    # What is left on staging is the newest commit's copy, kept for a fast restore and
    # counted inside max_staged_bytes; the failed generation's bytes are gone.
    assert c.status()["staged_bytes"] == len(b"kept")


def test_a_step_rank_and_world_size_of_numpy_or_torch_integers_are_taken(
        daemon: DaemonProcess) -> None:
    # Found attacking the client: a training loop's step is often a numpy int64 or a 0-d
    # tensor; they were refused ("step must be an integer, not int64"). Floats and bools are
    # still refused: 1.0 as a step or True as a rank is a caller bug.
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    with daemon.client() as c:
        with c.generation("ints", np.int64(7), rank=torch.tensor(0),
                          world_size=np.int32(1)) as gen:
            gen.put("a.bin", b"bytes")
        assert c.wait("ints", np.uint16(7), timeout_s=30)["committed"]
        assert c.latest("ints") == 7
        assert c.latest_path("ints", np.int64(7)) == c.latest_path("ints")
        for bad in (7.0, np.float32(7), True, np.bool_(True), torch.tensor(True)):
            with pytest.raises(RejectedInput, match="step must be an integer"):
                c.generation("ints", bad, rank=0, world_size=1)
