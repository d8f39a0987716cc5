"""kill -9 at each step: nothing acknowledged is lost, nothing partial is published."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptdrain.client import DrainError, GenerationFailed
from ckptdrain.client.manifest import Manifest
from ckptdrain.daemon.checksums import of_bytes
from tests.conftest import DaemonProcess, wait_for
from tests.functional.test_failure_boundary import still_serves


def manifest_of(d: DaemonProcess, job: str, step: int) -> Manifest:
    return Manifest.from_json((d.dest / job / f"{step:020d}" / "MANIFEST.json").read_bytes())


def assert_clean(d: DaemonProcess) -> None:
    assert not list(d.dest.rglob("*.ckptdrain-tmp")), "temp file left at the destination"
    assert not list((d.staging / "shards").glob("*.tmp")), "temp file left in staging"


def test_a_killed_after_ack_before_drain(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # 1 byte/s: the drain is held back, so the shards are acknowledged but not drained.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    blobs = {f"s{i}": os.urandom(200_000 + i) for i in range(3)}
    with d.client().generation("crash-a", 1) as gen:
        for path, data in blobs.items():
            gen.put(path, data)
    # Paced at 1 B/s: every copy is waiting for its first bytes (draining) or to begin (staged).
    shards = d.client().status()["generations"][0]["shards"]
    assert set(shards) <= {"staged", "draining"} and sum(shards.values()) == 3, shards
    d.kill()
    assert not (d.dest / "crash-a").exists() or not list((d.dest / "crash-a").rglob("s*"))
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    d.start()
    d.client().wait("crash-a", 1, timeout_s=60)
    m = manifest_of(d, "crash-a", 1)
    assert {s.path: s.checksum for s in m.shards} == {
        p: of_bytes(b) for p, b in blobs.items()
    }
    for path, data in blobs.items():
        assert (d.dest / "crash-a" / f"{1:020d}" / path).read_bytes() == data
    assert_clean(d)


def test_b_killed_in_the_middle_of_draining_a_large_shard(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon()
    data = os.urandom(1 << 20) * 768  # 768 MiB: several seconds of draining here
    gen_root = d.dest / "crash-b" / f"{1:020d}"
    with d.client(timeout_s=120).generation("crash-b", 1) as gen:
        gen.put("big.bin", data)
    # Kill the moment the destination's temp file appears: the copy is under way.
    wait_for(lambda: gen_root.exists() and any(gen_root.rglob("*.ckptdrain-tmp")), 60, 0.002)
    d.kill()
    assert not (gen_root / "big.bin").exists() or (gen_root / "big.bin").stat().st_size == len(data)
    assert not (gen_root / "MANIFEST.json").exists()
    d.start()
    d.client().wait("crash-b", 1, timeout_s=120)
    assert hashlib.sha256((gen_root / "big.bin").read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    assert manifest_of(d, "crash-b", 1).shards[0].size == len(data)
    assert_clean(d)


def test_c_killed_after_drain_before_manifest(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Two nodes: node-a drains rank 0 and writes its part record, but the manifest needs
    # rank 1 from node-b. Kill node-a there; node-b publishes; node-a, restarted, accepts it.
    a: DaemonProcess = make_daemon("node-a")
    b: DaemonProcess = make_daemon("node-b")
    with a.client().generation("crash-c", 9, rank=0, world_size=2) as gen:
        gen.put("rank0.bin", b"zero" * 1000)
    parts = a.dest / "crash-c" / f"{9:020d}" / "_parts"
    wait_for(lambda: (parts / "node-a.json").exists())
    a.kill()
    assert not (a.dest / "crash-c" / f"{9:020d}" / "MANIFEST.json").exists()
    with b.client().generation("crash-c", 9, rank=1, world_size=2) as gen:
        gen.put("rank1.bin", b"one" * 1000)
    b.client().wait("crash-c", 9, timeout_s=30)
    a.start()
    a.client().wait("crash-c", 9, timeout_s=30)
    m = manifest_of(a, "crash-c", 9)
    assert {(s.path, s.node) for s in m.shards} == {("rank0.bin", "node-a"), ("rank1.bin", "node-b")}
    assert [g["state"] for g in a.client().status()["generations"]] == ["committed"]
    assert_clean(a)


def test_c_single_node_killed_before_publish_commits_on_restart(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The one node drained everything and wrote its part record; the manifest write is the
    # commit. Simulate the crash window by removing the manifest the node had just published
    # is not possible from outside, so hold the commit instead: the part record of the only
    # rank exists, then the daemon dies, and the restart publishes.
    d: DaemonProcess = make_daemon()
    with d.client().generation("crash-c1", 2, rank=0, world_size=1) as gen:
        gen.put("w.bin", b"w" * 5000)
    d.client().wait("crash-c1", 2, timeout_s=30)
    root = d.dest / "crash-c1" / f"{2:020d}"
    # Undo the publish and mark the journal as if the daemon died right before it.
    (root / "MANIFEST.json").unlink()
    d.kill()
    import sqlite3

    db = sqlite3.connect(d.staging / "journal.sqlite3")
    db.execute("UPDATE generations SET state='recorded', committed_at=NULL")
    db.commit()
    db.close()
    d.start()
    d.client().wait("crash-c1", 2, timeout_s=30)
    assert (root / "MANIFEST.json").exists()
    assert manifest_of(d, "crash-c1", 2).shards[0].checksum.startswith("crc64nvme:")


CLIENT_SCRIPT = textwrap.dedent("""
    import os, socket, sys, time
    from ckptdrain.client import wire
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(sys.argv[1])
    conn = wire.Connection(wire.Role.CLIENT)
    def reply():
        while True:
            ev = conn.next_event()
            if ev is wire.NEED_DATA:
                conn.receive_data(sock.recv(65536)); continue
            return ev
    sock.sendall(conn.send("hello", {"version": wire.PROTOCOL_VERSION}))
    reply()
    sock.sendall(conn.send("begin", {"job": "crash-client", "step": 1, "rank": 0, "world_size": 1}))
    reply()
    size = 64 << 20
    sock.sendall(conn.send("put", {"job": "crash-client", "step": 1, "rank": 0, "path": "half.bin", "size": size}))
    reply()
    sock.sendall(conn.send("data", {}, payload_len=size))
    sock.sendall(b"x" * (size // 2))
    print("HALF", flush=True)
    time.sleep(60)
""")


def test_client_killed_mid_shard_leaves_nothing(daemon: DaemonProcess) -> None:
    with subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, str(daemon.socket_path)],
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "HALF"
            wait_for(lambda: any((daemon.staging / "shards").glob("*.tmp")))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    wait_for(lambda: not any((daemon.staging / "shards").iterdir()))
    wait_for(lambda: daemon.client().status()["generations"][0]["state"] == "failed")
    status = daemon.client().status()
    assert status["staged_bytes"] == 0 and status["queued_shards"] == 0
    [gen] = status["generations"]
    assert gen["state"] == "failed" and "disconnected" in gen["error"]
    assert not (daemon.dest / "crash-client" / f"{1:020d}" / "half.bin").exists()
    # The daemon is still serving.
    with daemon.client().generation("after", 1) as g:
        g.put("ok", b"fine")
    daemon.client().wait("after", 1, timeout_s=30)


@pytest.mark.parametrize("signal_name", ["SIGKILL"])
def test_restart_removes_stray_staging_files(daemon: DaemonProcess, signal_name: str) -> None:
    # A stray shard file is a hand-off cut short between its rename and its record: its
    # generation is journalled already (a journal that knows no generation was lost:
    # test_a_lost_journal_sets_the_staged_shards_aside_not_removes_them).
    with daemon.client().generation("strays", 1) as gen:
        gen.put("kept.bin", b"journalled")
    daemon.client().wait("strays", 1, timeout_s=30)
    daemon.kill()
    shards = daemon.staging / "shards"
    (shards / "deadbeef.tmp").write_bytes(b"partial")
    (shards / "cafebabe.data").write_bytes(b"never journalled")
    daemon.start()
    assert not (shards / "deadbeef.tmp").exists()
    assert not (shards / "cafebabe.data").exists()


def test_a_rank_aborted_just_before_a_crash_fails_its_generation_on_restart(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found by `make chaos` (seed 24028): a restart aborts a rank still open at the crash and
    # then fails its generation, two journal writes. Killed between them, the next restart
    # found the rank aborted, not open, and the generation not failed: it recorded the other
    # rank's part and waited for good for a record of the aborted one. (A client's abort at
    # run time is the same two writes.)
    d: DaemonProcess = make_daemon()
    c = d.client()
    with c.generation("crash-ab", 3, rank=0, world_size=2) as gen:
        gen.put("r0.bin", b"0" * 5000)
    d.kill()
    import sqlite3

    db = sqlite3.connect(d.staging / "journal.sqlite3")
    db.execute("INSERT INTO ranks (job, step, rank, state) VALUES ('crash-ab', 3, 1, 'aborted')")
    db.commit()
    db.close()
    d.start()
    with pytest.raises(GenerationFailed, match="rank"):
        d.client().wait("crash-ab", 3, timeout_s=30)
    assert not (d.dest / "crash-ab" / f"{3:020d}" / "MANIFEST.json").exists()


@pytest.mark.parametrize("how", ["removed", "truncated", "side files removed"])
def test_a_lost_journal_sets_the_staged_shards_aside_not_removes_them(make_daemon,
                                                                      how: str) -> None:  # type: ignore[no-untyped-def]
    # Found attacking recovery: with the journal deleted or truncated after a kill -9, the
    # restart took every acknowledged, undrained shard file for a stray and removed it, with
    # one info line ("recovered generations=0 removed_files=3"). Found again attacking
    # restarts with only its -wal and -shm removed (taken for SQLite's leftovers): the
    # journal's file, the database header alone, was not empty, and knew no generation.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1",
                                   CKPTDRAIN_LOG_LEVEL="info")
    with d.client().generation("lost", 1) as gen:
        for i in range(3):
            gen.put(f"s{i}.bin", os.urandom(10_000))
    d.kill()
    shards = d.staging / "shards"
    staged = {p.name: p.read_bytes() for p in shards.glob("*.data")}
    assert len(staged) == 3
    for suffix in ("", "-wal", "-shm"):
        journal = d.staging / f"journal.sqlite3{suffix}"
        if how == "removed" or (how == "side files removed" and suffix):
            journal.unlink(missing_ok=True)
        elif how == "truncated" and journal.exists():
            journal.write_bytes(b"")
    # Unpaced again: the bystander's save below drained at 1 B/s took 10 s.
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    d.start()
    [aside] = (d.staging / "journal-lost").iterdir()
    assert {p.name: p.read_bytes() for p in aside.glob("*.data")} == staged
    assert not list(shards.glob("*.data"))
    assert "level=error event=journal_lost_shards_set_aside files=3" in d.log()
    still_serves(d)


@pytest.mark.parametrize("side_files", ["removed", "removed, a failed start between", "kept"])
def test_a_journal_that_lost_its_newest_records_sets_their_shards_aside(
        make_daemon, side_files: str) -> None:  # type: ignore[no-untyped-def]
    # Found attacking restarts: after a kill -9, the journal's newest records are in its
    # -wal. Removed with the -shm (taken for SQLite's leftovers), the journal still knew the
    # generations of before the last clean stop, and the restart removed the shard files of
    # the newest hand-offs, acknowledged, as strays with one info line. A daemon that does
    # not stop cleanly leaves its pid in daemon.lock; a -wal missing then was removed.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1",
                                   CKPTDRAIN_LOG_LEVEL="info")
    with d.client().generation("tail", 1) as gen:
        gen.put("old.bin", os.urandom(10_000))
    assert d.stop() == 0  # the journal's file holds step 1 now
    d.start()
    with d.client().generation("tail", 2) as gen:
        for i in range(3):
            gen.put(f"s{i}.bin", os.urandom(10_000))
    d.kill()
    shards = d.staging / "shards"
    staged = {p.name: p.read_bytes() for p in shards.glob("*.data")}
    assert len(staged) == 4
    if side_files != "kept":
        for suffix in ("-wal", "-shm"):
            (d.staging / f"journal.sqlite3{suffix}").unlink()
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    if side_files == "removed, a failed start between":
        # A start that ends before recovery does (here: exit 78) leaves the crash to be
        # found by the next one.
        (d.staging / "journal.sqlite3-shm").mkdir()
        with pytest.raises(RuntimeError, match="exited 78"):
            d.start()
        (d.staging / "journal.sqlite3-shm").rmdir()
    d.start()
    d.client().wait("tail", 1, timeout_s=30)
    if side_files == "kept":  # the usual crash: everything drains, nothing is set aside
        d.client().wait("tail", 2, timeout_s=30)
        assert not (d.staging / "journal-lost").exists()
        return
    [aside] = (d.staging / "journal-lost").iterdir()
    moved = {p.name: p.read_bytes() for p in aside.glob("*.data")}
    assert len(moved) == 3 and all(staged[name] == data for name, data in moved.items())
    assert "level=error event=journal_lost_shards_set_aside files=3" in d.log()
    assert "-wal" in d.log()
    still_serves(d)


def stopped_with_a_journal_of_pages(d: DaemonProcess, job: str) -> Path:
    """Commit 3 steps of 20 shards of ``job`` and stop ``d`` cleanly: its journal, more than
    3 pages of 4096 bytes, for a test to damage."""
    for step in (1, 2, 3):
        with d.client().generation(job, step) as gen:
            for i in range(20):
                gen.put(f"s/{i}.bin", os.urandom(1000))
        d.client().wait(job, step, timeout_s=30)
    assert d.stop() == 0
    journal = d.staging / "journal.sqlite3"
    assert journal.stat().st_size > 3 * 4096
    return journal


def test_a_journal_damaged_past_its_header_stops_the_start_with_one_line(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the operator's surface: a page of zeros past the header opened fine,
    # then start-up died in an ExceptionGroup traceback ("database disk image is
    # malformed") where a damaged header gave one line. Both say what to check now, and
    # nothing of the staging directory is touched.
    d: DaemonProcess = make_daemon()
    journal = stopped_with_a_journal_of_pages(d, "damaged")
    with journal.open("r+b") as f:  # page 3 of 4096 bytes
        f.seek(2 * 4096)
        f.write(bytes(4096))
    staged = sorted(p.name for p in (d.staging / "shards").iterdir())
    # 78, which systemd does not restart (RestartPreventExitStatus=78): no restart mends it,
    # and with 1 it was restarted every 5 s for good (found attacking restarts).
    with pytest.raises(RuntimeError, match="exited 78") as info:
        d.start()
    assert "cannot read the journal" in str(info.value) and "check the staging disk" in str(info.value)
    assert "Traceback" not in d.log()
    assert sorted(p.name for p in (d.staging / "shards").iterdir()) == staged


def test_a_journal_cut_short_says_its_records_are_nowhere_else(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking restarts: a journal cut short (a truncated copy, a partial restore)
    # fails as it opens, and said only "database disk image is malformed; check the staging
    # disk for I/O errors and free space", where damage found a moment later, as it is read,
    # says that its records are nowhere else and how to recover them. Both say so now.
    d: DaemonProcess = make_daemon()
    journal = stopped_with_a_journal_of_pages(d, "cut")
    os.truncate(journal, 2 * 4096)
    with pytest.raises(RuntimeError, match="exited 78") as info:
        d.start()
    assert "cannot read the journal" in str(info.value), str(info.value)[-600:]
    assert "copy the staging directory before trying to repair" in str(info.value)
    assert "Traceback" not in d.log()


@pytest.mark.parametrize(("side", "kind"), [("", "directory"), ("", "symlink"), ("", "fifo"),
                                            ("-wal", "directory")])
def test_something_not_a_file_where_the_journal_goes_stops_the_start_with_exit_78(
        make_daemon, side: str, kind: str) -> None:  # type: ignore[no-untyped-def]
    # Found attacking restarts: a directory, a link or a pipe in place of the journal (or its
    # -wal) failed the start with exit 1 (systemd restarts it, for good) and "disk I/O error"
    # or "Too many levels of symbolic links", saying to check the disk for I/O errors. It is
    # an operator's doing that a restart cannot undo: exit 78, naming what is there.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    with d.client().generation("misplaced", 1) as gen:
        gen.put("s.bin", os.urandom(10_000))
    d.kill()
    path = d.staging / f"journal.sqlite3{side}"
    path.rename(d.root / "moved")
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to(d.root / "moved")
    else:
        os.mkfifo(path)
    before = sorted(p.name for p in d.staging.rglob("*"))
    with pytest.raises(RuntimeError, match="exited 78") as info:
        d.start()
    words = {"directory": "a directory", "symlink": "a symbolic link", "fifo": "a named pipe"}
    assert f"{path} is {words[kind]}, not the journal's file" in str(info.value)
    assert "move it out of the way" in str(info.value)
    assert "Traceback" not in d.log()
    assert sorted(p.name for p in d.staging.rglob("*")) == before


@pytest.mark.parametrize("journal", ["kept", "lost"])
def test_a_directory_named_as_a_temp_file_in_staging_is_left_and_the_start_goes_on(
        make_daemon, journal: str) -> None:  # type: ignore[no-untyped-def]
    # Found attacking restarts: a directory `x.tmp` in staging_dir/shards (not the daemon's:
    # it makes only files there) ended every start with exit 78 and "socket: cannot serve:
    # [Errno 21] Is a directory", so acknowledged shards waited for an operator told to look
    # at the socket. The start goes on, the directory is left, and a warning says so.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    blob = os.urandom(10_000)
    with d.client().generation("odd", 1) as gen:
        gen.put("s.bin", blob)
    d.kill()
    (d.staging / "shards" / "left.tmp").mkdir()
    if journal == "lost":
        for suffix in ("", "-wal", "-shm"):
            (d.staging / f"journal.sqlite3{suffix}").unlink(missing_ok=True)
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    d.start()
    assert (d.staging / "shards" / "left.tmp").is_dir()
    assert "event=staging_entry_not_removed" in d.log()
    if journal == "kept":
        d.client().wait("odd", 1, timeout_s=30)
        assert (d.dest / "odd" / f"{1:020d}" / "s.bin").read_bytes() == blob
    else:
        [aside] = (d.staging / "journal-lost").iterdir()
        assert [p.read_bytes() for p in aside.glob("*.data")] == [blob]
    still_serves(d)


def test_a_staging_directory_recovery_cannot_use_names_staging_dir(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The same finding's other half: whatever the staging directory does not let recovery do
    # (here: set a lost journal's shards aside, a file standing where their directory goes)
    # is named as staging_dir's, not the socket's.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    with d.client().generation("odd", 1) as gen:
        gen.put("s.bin", os.urandom(10_000))
    d.kill()
    for suffix in ("", "-wal", "-shm"):
        (d.staging / f"journal.sqlite3{suffix}").unlink(missing_ok=True)
    (d.staging / "journal-lost").write_text("not a directory")
    with pytest.raises(RuntimeError, match="exited 78") as info:
        d.start()
    assert "cannot start: staging_dir: cannot recover what" in str(info.value)
    assert "socket" not in str(info.value).split("cannot start:")[1].split("\n")[0]
    assert "Traceback" not in d.log()
    assert len(list((d.staging / "shards").glob("*.data"))) == 1


def test_a_journal_removed_under_the_running_daemon_is_written_again(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking restarts: with the journal and its side files removed while the daemon
    # ran (a tmp cleaner, an operator's rm), SQLite wrote on into the unlinked files, and
    # the next start, after a clean stop, found no journal: every generation in flight was
    # lost, their acknowledged shards set aside. It is written again from the open one.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1",
                                   CKPTDRAIN_LOG_LEVEL="info")
    with d.client().generation("gone", 1) as gen:
        gen.put("a.bin", os.urandom(10_000))
    for suffix in ("", "-wal", "-shm"):
        (d.staging / f"journal.sqlite3{suffix}").unlink()
    wait_for(lambda: "event=journal_removed_remade" in d.log())
    with d.client().generation("gone", 2) as gen:
        gen.put("b.bin", os.urandom(10_000))
    assert d.stop() == 0
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    d.start()
    d.client().wait("gone", 1, timeout_s=30)
    d.client().wait("gone", 2, timeout_s=30)
    assert not (d.staging / "journal-lost").exists()


def test_a_generation_a_restart_interrupted_holds_no_undrained_shard(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking what operators see: a daemon killed while a rank was still saving
    # failed the generation at its restart (the rank aborted: no retry can save it) but left
    # the shards it had staged "staged". They counted as the job's oldest undrained shard
    # (CkptdrainOldestUndrainedTooOld fired until the job committed a newer step, or for a
    # day), `ckptdrain drain` called them failed shards "kept for `ckptdrain retry`", while
    # `retry` refused them and `abort` said "nothing to abort": nothing cleared them.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1000")
    c = d.client()
    gen = c.generation("cut", 5, rank=0, world_size=2)
    gen.__enter__()
    gen.put("r0.bin", b"0" * (1 << 20))  # staged; at 1000 B/s it drains for minutes
    d.kill()
    with pytest.raises(DrainError):  # its daemon is gone
        gen.__exit__(None, None, None)
    d.start()
    status = d.client().status()
    (summary,) = [g for g in status["generations"] if g["job"] == "cut"]
    assert summary["state"] == "failed" and "staged" not in summary["shards"], summary
    assert summary["oldest_undrained_age_s"] == 0.0
    assert "cut" not in status["oldest_undrained_age_s"]
    report = d.client().drain()
    assert report["done"] and report["left"]["shards_failed"] == 0, report
    wait_for(lambda: not list((d.staging / "shards").iterdir()))  # its copy went with it
