"""What the daemon holds stays bounded whatever clients do: status is always one frame, ended
generations and idle jobs are forgotten with their metric series, the journal stays private."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import stat
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Backpressure, GenerationFailed, wire
from tests.conftest import CKPTDRAIN, DaemonProcess, wait_for
from tests.functional.test_bad_input import RawClient

MiB = 1 << 20

# Every character of it is 4 bytes of UTF-8: 300 of them (what a summary keeps of an error)
# are 1.2 KB per generation, and 100 generations were over the 64 KiB of one frame.
WIDE_REASON = "\U0001F600" * 900


def abort_many(d: DaemonProcess, count: int, job: str = "dropped", *, jobs: bool = False) -> None:
    with d.client() as c:
        for step in range(1, count + 1):
            with c.generation(f"{job}-{step}" if jobs else job, step) as gen:
                gen.abort(WIDE_REASON)


def test_status_is_one_frame_however_much_the_node_holds(daemon: DaemonProcess) -> None:
    abort_many(daemon, 130, jobs=True)
    for _ in range(2):  # ... and again after a restart, from the journal
        status = daemon.client().status()
        assert len(json.dumps(status, ensure_ascii=False).encode()) < wire.MAX_HEADER_BYTES
        assert status["generations"] and status["generations_omitted"] > 0
        assert len(status["generations"]) + status["generations_omitted"] == 130
        daemon.stop()
        daemon.start()
    with daemon.client() as c, c.generation("other", 7) as gen:
        gen.put("w", b"x")
    only = daemon.client().status(job="other")
    assert [(g["job"], g["step"]) for g in only["generations"]] == [("other", 7)]
    assert only["generations_omitted"] == 0
    listing = subprocess.run([CKPTDRAIN, "status"], env=daemon.env(), capture_output=True,
                             text=True, timeout=60, check=True).stdout
    assert "more generations" in listing and "--job" in listing
    one = subprocess.run([CKPTDRAIN, "status", "--job", "other", "--json"], env=daemon.env(),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert [g["job"] for g in json.loads(one)["generations"]] == ["other"]


def test_idle_connections_cost_the_daemon_little_memory(daemon: DaemonProcess) -> None:
    """Each connection's receive buffer was a zeroed 1 MiB bytearray, resident from the hello
    on: 200 connections that had only said hello grew the daemon by about 200 MiB (and one
    local user may hold 512). Now an idle connection costs its objects, a few KiB."""
    def hello(_: int, raw: RawClient) -> None:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"

    before = _rss_bytes(daemon.pid)
    with _held_connections(daemon, 200, hello) as clients:
        grown = _rss_bytes(daemon.pid) - before
        assert grown < 48 * MiB, f"200 idle connections grew the daemon by {grown >> 20} MiB"
        # Each still serves a request after the others joined.
        assert all(raw.call("status").kind == "ok" for raw in clients[:5])


def test_connections_that_sent_large_frames_cost_the_daemon_little_memory(
        daemon: DaemonProcess) -> None:
    """Found reviewing 8b343da, which mapped each connection's 1 MiB receive buffer instead
    of zeroing it: the pages a read reached stayed resident for as long as the connection
    stayed open, so a client that pipelined a few inline shards (put_bytes) still pinned up to
    1 MiB of the daemon. Now every connection reads into one buffer the loop shares."""
    payload = os.urandom(wire.INLINE_MAX_BYTES)

    def four_inline_shards(i: int, raw: RawClient) -> None:
        # A deep send queue, so the daemon's reads can take a whole 1 MiB at once.
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
        raw.hello_begin(job="wide", rank=i, world_size=64)  # one generation, 64 ranks
        raw.sock.sendall(b"".join(
            wire.encode_message("put_bytes", {"job": "wide", "step": 1, "rank": i,
                                              "path": f"r{i}/s{k}.bin", "size": len(payload)},
                                len(payload)) + payload
            for k in range(4)))
        replies = [raw.reply() for _ in range(4)]
        assert [r.kind for r in replies] == ["ok"] * 4, replies

    before = _rss_bytes(daemon.pid)
    with _held_connections(daemon, 64, four_inline_shards):
        grown = _rss_bytes(daemon.pid) - before
        assert grown < 32 * MiB, (
            f"64 connections that each sent 1 MiB grew the daemon by {grown >> 20} MiB")



def test_connections_that_sent_a_shard_over_the_socket_hold_no_pipe(
        daemon: DaemonProcess) -> None:
    """Found reviewing deb9f0e: a connection's socket pump kept its 1 MiB pipe for as long as
    the connection stayed open once it had sent one `data` frame. The daemon's user may have
    64 MiB of pipes (pipe-user-pages-soft) before the kernel hands out small ones, so 64 idle
    connections of one user slowed every other client's hand-offs. Now a pipe serves one
    transfer."""
    payload = os.urandom(2 * MiB)

    def one_shard_over_the_socket(i: int, raw: RawClient) -> None:
        raw.hello_begin(job="piped", rank=i, world_size=16)
        fields = {"job": "piped", "step": 1, "rank": i, "path": f"r{i}.bin",
                  "size": len(payload)}
        assert raw.call("put", **fields).kind == "ok"
        raw.sock.sendall(wire.encode_message("data", {}, len(payload)) + payload)
        reply = raw.reply()
        assert reply.kind == "ok", reply

    before = _pipes(daemon.pid)
    with _held_connections(daemon, 16, one_shard_over_the_socket):
        assert _pipes(daemon.pid) - before <= 2, "connections done with their shard hold pipes"


def _pipes(pid: int) -> int:
    fds = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd).startswith("pipe:")
    return count

@contextlib.contextmanager
def _held_connections(d: DaemonProcess, count: int,
                      setup: Callable[[int, RawClient], None]) -> Iterator[list[RawClient]]:
    """``count`` open connections, each after ``setup(index, client)``; closed on the way out."""
    clients: list[RawClient] = []
    try:
        for i in range(count):
            raw = RawClient(d.socket_path)
            clients.append(raw)
            setup(i, raw)
        yield clients
    finally:
        for raw in clients:
            raw.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_job_keeps_only_its_newest_failed_generations(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # 10,000 dropped generations once grew the daemon's RSS from 45 to 138 MB.
    d: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__KEEP_FAILED="5")
    abort_many(d, 40)
    wait_for(lambda: sorted(g["step"] for g in d.client().status(job="dropped")["generations"])
             == [36, 37, 38, 39, 40], timeout_s=30)
    wait_for(lambda: _journal_rows(d, "generations") == 5, timeout_s=30)


def _metrics(d: DaemonProcess) -> str:
    url = d.client().status()["metrics"]
    with urllib.request.urlopen(url, timeout=10) as reply:
        return str(reply.read().decode())


def _journal_rows(d: DaemonProcess, table: str) -> int:
    db = sqlite3.connect(f"file:{d.staging / 'journal.sqlite3'}?mode=ro", uri=True)
    try:
        return int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
    finally:
        db.close()


def _pragma(d: DaemonProcess, name: str) -> int:
    db = sqlite3.connect(f"file:{d.staging / 'journal.sqlite3'}?mode=ro", uri=True)
    try:
        return int(db.execute(f"PRAGMA {name}").fetchone()[0])
    finally:
        db.close()


def test_dropped_generations_and_their_jobs_are_forgotten(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_RETENTION__FORGET_AFTER_S="1.0")
    abort_many(d, 40, jobs=True)
    assert 'job="dropped-7"' in _metrics(d)
    wait_for(lambda: d.client().status()["generations_omitted"] == 0
             and not d.client().status()["generations"], timeout_s=30)
    wait_for(lambda: 'job="dropped-' not in _metrics(d), timeout_s=30)
    wait_for(lambda: _journal_rows(d, "jobs") == 0, timeout_s=30)
    assert _journal_rows(d, "generations") == 0 and _journal_rows(d, "ranks") == 0
    # Compacted: the pages of the forgotten rows went back to the filesystem.
    wait_for(lambda: _pragma(d, "freelist_count") == 0, timeout_s=30)


def test_jobs_tracked_are_bounded(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_JOBS="3")
    with d.client() as c:
        with c.generation("a", 1) as a, c.generation("b", 1), c.generation("c", 1):
            with pytest.raises(Backpressure) as info, c.generation("d", 1):
                pass
            assert info.value.details["limit"] == "max_jobs"
            a.abort("done with it")
        # "a" has nothing in flight now: the longest idle such job is forgotten for "d".
        wait_for(lambda: all(g["state"] != "open" for g in c.status()["generations"]))
        with c.generation("d", 1) as gen:
            gen.put("w", b"x")
        assert {g["job"] for g in c.status()["generations"]} <= {"b", "c", "d"}


def test_journal_and_staging_are_private_whatever_the_umask(make_daemon) -> None:  # type: ignore[no-untyped-def]
    old = os.umask(0)
    try:
        d: DaemonProcess = make_daemon()
    finally:
        os.umask(old)
    with d.client().generation("private", 1) as gen:
        gen.put("w", b"secret")
    journal = d.staging / "journal.sqlite3"
    for path in (journal, journal.with_name("journal.sqlite3-wal")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((d.staging / "shards").stat().st_mode) == 0o700
    assert stat.S_IMODE(d.staging.stat().st_mode) == 0o700


def test_a_huge_stored_reason_is_cut_when_the_journal_is_loaded(daemon: DaemonProcess) -> None:
    # A journal written before reasons were bounded: one abort stored 65,400 characters,
    # and every `wait` on that step then failed to send its own error frame.
    with daemon.client() as c, c.generation("long", 1) as gen:
        gen.abort("short for now")
    daemon.stop()
    db = sqlite3.connect(daemon.staging / "journal.sqlite3")
    with db:
        db.execute("UPDATE generations SET error = ? WHERE job = 'long'", ("r" * 65_400,))
    db.close()
    daemon.start()
    with pytest.raises(GenerationFailed) as info:
        daemon.client().wait("long", 1, timeout_s=10)
    assert 1000 < len(info.value.message) < 4000
    assert daemon.client().status(job="long")["generations"][0]["state"] == "failed"


def test_many_dropped_jobs_leave_the_daemon_small(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # 10,000 dropped generations once grew RSS from 45 to 138 MB and /metrics to 5.2 MB.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_JOBS="50")
    abort_many(d, 600, jobs=True)
    status = d.client().status()
    assert len(status["generations"]) + status["generations_omitted"] <= 50
    assert _metrics(d).count('job="dropped-') < 50 * 15
    assert _journal_rows(d, "jobs") <= 50


def test_a_failure_with_copies_kept_stays_in_status_behind_many_newer_ends(
        make_daemon: Any, small_tmpfs: Path) -> None:
    # Found attacking: status leaves out ended generations past 100, the oldest first, and
    # the only failure on the node (its copy kept here for `ckptdrain retry`) went with them.
    dest = small_tmpfs / "dest"
    dest.mkdir()
    d: DaemonProcess = make_daemon(dest=dest.as_uri())
    (small_tmpfs / "filler").write_bytes(b"\0" * (63 << 20))  # of 64 MiB
    with d.client() as c:
        with c.generation("kept", 1) as gen:
            gen.put("w.bin", b"x" * (2 << 20))
        with pytest.raises(GenerationFailed):
            c.wait("kept", 1, timeout_s=60)
    abort_many(d, 130, jobs=True)
    status = d.client().status()
    assert status["generations_omitted"] > 0
    [kept] = [g for g in status["generations"] if g["job"] == "kept"]
    assert kept["state"] == "failed" and kept["shards"] == {"failed": 1}
