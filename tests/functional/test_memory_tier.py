"""ack = "memory": the client copies into a pooled memfd and passes it; the put returns as
soon as the daemon holds the fd; the daemon writes it to NVMe and drains it in the background."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckptdrain.client import GenerationFailed
from ckptdrain.client.memfd import MemfdPool, in_use_elsewhere
from tests.conftest import DaemonProcess, wait_for


def shard_path(d: DaemonProcess, job: str, step: int, path: str) -> Path:
    return d.dest / job / f"{step:020d}" / path


@pytest.mark.parametrize("ack", ["memory", "local"])
def test_each_mode_round_trips_exactly(make_daemon, tmp_path: Path, ack: str) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK=ack)
    big = os.urandom(1 << 20) * 300
    blobs = {"zero": b"", "one": b"\x01", "big": big}
    files = {}
    for path, data in blobs.items():
        files[path] = tmp_path / f"{path}.bin"
        files[path].write_bytes(data)
    with d.client(timeout_s=120).generation("modes", 1) as gen:
        assert gen.effective_ack == ack
        for path, data in blobs.items():
            assert gen.put(path, data)["size"] == len(data)  # bytes over the socket / memfd
            assert gen.put_file(f"fd/{path}", files[path])["size"] == len(data)  # the file's fd
    d.client().wait("modes", 1, timeout_s=120)
    for path, data in blobs.items():
        for stored in (path, f"fd/{path}"):
            got = shard_path(d, "modes", 1, stored).read_bytes()
            assert len(got) == len(data) and hashlib.sha256(got).digest() == hashlib.sha256(data).digest()


def test_a_job_may_choose_a_stronger_boundary_never_a_weaker_one(make_daemon) -> None:  # type: ignore[no-untyped-def]
    mem: DaemonProcess = make_daemon("mem", CKPTDRAIN_ACK="memory")
    with mem.client().generation("stronger", 1, ack="local") as gen:
        assert gen.effective_ack == "local"
        gen.put("x", b"abc")
    local: DaemonProcess = make_daemon("loc", CKPTDRAIN_ACK="local")
    with local.client().generation("weaker", 1, ack="memory") as gen:
        assert gen.effective_ack == "local"
        gen.put("x", b"abc")
    local.client().wait("weaker", 1, timeout_s=30)
    mem.client().wait("stronger", 1, timeout_s=30)


def test_memfds_are_reused_once_the_daemon_lets_go(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory")
    c = d.client()
    for step in range(1, 4):
        with c.generation("reuse", step) as gen:
            gen.put("w", os.urandom(1 << 20))
        c.wait("reuse", step, timeout_s=30)
    pool: MemfdPool = c._memfds
    assert len(pool._fds) == 1, "one memfd, reused for every step"
    assert not in_use_elsewhere(pool._fds[0])
    c.close()


def _idle_memfd_bytes() -> int:
    """The bytes of this process's memfds the pool made (``/proc/self/fd``)."""
    total = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:ckptdrain-shard"):
                total += os.fstat(int(name)).st_size
        except OSError:
            continue  # the listing's own fd, gone
    return total


def test_memfds_kept_between_saves_are_bounded_in_bytes(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the memory tier: the pool kept up to 8 idle memfds at full size, so
    # after a save of 8 shards of 16 MiB the client held 96 MiB between checkpoints (with
    # shards of several GiB, up to 8 of them), with no bound and no word in the docs.
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory")
    with d.client(memfd_pool_bytes=32 << 20) as c:
        with c.generation("bounded", 1) as gen:
            for i in range(8):
                gen.put(f"s{i}", os.urandom(16 << 20))
        c.wait("bounded", 1, timeout_s=60)
        kept = _idle_memfd_bytes()
        assert 0 < kept <= 32 << 20, f"{kept} bytes of memfds kept"
        with c.generation("bounded", 2) as gen:  # what is kept is reused
            gen.put("s0", os.urandom(16 << 20))
        c.wait("bounded", 2, timeout_s=60)
    with d.client(memfd_pool_bytes=0) as c:
        with c.generation("bounded", 3) as gen:
            gen.put("s0", os.urandom(1 << 20))
        c.wait("bounded", 3, timeout_s=60)
        assert _idle_memfd_bytes() == 0
    for step, count in ((1, 8), (2, 1), (3, 1)):
        assert len(list((d.dest / "bounded" / f"{step:020d}").glob("s*"))) == count


KILLED_CLIENT = textwrap.dedent("""
    import os, sys
    from ckptdrain.client import Client
    data = bytes(range(256)) * (64 << 12)   # 64 MiB
    with Client(sys.argv[1]).generation("orphaned", 1) as gen:
        gen.put("w.bin", data)
    print("SEALED", flush=True)
    import time; time.sleep(60)
""")


def test_client_killed_right_after_the_put_still_commits(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory")
    with subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, str(d.socket_path)],
                          stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "SEALED"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    d.client().wait("orphaned", 1, timeout_s=60)
    data = bytes(range(256)) * (64 << 12)
    assert shard_path(d, "orphaned", 1, "w.bin").read_bytes() == data


def test_daemon_crash_loses_unpersisted_memory_shards_visibly(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # The memory boundary does not survive a daemon crash: the generation must fail, never
    # commit without the shard. Hold persisting back by filling the staging budget.
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory", CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="1MiB",
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    with d.client().generation("lost", 1) as gen:
        gen.put("a", os.urandom(1 << 20))  # fills the staged budget (and cannot drain)
        gen.put("b", os.urandom(1000))  # held in memory: no room on local storage
    deadline = time.monotonic() + 10
    while d.client().status()["generations"][0]["shards"].get("held") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    d.kill()
    d.overrides.pop("CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S")
    d.start()
    [gen] = d.client().status()["generations"]
    assert gen["state"] == "failed" and "ack=memory" in gen["error"]
    assert not shard_path(d, "lost", 1, "MANIFEST.json").exists()


def test_a_memfd_cut_short_after_its_acknowledgement_fails_as_the_jobs_doing(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking: a user truncating their own memfd after an ack=memory put_file failed
    # the generation as a drain failure, which pages the operator: anyone could page at will.
    from tests.integration.test_metric_labels import count, scrape

    d = make_daemon(CKPTDRAIN_ACK="memory", CKPTDRAIN_LIMITS__MAX_QUEUED_SHARDS="1")
    c = d.client(timeout_s=30)
    holder = c.generation("holder", 1, rank=0, world_size=2)  # holds the one queue slot
    holder.__enter__()
    holder.put("x", b"x" * 100, deferred=True)
    fd = os.memfd_create("cut", os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, os.urandom(1 << 20))
        with c.generation("cut", 1) as gen:
            gen.put_file("w.bin", fd)  # acknowledged: held in RAM, waiting for the slot
            os.ftruncate(fd, 10)
        holder.abort("free the slot")
        holder.__exit__(None, None, None)
        with pytest.raises(GenerationFailed, match="changed after it was acknowledged"):
            c.wait("cut", 1, timeout_s=30)
    finally:
        os.close(fd)
    # Counted once the failure is journalled, which may be just after `wait` hears of it
    # (seen in CI under load): polled.
    wait_for(lambda: count(scrape(d), "ckptdrain_generations_failed_total", job="cut",
                           reason="aborted") == 1)
    assert count(scrape(d), "ckptdrain_generations_failed_total", job="cut",
                 reason="drain") == 0
    # Its shard never reached local storage and never will: discarded, as after a restart.
    # Left held, status showed `held: 1` and the job's oldest undrained shard aged on (the
    # alert's metric) until the job committed a newer step.
    wait_for(lambda: c.status()["generations"][0]["shards"] == {"discarded": 1})
    status = c.status()
    assert [(g["job"], g["state"]) for g in status["generations"]] == [("cut", "failed"),
                                                                        ("holder", "failed")]
    assert not status["oldest_undrained_age_s"].get("cut"), status["oldest_undrained_age_s"]
    assert count(scrape(d), "ckptdrain_oldest_undrained_age_seconds", job="cut") == 0


OUT_OF_MEMFDS = textwrap.dedent("""
    import resource, sys
    from ckptdrain.client import Client, DrainError
    from tests.fdtable import fd_table_full
    data = bytes(range(256)) * 4096 * 3           # 3 MiB: over the inline and pipe sizes
    with Client(sys.argv[1]).generation("nomemfd", 1) as gen:
        with fd_table_full():  # no memfd can be made (EMFILE)
            for path, blob in (("small", b"s" * 1000), ("big", data)):
                try:
                    print(path, gen.put(path, blob)["size"], flush=True)
                except DrainError as exc:
                    print(path, "DrainError", exc, flush=True)
        # A memfd that refuses the bytes (RLIMIT_FSIZE: EFBIG, as a short tmpfs says ENOSPC).
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            print("capped", gen.put("capped", data)["size"], flush=True)
        except DrainError as exc:
            print("capped", "DrainError", exc, flush=True)
    print("SEALED", flush=True)
""")


def test_a_put_that_cannot_make_or_fill_a_memfd_is_staged_as_local(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking the client under resource exhaustion: with its fd table full (EMFILE) or
    # a memfd refusing the bytes (RLIMIT_FSIZE's EFBIG, ENOSPC, ENOMEM), an ack=memory put
    # raised the bare OSError, outside DrainError (the root of every error the client
    # raises), and the save failed where the socket would have carried the bytes.
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory")
    out = subprocess.run([sys.executable, "-c", OUT_OF_MEMFDS, str(d.socket_path)],
                         capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2],
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    assert out.stdout.split("\n")[:4] == ["small 1000", f"big {3 << 20}", f"capped {3 << 20}",
                                          "SEALED"], out.stdout + out.stderr
    d.client().wait("nomemfd", 1, timeout_s=60)
    data = bytes(range(256)) * 4096 * 3
    assert shard_path(d, "nomemfd", 1, "small").read_bytes() == b"s" * 1000
    assert shard_path(d, "nomemfd", 1, "big").read_bytes() == data
    assert shard_path(d, "nomemfd", 1, "capped").read_bytes() == data


def _shard_memfds() -> int:
    """How many of the client's pooled memfds this process holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed meanwhile
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ckptdrain-shard")
    return count


def test_memfds_of_a_generation_saving_on_after_its_client_closed_are_not_kept(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found attacking: a generation still open when its Client was closed (open generations
    # keep working, as documented) gave its memfds back to a pool already closed, which kept
    # them, and their pages, open until the process exited.
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory")
    before = _shard_memfds()
    client = d.client(timeout_s=60)
    with client.generation("closed-client", 1) as gen:
        client.close()
        for i in range(3):
            gen.put(f"s{i}", os.urandom(1 << 20))
        assert gen.effective_ack == "memory"
    assert _shard_memfds() == before
    with d.client() as other:
        assert other.wait("closed-client", 1, timeout_s=60)["committed"]


def test_a_generation_failed_beside_a_lost_memory_hand_off_leaves_no_undrained_shard(  # type: ignore[no-untyped-def]
        make_daemon, tmp_path: Path) -> None:
    # Found attacking what operators see: an ack=memory generation that failed (a
    # destination outage) while one of its shards was still held in RAM lost that shard,
    # so no `retry` could save it, and its copies went; but its failed shard stayed
    # "failed": the job's oldest undrained shard until a newer step committed (the alert
    # fired on), `ckptdrain drain` said its only copy was kept here for `retry`, while
    # `retry` refused ("lost shards") and `abort` said "nothing to abort".
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the destination's parent should be")
    d: DaemonProcess = make_daemon(dest=f"file://{blocker}/dest", CKPTDRAIN_ACK="memory",
                                   CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="1MiB",
                                   CKPTDRAIN_DRAIN__RETRY_BUDGET_S="1")
    c = d.client()
    with contextlib.suppress(GenerationFailed), c.generation("lost", 1) as gen:
        gen.put("a", os.urandom(1 << 20))  # fills the staged budget, then fails to drain
        gen.put("b", os.urandom(1000))  # held in memory: no room on local storage
    with pytest.raises(GenerationFailed):
        c.wait("lost", 1, timeout_s=30)
    wait_for(lambda: "discarded" in c.status()["generations"][0]["shards"])
    status = c.status()
    [one] = status["generations"]
    assert one["state"] == "failed" and set(one["shards"]) == {"discarded"}, one
    assert not status["oldest_undrained_age_s"].get("lost"), status["oldest_undrained_age_s"]
    report = c.drain()
    assert report["done"] and report["left"]["shards_failed"] == 0, report
