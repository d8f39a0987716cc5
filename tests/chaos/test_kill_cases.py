"""Targeted chaos cases: one fault, placed exactly, for each hole the random matrix found.

Each is deterministic (a path-filtered strace injection, a scripted proxy fault, a kill at a
known point), so a fix turns it from a failure into a pass. Those marked ``xfail(strict=True)``
fail on today's daemon; once fixed they XPASS, which fails the run until the mark goes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.client import Client, DrainError, GenerationFailed
from tests.chaos import invariants as inv
from tests.chaos.killer import ChaosDaemon, Injection
from tests.chaos.matrix import S3Target
from tests.chaos.proxy import ChaosProxy

pytestmark = pytest.mark.timeout(300)

CHAOS_ENV = {
    "CKPTDRAIN_RETENTION__KEEP_LAST": "1000",
    "CKPTDRAIN_DRAIN__RETRY_BUDGET_S": "2",
    "CKPTDRAIN_DRAIN__RETRY_MAX_BACKOFF_S": "0.5",
}


@pytest.fixture
def daemons(tmp_path: Path, sock_dir: Path) -> Iterator[list[ChaosDaemon]]:
    made: list[ChaosDaemon] = []
    yield made
    for d in made:
        d.kill()


def posix_daemon(daemons: list[ChaosDaemon], root: Path, sock_dir: Path, **env: str) -> ChaosDaemon:
    d = ChaosDaemon(root=root, socket_path=sock_dir / "k.sock", dest_uri=f"file://{root / 'dest'}",
                    overrides=CHAOS_ENV | env)
    daemons.append(d)
    return d


def save(d: ChaosDaemon, job: str, step: int, *, world_size: int = 1, rank: int = 0,
         data: bytes = b"x" * 5000) -> None:
    with Client(d.socket_path, timeout_s=30).generation(job, step, rank=rank, world_size=world_size,
                                                       ack="local") as gen:
        gen.put(f"r{rank}.bin", data)


@pytest.mark.parametrize("syscall, errno", [("mkdirat", "ENOSPC"), ("fsync", "EXDEV"),
                                            ("fsync", "ENOSPC")])
def test_part_record_write_error_fails_the_generation_not_the_daemon(
        daemons: list[ChaosDaemon], tmp_path: Path, sock_dir: Path, syscall: str, errno: str) -> None:
    # mkdir of `_parts`, or the fsync of `_parts/` right after the record's rename: the only
    # calls of the part-record write that strace can aim at by path (its temp name is random).
    d = posix_daemon(daemons, tmp_path, sock_dir)
    parts = d.dest / "pr" / f"{7:020d}" / "_parts"
    # fsync(fd of _parts/) matches by the fd's path; mkdirat(generation dir fd, "_parts") by
    # the name it passes (destination paths are reached one component at a time).
    d.injection = Injection(syscall, errno=errno,
                            paths=(str(parts) if syscall == "fsync" else parts.name,))
    d.start()
    save(d, "pr", 7)
    with Client(d.socket_path, timeout_s=30) as c, pytest.raises(GenerationFailed):
        c.wait("pr", 7, timeout_s=30)
    assert any("INJECTED" in line for line in d.injected()), "the fault never fired"
    assert d.alive(), f"the daemon died on a part-record {errno}:\n{d.log_excerpt()}"
    # The shards are drained and the local copies kept: a retry commits the generation.
    d.kill()
    d.injection = None
    d.start()
    with Client(d.socket_path, timeout_s=30) as c:
        with pytest.raises(GenerationFailed):
            c.wait("pr", 7, timeout_s=5)
        c.retry("pr", 7)
        c.wait("pr", 7, timeout_s=30)


def test_latest_is_never_lowered_by_racing_commits(daemons: list[ChaosDaemon], tmp_path: Path,
                                                   sock_dir: Path) -> None:
    # Every read of LATEST takes 1.5 s (strace delays the open's return), so the commits of
    # step 20 and of step 10 (sealed the moment 20's manifest appears) both read "no LATEST"
    # before either writes it; 10 writes last.
    d = posix_daemon(daemons, tmp_path, sock_dir)
    # The daemon opens LATEST as openat(<job dir fd>, "LATEST"): strace matches that name.
    d.injection = Injection("openat", when=1, persistent=True, delay_exit_us=1_500_000,
                            paths=("LATEST",))
    d.start()
    dest = inv.PosixDestination(d.dest)
    obs = inv.Observer(dest, "race", d.staging / "shards", lambda: None, interval_s=0.005).start()
    with Client(d.socket_path, timeout_s=30) as c, \
            c.generation("race", 10, rank=1, world_size=2, ack="local") as slow:
        slow.put("r1.bin", b"one" * 100)
        save(d, "race", 10, world_size=2, rank=0)
        save(d, "race", 20)
        assert inv.wait_until(lambda: dest.read(inv.gen_prefix("race", 20) + inv.MANIFEST) is not None, 30)
        slow.seal()  # step 10 commits now
        # A generation is committed once its LATEST write (or decision not to) is done.
        c.wait("race", 10, timeout_s=30)
        c.wait("race", 20, timeout_s=30)
    obs.stop()
    assert any("LATEST" in line and "DELAYED" in line for line in d.injected()), \
        "no read of LATEST was slowed down: the race was not set up"
    assert not inv.check_latest(dest, "race", obs.latest), obs.latest
    assert inv.read_latest(dest, "race") == 20


@pytest.mark.s3
def test_s3_upload_of_a_generation_failed_in_recovery_is_aborted(
        daemons: list[ChaosDaemon], tmp_path: Path, sock_dir: Path, chaos_s3: S3Target) -> None:
    proxy = ChaosProxy(chaos_s3.endpoint_url, seed=9, stall_s=30)
    try:
        prefix = "mpu"
        d = ChaosDaemon(root=tmp_path, socket_path=sock_dir / "k.sock",
                        dest_uri=f"s3://{chaos_s3.bucket}/{prefix}", overrides=CHAOS_ENV | {
                            "CKPTDRAIN_DESTINATION__ENDPOINT_URL": proxy.endpoint_url,
                            "CKPTDRAIN_DESTINATION__PART_SIZE_BYTES": "8MiB",
                            "CKPTDRAIN_DESTINATION__MULTIPART_THRESHOLD_BYTES": "8MiB",
                            "CKPTDRAIN_DESTINATION__READ_TIMEOUT_S": "2"})
        daemons.append(d)
        # Every part upload stalls: the upload exists (created and journalled) but never ends.
        proxy.inject("stall", times=1000, match=lambda r: r.is_upload_part)
        d.start()
        dest = inv.S3Destination(chaos_s3.client, chaos_s3.bucket, prefix)
        with Client(d.socket_path, timeout_s=60) as c, \
                c.generation("mpu", 3, rank=1, world_size=2, ack="local") as open_rank:
            open_rank.put("r1.bin", b"1")
            save(d, "mpu", 3, world_size=2, rank=0, data=b"z" * (20 << 20))
            assert inv.wait_until(lambda: bool(proxy.do(lambda: [r for r in proxy.proxy.requests
                                                                  if r.is_upload_part])), 30)
            d.kill()  # rank 1 never sealed: recovery fails the generation
            with contextlib.suppress(DrainError):  # nobody is listening: this only closes
                open_rank.abort("the daemon is gone")
        proxy.calm()
        d.start()
        with Client(d.socket_path, timeout_s=30) as c, pytest.raises(GenerationFailed):
            c.wait("mpu", 3, timeout_s=30)
        assert not inv.check_uploads(dest, timeout_s=5), dest.uploads()
    finally:
        proxy.close()


def test_journal_io_error_at_start_up_is_one_clear_sentence(daemons: list[ChaosDaemon], tmp_path: Path,
                                                            sock_dir: Path) -> None:
    d = posix_daemon(daemons, tmp_path, sock_dir)
    d.staging.mkdir(parents=True)
    d.injection = Injection("openat", errno="EIO", persistent=True,
                            paths=(str(d.staging / "journal.sqlite3"),))
    with pytest.raises(RuntimeError, match="daemon exited 1"):
        d.start()
    assert any("INJECTED" in line for line in d.injected()), "the fault never fired"
    log = d.log()
    assert "Traceback" not in log, log
    assert "journal" in log

