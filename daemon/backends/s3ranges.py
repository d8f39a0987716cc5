"""One byte range of an S3 object read into a file: restore's bulk path (S3Reads.copy_into),
run by the restoring process itself or by a reader process (s3worker.py, ``op: "range"``).

A ranged GET pinned to the object's ETag (``If-Match``: an object written again mid-restore
fails as ``conflict`` rather than mix two versions) is written at its offset of the file as
the network's chunks arrive, in batches of one ``pwritev`` each, and its CRC64NVME taken from
the same chunks; the caller combines the ranges' checksums into the object's.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends import s3rangeget
from ckptdrain.daemon.backends.posixlayout import writes_in_parallel
from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.threads import settled

log = logging.getLogger("ckptdrain.daemon.backends.s3")

if TYPE_CHECKING:
    from ckptdrain.daemon.backends.s3client import S3Client

# A range read back is written to the file this much at a time: a small batch, likelier to be
# in the CPU's cache still when the write copies it into the page cache. Restoring 1 GiB from
# SeaweedFS with 8 MiB took 3.9-4.3 CPU s in the kernel and 340 MB of resident memory here,
# with 1 MiB 1.3-3.7 s and 115 MB. Restoring 4 GiB, 256 KiB took 2.7-4.6 s of system CPU
# against 4.4-6.8 s with 1 MiB, and 64 KiB gained nothing more (docs/benchmarks.md).
RANGE_WRITE_BYTES = 256 << 10
# A batch is written early once it holds this many pieces (a server sending tiny chunks): one
# pwritev takes at most IOV_MAX (1024) buffers.
MAX_PIECES = 256

# An object this large is read by the backend's reader processes, where it has some (the
# ``ckptdrain restore`` command): starting one costs about 0.3 CPU s (its imports and
# botocore's model), which a smaller object, read in a quarter of a second or less, would not
# pay back.
READERS_FROM = 256 << 20

# The slowest a range may come, over all its attempts: a range gets the time its attempts may
# take (max_attempts x (connect + read timeouts)) and this much more per byte. A server that
# trickles (a byte now and then, so no read ever times out) held a restore for good: 64 MiB at
# 512 bytes/s is a day and a half (found attacking restore through a proxy). A reader
# process's range is bounded the same way, and a little later (s3pool), so the range's own
# error comes first.
MIN_RANGE_BYTES_PER_S = 1 << 20

# Writes one batch of pieces at an offset, continuing a CRC64NVME: the new one.
Writer = Callable[[builtins.list[bytes], int, int], Awaitable[int]]


class LoopWriter:
    """A :data:`Writer` that writes on the event loop's own thread; its ranges are read
    straight into a buffer of their own where the endpoint allows (s3rangeget.py), since
    each batch is written from that buffer before the next is read into it."""

    def __init__(self, out_fd: int) -> None:
        self.out_fd = out_fd

    async def __call__(self, pieces: builtins.list[bytes], at: int, crc: int) -> int:
        return write_at(self.out_fd, pieces, at, crc)

    def now(self, pieces: Sequence[bytes | memoryview], at: int, crc: int) -> int:
        return write_at(self.out_fd, pieces, at, crc)


@dataclass(frozen=True, slots=True)
class Range:
    """``length`` bytes of the object ``full`` (the shard's ``key``) from ``offset``, read
    only while the object's ETag is still ``etag``."""

    key: str
    full: str
    offset: int
    length: int
    etag: str


def replaced(uri: str, key: str, exc: S3Failure) -> S3Failure:
    """A read pinned to the ETag it began with (If-Match) found another object there: the
    key was written again mid-read. Worth reading again (it is checked against the manifest
    then); the write-side advice ("another writer got there first") fit badly."""
    return S3Failure(f"{key} was replaced at {uri} while it was read (its ETag changed); read "
                     "it again: what it holds now is checked against the manifest",
                     transient=True, kind="conflict", code=exc.code, status=exc.status)


def writer(out_fd: int, *, on_loop: bool) -> Writer:
    """How the ranges of one file are written. ``on_loop``: by the event loop's own thread
    (for a process whose loop serves this restore alone: no thread hop per batch, nor that
    thread's wait for the GIL, 0.3 user CPU s per 4 GiB, and faster in three of four
    side-by-side series). Otherwise in a worker thread, and on a local filesystem one write
    into the file at a time: the kernel serializes buffered writes to one file anyway (the
    inode's lock), and threads queued there spin for it, a tenth of a restore's CPU in perf.
    Queued here, a range's write waits without burning a core. A network filesystem's
    client takes them at once."""
    if on_loop:
        return LoopWriter(out_fd)
    loop = asyncio.get_running_loop()
    writers: contextlib.AbstractAsyncContextManager[Any] = (
        contextlib.nullcontext() if writes_in_parallel(out_fd) else asyncio.Lock())

    async def in_thread(pieces: builtins.list[bytes], at: int, crc: int) -> int:
        async with writers:
            # Waited for even when cancelled: no thread may write to out_fd once we return.
            return await settled(loop.run_in_executor(None, write_at, out_fd, pieces, at, crc))

    return in_thread


async def fetch_range(client: S3Client, rng: Range, write: Writer,
                      progress: Callable[[int], None] | None = None) -> int:
    """GET ``rng`` and write it with ``write`` at its offset: its CRC64NVME. ``progress`` is
    called with each batch's size once written. An answer cut short (a reset, a timeout
    mid-body) is read on from the first byte not yet written, still pinned to the ETag, up
    to ``max_attempts`` times in all: one reset anywhere failed a whole restore of tens of GB
    (found attacking with a proxy that resets a range once)."""
    done = _Done()
    resumes = 0
    async with at_least_min_rate(client, f"reading {rng.key}", rng.length, done):
        while not await _attempt(client, rng, write, progress, done, resumes):
            resumes += 1
    return done.crc


@contextlib.asynccontextmanager
async def at_least_min_rate(client: S3Client, what: str, length: int,
                            done: _Done | None = None) -> AsyncIterator[None]:
    """Bound a read of ``length`` bytes (every attempt of it) by the time its attempts may
    take, max_attempts x (connect + read timeouts), and 1 s more per MIN_RANGE_BYTES_PER_S;
    past it, a transient ``timeout`` failure saying so (``done``: how far it got)."""
    config = client._config
    limit_s = (client._max_attempts * (float(config.connect_timeout_s)
                                       + float(config.read_timeout_s))
               + length / MIN_RANGE_BYTES_PER_S)
    try:
        async with asyncio.timeout(limit_s) as scope:
            yield
    except TimeoutError as exc:
        if not scope.expired():
            raise
        got = "" if done is None else f"{done.written} of "
        raise S3Failure(
            f"{what} at {client.uri}: {got}its {length} bytes did not come in {limit_s:.0f} "
            f"s, at less than {MIN_RANGE_BYTES_PER_S >> 20} MiB/s: the server or the network "
            "to it is failing, or the writes into the file it is read into are stuck (a hung "
            "filesystem); retry, or read from another endpoint", transient=True,
            kind="timeout") from exc


async def _attempt(client: S3Client, rng: Range, write: Writer,
                   progress: Callable[[int], None] | None, done: _Done, resumes: int) -> bool:
    """One GET of what of ``rng`` is not written yet: True once all of it is, False when
    its answer was cut short and is worth reading on (``resumes`` so far); raises when not."""
    try:
        if isinstance(write, LoopWriter):
            await _read_here_or_on(client, rng, write, progress, done)
        else:
            await _read_on(client, rng, write, progress, done)
        return True
    except S3Failure as exc:
        if done.written == rng.length:
            # Every byte came, and then the answer failed (a Content-Length that claimed
            # more): there is nothing left to ask for, and the ask was an invalid range
            # that failed the restore for good (found attacking the resume).
            return True
        # A conflict (the object replaced) or a permanent error is not read again here.
        if (not exc.transient or exc.kind == "conflict"
                or resumes + 1 >= client._max_attempts):
            raise
        log_event(log, logging.INFO, "s3_read_resumed", key=rng.key,
                  offset=rng.offset + done.written, error=str(exc))
        return False


@dataclass(slots=True)
class _Done:
    """What a range's reads have written so far, and its CRC64NVME."""

    written: int = 0
    crc: int = 0


async def _read_here_or_on(client: S3Client, rng: Range, write: LoopWriter,
                           progress: Callable[[int], None] | None, done: _Done) -> None:
    """What of ``rng`` is not written yet, read into a buffer of its own (s3rangeget.py);
    through aiobotocore where that read did not start (an answer that is not the plain
    one: its typed error, renewed credentials and retries are aiobotocore's)."""
    try:
        await s3rangeget.read_on(client, rng.full, rng.offset + done.written,
                                 rng.length - done.written, rng.etag, write.now, progress, done)
    except s3rangeget.NotPlain as exc:  # (raised before any byte of it was written)
        log.debug("range of %s through aiobotocore: %s", rng.key, exc)
        await _read_on(client, rng, write, progress, done)


async def _read_on(client: S3Client, rng: Range, write: Writer,
                   progress: Callable[[int], None] | None, done: _Done) -> None:
    """One GET of what of ``rng`` is not written yet, written on as it arrives."""
    start = rng.offset + done.written
    what = f"reading {rng.key} at byte {start}"
    try:
        answer = await client._call(what, "get_object", Bucket=client.bucket, Key=rng.full,
                                    Range=f"bytes={start}-{rng.offset + rng.length - 1}",
                                    IfMatch=rng.etag)
    except S3Failure as exc:
        if exc.code == "PreconditionFailed":
            raise replaced(client.uri, rng.key, exc) from exc
        if exc.code == "NoSuchKey":
            # Deleted since its HEAD (retention, mid-restore): said as every read says it, not
            # with the advice to check the bucket and prefix that a missing key gets.
            raise S3Failure(f"{rng.key} does not exist at {client.uri}; it was never written "
                            "or has been deleted", transient=False, kind="not_found",
                            code=exc.code, status=exc.status) from exc
        raise
    asked = f"bytes {start}-{rng.offset + rng.length - 1}/"
    answered = str(answer.get("ContentRange") or "")
    # The network's chunks as they arrived, written RANGE_WRITE_BYTES at a time with one
    # pwritev: letting aiohttp join them and then gathering them into a buffer copied every
    # byte twice more on the event loop's thread.
    pieces: builtins.list[bytes] = []
    held = 0

    async def flush() -> None:
        nonlocal pieces, held
        if pieces:
            done.crc = await write(pieces, rng.offset + done.written, done.crc)
            done.written += held
            if progress is not None:
                progress(held)
        pieces, held = [], 0

    async with answer["Body"] as body:
        if not answered.startswith(asked):
            # Written where they were asked for, another range's bytes would only be caught by
            # the object's checksum, and reported as a damaged shard (found attacking).
            raise S3Failure(f"{what} at {client.uri}: the server answered the range "
                            f"{answered or '(none: the whole object?)'} for {asked}...; it "
                            "sent a wrong answer, retry", transient=True, kind="io")
        next_piece = piece_reader(body)
        while True:
            try:
                with client._translating(what):
                    piece = await next_piece()
            except S3Failure:
                # What arrived before the answer failed is the range's, in order: kept, so
                # that reading on asks only for the rest (dropped, a range whose answer
                # failed after its last byte was asked for again, and failed the same way,
                # until max_attempts: found attacking the resume).
                await flush()
                raise
            if not piece:
                break
            if done.written + held + len(piece) > rng.length:
                raise S3Failure(f"{what} at {client.uri}: more than the {rng.length} bytes of "
                                "the range came back; the server sent a wrong answer, retry",
                                transient=True, kind="io")
            pieces.append(piece)
            held += len(piece)
            if held >= RANGE_WRITE_BYTES or len(pieces) >= MAX_PIECES:
                await flush()
        await flush()
    if done.written != rng.length:
        raise S3Failure(f"{what} at {client.uri}: {done.written} bytes came back for a range of "
                        f"{rng.length}; the answer was cut short, retry", transient=True,
                        kind="io")


def piece_reader(body: Any) -> Callable[[], Awaitable[bytes]]:
    """What returns the body's next chunk as the network delivered it (b"" at its end).
    aiohttp's ``readchunk`` hands over one chunk it holds as it is; ``read(n)`` joins or
    slices chunks into new bytes, and so does ``readany`` once more than one is waiting (when
    the range's writes fall behind the network). A body that is not aiohttp's is read 1 MiB
    at a time."""
    content = getattr(getattr(body, "raw_stream", None), "content", None)
    readchunk = getattr(content, "readchunk", None)
    if readchunk is None:
        return lambda: cast("Awaitable[bytes]", body.read(RANGE_WRITE_BYTES))

    async def next_piece() -> bytes:
        while True:
            data, end_of_http_chunk = await readchunk()
            # (b"", True) is the end of one HTTP chunk of a chunked body, not of the body.
            if data or not end_of_http_chunk:
                return cast(bytes, data)

    return next_piece


def write_at(fd: int, pieces: Sequence[bytes | memoryview], offset: int, crc: int) -> int:
    """Write ``pieces`` one after another at ``offset`` of ``fd``; the CRC64NVME continued
    from ``crc`` over them."""
    views = [memoryview(p) for p in pieces if p]
    at = offset
    while views:
        n = os.pwritev(fd, views, at)
        if n <= 0:
            raise OSError(errno.EIO, f"pwritev wrote nothing at byte {at}")
        at += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    digest = checksums.Crc64nvme(crc)
    for piece in pieces:
        digest.update(piece)
    return digest.crc
