"""Restore's ranged GETs write the network's chunks as they arrived, in batches with one
pwritev, never gathered into a buffer first (each gather was another copy of every byte on the
event loop's thread). Against a small HTTP server speaking just enough S3 (HEAD, ranged GET)
that sends one range as many tiny writes, the way a slow or hostile server can."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.streams import StreamReader

from ckptdrain.daemon import checksums, cli_destination
from ckptdrain.daemon.backends import s3ranges
from ckptdrain.daemon.backends.base import BackendError, open_backend
from ckptdrain.daemon.config import DestinationConfig

MiB = 1 << 20
PART = 5 * MiB
DATA = random.Random(11).randbytes(2 * PART + 4321)
TRICKLED = 300  # tiny writes that make up the start of the second range


async def _server(answer: str = "range") -> tuple[web.AppRunner, int, list[str]]:
    """``answer``: "range" (what S3 does), "whole" (the whole object, as a server that
    ignores Range), "short" (the range less its last 100 bytes), "shifted" (the range's
    length from 4096 bytes before where it was asked), "claims_more" (the range, whose
    Content-Length said 10 bytes more, then the connection closed), "replaced" (412: the
    ETag the read is pinned to is no longer the object's)."""
    ranges: list[str] = []

    async def head(request: web.Request) -> web.Response:
        return web.Response(headers={"Content-Length": str(len(DATA)), "ETag": '"e1"'})

    async def get(request: web.Request) -> web.StreamResponse:
        spec = request.headers["Range"]
        ranges.append(spec)
        start, end = (int(x) for x in spec.removeprefix("bytes=").split("-"))
        if answer == "whole":
            return web.Response(body=DATA, headers={"ETag": '"e1"'})
        if answer == "replaced":  # the object was written again since the HEAD
            return web.Response(status=412, content_type="application/xml", body=(
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>PreconditionFailed</Code>"
                b"<Message>At least one of the pre-conditions you specified did not hold"
                b"</Message></Error>"))
        if answer == "short":
            end -= 100
        if answer == "shifted" and start >= 4096:
            start, end = start - 4096, end - 4096
        claimed = end - start + 1 + (10 if answer == "claims_more" else 0)
        resp = web.StreamResponse(status=206, headers={
            "Content-Range": f"bytes {start}-{end}/{len(DATA)}", "ETag": '"e1"',
            "Content-Length": str(claimed)})
        if answer == "claims_more":
            resp.force_close()  # the connection ends after the bytes, 10 short of the claim
        await resp.prepare(request)
        at = start
        if start == PART:
            for _ in range(TRICKLED):
                await resp.write(DATA[at:at + 7])
                at += 7
                await asyncio.sleep(0.002)  # each write its own segment, its own chunk
        while at <= end:
            step = min(end + 1 - at, 300_000)
            await resp.write(DATA[at:at + step])
            at += step
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("HEAD", "/bucket/prefix/{key:.*}", head)
    app.router.add_get("/bucket/prefix/{key:.*}", get, allow_head=False)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1], ranges


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


async def _restored(tmp_path: Path, *, answer: str = "range", max_concurrency: int = 2,
                    max_attempts: int = 5, writes_on_loop: bool = False,
                    ) -> tuple[tuple[int, str], bytes, list[str]]:
    """``copy_into`` of big.bin from :func:`_server` into a new file: what it returned, the
    file's bytes and the ranges the server was asked for."""
    runner, port, ranges = await _server(answer)
    config = DestinationConfig(uri="s3://bucket/prefix", endpoint_url=f"http://127.0.0.1:{port}",
                               region="us-east-1", addressing_style="path",
                               part_size_bytes=PART, max_concurrency=max_concurrency,
                               max_attempts=max_attempts)
    backend = open_backend(config, "node", writes_on_loop=writes_on_loop)
    out = tmp_path / "restored"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        got = await backend.copy_into("job/00000000000000000001/big.bin", fd)
    finally:
        os.close(fd)
        await backend.aclose()
        await runner.cleanup()
    return got, out.read_bytes(), ranges


@pytest.mark.asyncio
async def test_ranges_are_written_from_the_chunks_as_they_arrived(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3ranges, "MAX_PIECES", 8)
    batches: list[list[Any]] = []
    real_write_at = s3ranges.write_at

    def recording(fd: int, pieces: list[bytes], offset: int, crc: int) -> int:
        batches.append(list(pieces))
        return real_write_at(fd, pieces, offset, crc)

    monkeypatch.setattr(s3ranges, "write_at", recording)
    got, written, ranges = await _restored(tmp_path)
    assert got == (len(DATA), checksums.of_bytes(DATA))
    assert written == DATA
    assert sorted(ranges) == sorted(f"bytes={o}-{min(o + PART, len(DATA)) - 1}"
                                    for o in range(0, len(DATA), PART))
    # What aiohttp received: bytes objects, not copied into a buffer of ours, at most
    # MAX_PIECES to a pwritev and about RANGE_WRITE_BYTES to a batch.
    assert all(type(p) is bytes for batch in batches for p in batch)
    assert max(len(batch) for batch in batches) == 8
    assert all(sum(map(len, batch)) < s3ranges.RANGE_WRITE_BYTES + 300_000 for batch in batches)
    assert sum(1 for batch in batches for p in batch if len(p) == 7) >= TRICKLED // 2


def test_a_batch_is_written_in_order_with_the_checksum_of_its_bytes(tmp_path: Path) -> None:
    rng = random.Random(5)
    pieces = [rng.randbytes(rng.choice([0, 1, 7, 4096, 65537])) for _ in range(200)]
    joined = b"".join(pieces)
    head = rng.randbytes(333)
    path = tmp_path / "f"
    path.write_bytes(head)
    fd = os.open(path, os.O_WRONLY)
    try:
        crc = s3ranges.write_at(fd, pieces, len(head), checksums.crc64nvme_int(head))
    finally:
        os.close(fd)
    assert path.read_bytes() == head + joined
    assert crc == checksums.crc64nvme_int(head + joined)
    assert os.sysconf("SC_IOV_MAX") >= s3ranges.MAX_PIECES


@pytest.mark.asyncio
async def test_chunks_waiting_together_are_handed_over_one_by_one_never_joined() -> None:
    """When the writes fall behind the network several chunks wait in aiohttp's buffer:
    ``readany`` would join them all into new bytes (one more copy of each); each is handed
    over as the very object that arrived."""
    loop = asyncio.get_running_loop()
    content = StreamReader(BaseProtocol(loop), 1 << 20, loop=loop)
    fed = [b"a" * 7, b"b" * 70_000, b"c" * 3]
    for chunk in fed:
        content.feed_data(chunk)
    content.feed_eof()

    class Body:
        raw_stream = SimpleNamespace(content=content)

    next_piece = s3ranges.piece_reader(Body())
    got = [await next_piece() for _ in range(len(fed) + 1)]
    assert got == [*fed, b""]
    assert all(g is f for g, f in zip(got, fed, strict=False))


@pytest.mark.asyncio
async def test_a_body_that_is_not_aiohttps_is_read_a_batch_at_a_time() -> None:
    sizes: list[int] = []

    class Body:
        def __init__(self) -> None:
            self.left = 3 * s3ranges.RANGE_WRITE_BYTES + 5

        async def read(self, n: int) -> bytes:
            sizes.append(n)
            take = min(n, self.left)
            self.left -= take
            return b"x" * take

    next_piece = s3ranges.piece_reader(Body())
    got = [len(await next_piece()) for _ in range(5)]
    assert got == [s3ranges.RANGE_WRITE_BYTES] * 3 + [5, 0]
    assert set(sizes) == {s3ranges.RANGE_WRITE_BYTES}


@pytest.mark.asyncio
@pytest.mark.parametrize(("answer", "message"), [
    ("whole", "answered the range (none: the whole object?)"),
    ("short", f"answered the range bytes 0-{PART - 101}/"),
    # Found attacking the resume: written at the offset asked, another range's bytes were
    # caught only by the object's checksum and reported as a damaged shard, for good.
    ("shifted", f"answered the range bytes {PART - 4096}-"),
])
async def test_a_wrong_sized_answer_fails_the_copy_as_transient(
        tmp_path: Path, answer: str, message: str) -> None:
    with pytest.raises(BackendError) as caught:
        await _restored(tmp_path, answer=answer, max_attempts=1)
    assert caught.value.transient
    assert message in str(caught.value)
    assert "s3://bucket/prefix" in str(caught.value)


@pytest.mark.asyncio
async def test_a_range_whose_answer_fails_after_its_last_byte_is_not_asked_again(
        tmp_path: Path) -> None:
    # Found attacking the resume: every byte came, then the answer failed (its Content-Length
    # said more); reading on asked for a range starting after its end, which the server
    # refused, and the restore failed for good.
    got, data, ranges = await _restored(tmp_path, answer="claims_more")
    assert data == DATA
    assert got == (len(DATA), checksums.of_bytes(DATA))
    for spec in ranges:
        start, end = (int(x) for x in spec.removeprefix("bytes=").split("-"))
        assert start <= end, ranges


@pytest.mark.asyncio
@pytest.mark.parametrize("network_filesystem", [False, True])
async def test_one_file_is_written_by_one_thread_at_a_time_on_a_local_filesystem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, network_filesystem: bool) -> None:
    """Ranges of one object arrive in parallel, but a local filesystem takes the file's lock
    for every buffered write, and threads queued on it spin: a tenth of a restore's CPU in
    ``perf``. There the ranges' writes into one file are queued on the event loop instead;
    a network filesystem's client (Lustre, NFS) takes them at once. The first write holds
    its thread until another write into the file starts (or 2 s pass): any write that may
    run beside it does."""
    monkeypatch.setattr(s3ranges, "writes_in_parallel", lambda fd: network_filesystem)
    guard = threading.Lock()
    writing = 0
    most = 0
    second = threading.Event()
    calls = 0
    real_write_at = s3ranges.write_at

    def recording(fd: int, pieces: list[bytes], offset: int, crc: int) -> int:
        nonlocal writing, most, calls
        with guard:
            calls += 1
            first = calls == 1
            writing += 1
            most = max(most, writing)
            if writing > 1:
                second.set()
        try:
            if first:
                second.wait(2.0)
            return real_write_at(fd, pieces, offset, crc)
        finally:
            with guard:
                writing -= 1

    monkeypatch.setattr(s3ranges, "write_at", recording)
    got, written, ranges = await _restored(tmp_path, max_concurrency=3)
    assert got == (len(DATA), checksums.of_bytes(DATA))
    assert written == DATA
    assert len(ranges) == 3
    assert (most > 1) == network_filesystem


@pytest.mark.asyncio
@pytest.mark.parametrize("writes_on_loop", [True, False])
async def test_the_commands_restore_writes_on_its_loop_the_daemons_in_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes_on_loop: bool) -> None:
    """Written by the thread that read it, a batch costs no thread hop (nor that thread's wait
    for the GIL): 0.3 user CPU s less per 4 GiB here. Only a process whose loop serves nothing
    else (the ``ckptdrain`` command) writes there; the daemon's loop never does."""
    threads: set[int] = set()
    real_write_at = s3ranges.write_at

    def recording(fd: int, pieces: list[bytes], offset: int, crc: int) -> int:
        threads.add(threading.get_ident())
        return real_write_at(fd, pieces, offset, crc)

    monkeypatch.setattr(s3ranges, "write_at", recording)
    got, written, _ = await _restored(tmp_path, max_concurrency=3,
                                      writes_on_loop=writes_on_loop)
    assert got == (len(DATA), checksums.of_bytes(DATA))
    assert written == DATA
    assert threads
    assert (threads == {threading.get_ident()}) == writes_on_loop


def test_the_command_opens_its_destination_to_write_on_its_loop(tmp_path: Path) -> None:
    ns = SimpleNamespace(config=None)
    backend = cli_destination._backend(ns, "s3://bucket/prefix")
    try:
        assert backend.writes_on_loop
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.asyncio
async def test_an_object_replaced_mid_read_says_so_and_is_worth_reading_again(
        tmp_path: Path) -> None:
    # A range pinned to the object's ETag (If-Match) got 412: the reader was told "another
    # writer got there first or is writing the same key", advice for a write, as permanent.
    with pytest.raises(BackendError) as caught:
        await _restored(tmp_path, answer="replaced", max_attempts=1)
    assert caught.value.transient
    assert "was replaced at s3://bucket/prefix while it was read" in str(caught.value)


@pytest.mark.parametrize(("readers", "cores", "expected"), [
    (None, 2, 0), (None, 7, 0), (None, 8, 2), (None, 20, 5), (None, 128, 8),
    (0, 64, 0), (3, 2, 3)])
def test_restore_starts_readers_by_the_cores_or_as_told(
        monkeypatch: pytest.MonkeyPatch, readers: int | None, cores: int, expected: int) -> None:
    """A quarter of the cores, at most 8, none below two (on a few cores a reader only adds
    CPU); ``--readers N`` wins."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    ns = SimpleNamespace(config=None, readers=-1 if readers is None else readers)
    backend = cli_destination._backend(ns, "s3://bucket/prefix")
    try:
        if expected == 0:
            assert backend.readers is None
        else:
            assert backend.readers._count == expected
    finally:
        asyncio.run(backend.aclose())
