"""Restore's reader processes: a large S3 object's ranges read by ``readers`` processes, each
with its own event loop and S3 client (one process's loop reads about 1 GB/s from S3 at most),
against a real SeaweedFS. The restoring process only asks HEADs, hands each reader the file
and a range, and combines the ranges' checksums."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ckptdrain.daemon.backends import s3pool, s3reads
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.s3 import S3Backend
from ckptdrain.daemon.config import DestinationConfig
from tests.integration.faultproxy import FaultProxy
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_backend import copied_at_once, dest_config

MiB = 1 << 20
KEY = "job/00000000000000000001/big.bin"
SIZE = 37 * MiB + 5  # five 8 MiB ranges, the last one short
pytestmark = [
    pytest.mark.s3, pytest.mark.asyncio,
    # The objects are uploaded from pooled bytearrays in this process (as test_s3_backend).
    pytest.mark.filterwarnings(
        "ignore:Sending a large body directly with raw bytes:ResourceWarning"),
]


@pytest.fixture(autouse=True)
def _small_objects_use_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    # Readers take objects of READERS_FROM (256 MiB) or more; a test's 37 MiB object stands
    # for one (decided in this process, which hands out the ranges).
    monkeypatch.setattr(s3reads, "READERS_FROM", 16 * MiB)


@pytest_asyncio.fixture
async def with_readers() -> AsyncIterator[Callable[[DestinationConfig], S3Backend]]:
    made: list[S3Backend] = []

    def make(config: DestinationConfig) -> S3Backend:
        backend = S3Backend(config, "gpu0", readers=2)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.aclose()


def _range_gets_of_this_process(backend: S3Backend) -> list[str]:
    """Records the ranged GETs this process's own client sends."""
    sent: list[str] = []
    own_call = backend._call

    async def recording(what: str, operation: str, **params: Any) -> Any:
        if operation == "get_object" and "Range" in params:
            sent.append(params["Range"])
        return await own_call(what, operation, **params)

    backend._call = recording  # type: ignore[method-assign]
    return sent


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rpartition(b")")[2].split()[16])


def _reader_pids(backend: S3Backend) -> list[int]:
    assert backend.readers is not None
    return [w.proc.pid for w in backend.readers._workers if w is not None and w.alive]


async def _copy(backend: S3Backend, out: Path,
                progress: Callable[[int], None] | None = None) -> tuple[int, str]:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        return await backend.copy_into(KEY, fd, progress=progress)
    finally:
        os.close(fd)


async def _a_copy_with_a_stalled_range(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path,
        proxy: FaultProxy, shard: Any) -> tuple[S3Backend, asyncio.Future[tuple[int, str]]]:
    """``shard`` written to KEY, and a copy of it under way through ``proxy`` by a backend
    with readers, one of whose ranged GETs hangs at the proxy now."""
    direct = dest_config(s3_bucket, seaweedfs.endpoint_url)
    assert await backends(direct).put_file(KEY, shard.fd, shard.size) == shard.checksum
    backend = with_readers(dest_config(s3_bucket, proxy.endpoint_url))
    proxy.inject("stall", match=lambda r: r.method == "GET")
    copy = asyncio.ensure_future(_copy(backend, tmp_path / "big"))
    async with asyncio.timeout(30):
        while not proxy.faults("stall"):
            await asyncio.sleep(0.02)
    return backend, copy


async def test_a_large_objects_ranges_are_read_by_the_reader_processes(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path) -> None:
    config = dest_config(s3_bucket, seaweedfs.endpoint_url)
    shard = staged(SIZE, seed=61)
    small = staged(9 * MiB, seed=62)
    assert await backends(config).put_file(KEY, shard.fd, SIZE) == shard.checksum
    small_key = "job/00000000000000000001/small.bin"
    assert await backends(config).put_file(small_key, small.fd, small.size) == small.checksum
    backend = with_readers(config)
    own_gets = _range_gets_of_this_process(backend)

    # Below READERS_FROM: read by this process, and no reader is started for it.
    fd = os.open(tmp_path / "small", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert await backend.copy_into(small_key, fd) == (small.size, small.checksum)
    finally:
        os.close(fd)
    assert len(own_gets) == 2
    assert _reader_pids(backend) == []

    own_gets.clear()
    progress: list[int] = []
    assert await _copy(backend, tmp_path / "big", progress.append) == (SIZE, shard.checksum)
    assert (tmp_path / "big").read_bytes() == shard.data
    assert own_gets == []  # every range came from a reader
    assert sum(progress) == SIZE
    pids = _reader_pids(backend)
    assert len(pids) == 2 and os.getpid() not in pids
    # A restore is what a job waits on: its readers do not yield as the drain's workers do.
    assert {_nice(pid) for pid in pids} == {_nice(os.getpid())}

    # Once started, the readers take every ranged object, the smaller ones too.
    fd = os.open(tmp_path / "small-again", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert await backend.copy_into(small_key, fd) == (small.size, small.checksum)
    finally:
        os.close(fd)
    assert (tmp_path / "small-again").read_bytes() == small.data
    assert own_gets == []


async def test_a_range_whose_reader_dies_is_read_again_by_a_fresh_one(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path,
        proxy: FaultProxy) -> None:
    shard = staged(SIZE, seed=63)
    # One ranged GET hangs at the proxy: its reader is killed while it waits.
    backend, copy = await _a_copy_with_a_stalled_range(
        seaweedfs, s3_bucket, backends, with_readers, tmp_path, proxy, shard)
    assert backend.readers is not None
    first = [w.proc for w in backend.readers._workers if w is not None]
    assert len(first) == 2
    for proc in first:
        os.kill(proc.pid, signal.SIGKILL)
    async with asyncio.timeout(60):
        assert await copy == (SIZE, shard.checksum)
    assert (tmp_path / "big").read_bytes() == shard.data
    # The ranges were read again only once the killed readers had exited: none of their
    # writes can land after the copy returned.
    assert all(proc.returncode is not None for proc in first)
    again = _reader_pids(backend)
    assert again and not set(again) & {proc.pid for proc in first}


async def test_a_readers_failure_comes_back_typed_with_what_to_do(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The object changed since its HEAD (another ETag now): every range pinned to the old
    # ETag is refused, and the reader's answer is the same typed failure an in-process
    # read raises.
    config = dest_config(s3_bucket, seaweedfs.endpoint_url)
    shard = staged(SIZE, seed=64)
    assert await backends(config).put_file(KEY, shard.fd, SIZE) == shard.checksum
    backend = with_readers(config)
    own_head = backend._head

    async def stale_head(key: str, full: str) -> Any:
        head = await own_head(key, full)
        return {**head, "ETag": '"0123456789abcdef0123456789abcdef-5"'}

    monkeypatch.setattr(backend, "_head", stale_head)
    with pytest.raises(BackendError) as caught:
        await _copy(backend, tmp_path / "big")
    assert caught.value.kind == "conflict" and caught.value.transient
    assert "was replaced" in str(caught.value) and "read it again" in str(caught.value)
    assert len(_reader_pids(backend)) == 2  # a failed range ends no reader


async def test_a_reader_that_cannot_start_says_why_and_what_to_do(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # At the open-files limit (found with RLIMIT_NOFILE in the mid-30s): the command said
    # only "Too many open files", not that a reader was being started nor what to do.
    config = dest_config(s3_bucket, seaweedfs.endpoint_url)
    shard = staged(SIZE, seed=66)
    assert await backends(config).put_file(KEY, shard.fd, SIZE) == shard.checksum
    backend = with_readers(config)
    real = socket.socketpair

    def at_the_limit(*args: Any, **kwargs: Any) -> Any:
        if socket.SOCK_SEQPACKET in args:  # the reader's channel, and nothing else here
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(*args, **kwargs)

    monkeypatch.setattr(socket, "socketpair", at_the_limit)
    with pytest.raises(BackendError) as caught:
        await _copy(backend, tmp_path / "big")
    message = str(caught.value)
    assert "could not start an S3 reader process: Too many open files" in message
    assert "ulimit -n" in message and "--readers 0" in message
    assert caught.value.transient and caught.value.kind == "io"


async def test_a_cancelled_copy_leaves_no_range_in_flight(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path,
        proxy: FaultProxy) -> None:
    backend, copy = await _a_copy_with_a_stalled_range(
        seaweedfs, s3_bucket, backends, with_readers, tmp_path, proxy, staged(SIZE, seed=65))
    copy.cancel()
    async with asyncio.timeout(30):
        with pytest.raises(asyncio.CancelledError):
            await copy
    # Each reader gave its range up and said so before the copy returned: nothing is still
    # being written into the file.
    assert backend.readers is not None
    assert all(not w.pending for w in backend.readers._workers if w is not None)


@pytest.mark.parametrize("network_filesystem", [False, True])
async def test_on_a_local_filesystem_one_reader_writes_each_file(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, network_filesystem: bool) -> None:
    """Two processes writing one file on a local filesystem take its inode's lock in turn and
    spin for it (8% of a restore's samples with two readers): there the files are spread over
    the readers, all of a file's ranges to one. A network filesystem's client takes writes to
    one file at once: its ranges go to whichever reader is least busy."""
    monkeypatch.setattr(s3reads, "writes_in_parallel", lambda fd: network_filesystem)
    config = dest_config(s3_bucket, seaweedfs.endpoint_url)
    shards = {f"job/00000000000000000001/s{i}.bin": staged(SIZE + i, seed=70 + i)
              for i in range(2)}
    for key, shard in shards.items():
        assert await backends(config).put_file(key, shard.fd, shard.size) == shard.checksum
    backend = with_readers(config)
    assert backend.readers is not None
    key_of: contextvars.ContextVar[str] = contextvars.ContextVar("key")
    by_key: dict[str, set[int]] = {key: set() for key in shards}  # the readers that wrote
    lanes: dict[str, set[int | None]] = {key: set() for key in shards}  # the lanes asked
    real_fetch, real_worker = backend.readers.fetch, backend.readers._worker

    async def fetch(rng: Any, fd: int, **kwargs: Any) -> int:
        key_of.set(rng.key)
        return await real_fetch(rng, fd, **kwargs)

    async def worker(lane: int | None = None) -> Any:
        lanes[key_of.get()].add(lane)
        chosen = await real_worker(lane)
        by_key[key_of.get()].add(chosen.index)
        return chosen

    monkeypatch.setattr(backend.readers, "fetch", fetch)
    monkeypatch.setattr(backend.readers, "_worker", worker)
    await copied_at_once(backend, shards, tmp_path)
    if network_filesystem:  # each range to the least busy reader: no lane asked
        assert all(asked == {None} for asked in lanes.values())
    else:
        assert sorted(len(workers) for workers in by_key.values()) == [1, 1]
        assert set.union(*by_key.values()) == {0, 1}  # the files taken in turn


async def test_readers_import_nothing_from_the_working_directory(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found attacking the readers: started with `python -m`, a reader put the working
    directory first on sys.path, so a restore run in a directory another user can write
    imported their `secrets.py` (run as the restoring user, silently), and a user's own
    `queue.py` broke every reader. Readers start with -P."""
    config = dest_config(s3_bucket, seaweedfs.endpoint_url)
    shard = staged(SIZE, seed=66)
    assert await backends(config).put_file(KEY, shard.fd, SIZE) == shard.checksum
    planted = tmp_path / "shared"
    planted.mkdir()
    marker = tmp_path / "ran"
    for name in ("secrets", "queue", "random"):
        (planted / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'a').write('{name} ')\\nraise ImportError('planted')\\n")
    monkeypatch.chdir(planted)
    backend = with_readers(config)
    assert await _copy(backend, tmp_path / "big") == (SIZE, shard.checksum)
    assert (tmp_path / "big").read_bytes() == shard.data
    assert len(_reader_pids(backend)) == 2
    assert not marker.exists()


async def test_a_cancelled_copy_does_not_wait_long_for_a_stopped_reader(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path,
        proxy: FaultProxy) -> None:
    """Found attacking the readers: with a reader stopped (SIGSTOP), a restore's Ctrl-C
    waited 60 s for it to answer the cancel, as an upload worker's part does for its read
    thread. A reader that does not answer within seconds is killed."""
    backend, copy = await _a_copy_with_a_stalled_range(
        seaweedfs, s3_bucket, backends, with_readers, tmp_path, proxy, staged(SIZE, seed=67))
    assert backend.readers is not None
    stopped = [w.proc for w in backend.readers._workers if w is not None]
    holding = [w.proc for w in backend.readers._workers if w is not None and w.pending]
    assert holding
    for proc in stopped:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        copy.cancel()
        async with asyncio.timeout(30):
            with pytest.raises(asyncio.CancelledError):
                await copy
            for proc in holding:  # killed, not waited for
                assert await proc.wait() == -signal.SIGKILL
    finally:
        for proc in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)


async def test_a_range_whose_reader_hangs_is_read_again_by_a_fresh_one(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], tmp_path: Path,
        proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found attacking the readers: a reader that stopped answering (SIGSTOP) was replaced
    once a range's answer timed out, and the other ranges it held were read again, as a dead
    reader's are; the range that timed out failed the restore. It is read again too."""
    # A range's bound is the pool's answer timeout alone here (not seconds per MiB more).
    monkeypatch.setattr(s3pool, "MIN_RANGE_BYTES_PER_S", 1 << 50)
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    shard = staged(SIZE, seed=73)
    assert await direct.put_file(KEY, shard.fd, shard.size) == shard.checksum
    backend = with_readers(dest_config(s3_bucket, proxy.endpoint_url))
    assert backend.readers is not None
    backend.readers._answer_timeout_s = 5.0
    proxy.inject("stall", match=lambda r: r.method == "GET")
    copy = asyncio.ensure_future(_copy(backend, tmp_path / "big"))
    stopped: list[int] = []
    try:
        async with asyncio.timeout(30):
            while not proxy.faults("stall"):
                await asyncio.sleep(0.02)
        # Every reader holding a range stops answering, the stalled one's among them.
        stopped = [w.proc.pid for w in backend.readers._workers if w is not None and w.pending]
        assert stopped
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        async with asyncio.timeout(120):
            assert await copy == (SIZE, shard.checksum)
    finally:
        copy.cancel()
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert (tmp_path / "big").read_bytes() == shard.data
    assert not set(stopped) & set(_reader_pids(backend)), "the stopped readers were replaced"


async def test_a_range_cut_mid_body_is_read_on_by_its_reader(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any,
        with_readers: Callable[[DestinationConfig], S3Backend], staged: Any, tmp_path: Path,
        proxy: FaultProxy) -> None:
    # Found attacking: one reset range failed a whole restore (test_s3_backend.py has the
    # same in one process); here a reader process reads it on.
    direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    shard = staged(SIZE, seed=95)
    assert await direct.put_file(KEY, shard.fd, shard.size) == shard.checksum
    backend = with_readers(dest_config(s3_bucket, proxy.endpoint_url))
    proxy.inject("truncate", match=lambda r: r.method == "GET")
    out = tmp_path / "restored"
    assert await _copy(backend, out) == (shard.size, shard.checksum)
    assert out.read_bytes() == shard.data
    gets = [r for r in proxy.requests if r.method == "GET"]
    assert [r.fault for r in gets].count("truncate") == 1
    assert len(gets) == 5 + 1  # five ranges, and the one cut read on
    assert _reader_pids(backend), "the ranges were read by reader processes"
