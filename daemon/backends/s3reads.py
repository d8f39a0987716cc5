"""The read side of the S3 destination: listings, small objects, streaming reads (resumed
when cut), and restore's bulk path of parallel ranged GETs. A base of
:class:`~ckptdrain.daemon.backends.s3.S3Backend`, on the plumbing of
:class:`~ckptdrain.daemon.backends.s3client.S3Client`."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, cast

from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import Backend, ObjectInfo
from ckptdrain.daemon.backends.posixfs import writes_in_parallel
from ckptdrain.daemon.backends.s3client import S3Client, unix_time
from ckptdrain.daemon.backends.s3errors import S3Failure, first_cause
from ckptdrain.daemon.backends.s3proof import Listed
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.threads import settled

log = logging.getLogger("ckptdrain.daemon.backends.s3")


class S3Reads(S3Client, Backend):
    """Reading objects (a base of S3Backend)."""

    async def list_dirs(self, prefix: str) -> builtins.list[str]:
        full_prefix = self._full_prefix(prefix)
        names: set[str] = set()
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix,
                                      "Delimiter": "/", "MaxKeys": self.list_page_size}
            if token:
                params["ContinuationToken"] = token
            page = await self._small(f"listing {prefix or '/'}", "list_objects_v2", **params)
            for common in page.get("CommonPrefixes", []):
                name = str(common["Prefix"])[len(full_prefix):].rstrip("/")
                if name:
                    names.add(name)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
        return sorted(names)

    async def get_bytes(self, key: str, *, max_bytes: int = 64 << 20) -> bytes | None:
        full = self._key(key)
        what = f"reading {key}"
        try:
            answer = await self._small(what, "get_object", read_max=max_bytes,
                                       Bucket=self.bucket, Key=full)
        except S3Failure as exc:
            if exc.code == "NoSuchKey" or (exc.status == 404 and exc.code != "NoSuchBucket"):
                return None
            raise
        data: bytes = answer["Body"]
        return data

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        found: builtins.list[ObjectInfo] = []
        async for key, item in self._listed(prefix):
            found.append(ObjectInfo(key=key, size=int(item["Size"]),
                                    modified=unix_time(item.get("LastModified"))))
        found.sort(key=lambda info: info.key)
        return found

    async def sizes_and_etags(self, prefix: str, *, limit: int) -> dict[str, Listed] | None:
        """Every key under ``prefix`` with its size, ETag and time (the commit's proof,
        s3proof.py); None once more than ``limit`` keys are found, without reading on."""
        found: dict[str, Listed] = {}
        async with contextlib.aclosing(self._listed(prefix)) as listed:
            async for key, item in listed:
                if len(found) == limit:
                    return None
                found[key] = Listed(int(item["Size"]), str(item.get("ETag") or ""),
                                    unix_time(item.get("LastModified")))
        return found

    async def _listed(self, prefix: str) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """(key, ListObjectsV2 entry) of every object under ``prefix``, page by page."""
        full_prefix = self._full_prefix(prefix)
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix,
                                      "MaxKeys": self.list_page_size}
            if token:
                params["ContinuationToken"] = token
            page = await self._small(f"listing {prefix or '/'}", "list_objects_v2", **params)
            for item in page.get("Contents", []):
                full_key = str(item["Key"])
                if full_key.endswith("/"):
                    continue  # a "directory" marker some stores list
                yield self._strip_root(full_key), item
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break

    async def read_chunks(self, key: str, *, chunk_bytes: int = 8 << 20) -> AsyncIterator[bytes]:
        """The object's bytes in chunks of ``chunk_bytes`` (the last shorter). A stream cut
        mid-way is resumed with a ranged GET pinned to the same ETag, up to max_attempts."""
        full = self._key(key)
        what = f"reading {key}"
        offset = 0
        etag: str | None = None
        resumes = 0
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
            if etag is not None:
                params.update(Range=f"bytes={offset}-", IfMatch=etag)
            try:
                answer = await self._call(what, "get_object", **params)
            except S3Failure as exc:
                if exc.code == "InvalidRange" and etag is not None:
                    return  # cut right after the last byte: nothing was left to read
                if exc.code == "NoSuchKey":
                    raise S3Failure(f"{key} does not exist at {self.uri}; it was never "
                                    "written or has been deleted", transient=False,
                                    kind="not_found", code=exc.code) from exc
                if exc.code == "PreconditionFailed" and etag is not None:
                    raise self._replaced(key, exc) from exc
                raise
            etag = str(answer.get("ETag") or "") or None
            try:
                async with answer["Body"] as body:
                    pieces: builtins.list[bytes] = []
                    held = 0
                    while True:
                        with self._translating(what):
                            piece = await body.read(chunk_bytes - held)
                        if not piece:
                            break
                        pieces.append(piece)
                        held += len(piece)
                        if held >= chunk_bytes:
                            chunk = b"".join(pieces)
                            pieces.clear()
                            held = 0
                            offset += len(chunk)
                            yield chunk
                    if pieces:
                        chunk = b"".join(pieces)
                        offset += len(chunk)
                        yield chunk
                return
            except S3Failure as exc:
                if not exc.transient or resumes + 1 >= self._max_attempts or etag is None:
                    raise
                resumes += 1
                log_event(log, logging.INFO, "s3_read_resumed", key=key, offset=offset,
                          error=str(exc))

    def _replaced(self, key: str, exc: S3Failure) -> S3Failure:
        """A read pinned to the ETag it began with (If-Match) found another object there: the
        key was written again mid-read. Worth reading again (it is checked against the
        manifest then); the write-side advice ("another writer got there first") fit badly."""
        return S3Failure(f"{key} was replaced at {self.uri} while it was read (its ETag "
                         "changed); read it again: what it holds now is checked against the "
                         "manifest", transient=True, kind="conflict", code=exc.code,
                         status=exc.status)

    async def copy_into(
        self, key: str, out_fd: int, *, algo: str = checksums.ALGO,
        progress: Callable[[int], None] | None = None, owned: bool = False,
        expected_size: int | None = None,
    ) -> tuple[int, str]:
        """Restore's bulk path: a large object is fetched as ``part_size_bytes`` ranges,
        ``max_concurrency`` at a time (one connection each, as the upload was), each written at
        its offset and checksummed in a worker thread; the ranges' CRC64NVMEs are combined. A
        format 1 (sha256) shard, which must be hashed in order, is read as one stream, and so
        is an object whose ``expected_size`` is at most one part: without the HEAD a ranged
        read needs first (its size and ETag), a request per object that restoring 256 x 1 MiB
        spent most of its time on (``owned`` is unused: the ranges are checksummed from the
        buffers they arrive in)."""
        del owned
        full = self._key(key)
        head = None
        if algo == checksums.ALGO and (expected_size is None
                                       or expected_size > self._part_size):
            head = await self._head(key, full)
            if head is None:
                raise S3Failure(f"{key} does not exist at {self.uri}; it was never written or "
                                "has been deleted", transient=False, kind="not_found",
                                code="NoSuchKey")
        size = 0 if head is None else int(head.get("ContentLength") or 0)
        if head is None or size <= self._part_size:  # one stream: no HEAD asked, or small
            return await super().copy_into(key, out_fd, algo=algo, progress=progress)
        etag = str(head.get("ETag") or "")
        ranges = [(offset, min(self._part_size, size - offset))
                  for offset in range(0, size, self._part_size)]
        crcs: dict[int, int] = {}
        loop = asyncio.get_running_loop()
        # On a local filesystem, one write into the file at a time: the kernel serializes
        # buffered writes to one file anyway (the inode's lock), and threads queued there spin
        # for it, a tenth of a restore's CPU in perf. Queued here, a range's write waits
        # without burning a core. A network filesystem's client takes them at once.
        writers: contextlib.AbstractAsyncContextManager[Any] = (
            contextlib.nullcontext() if writes_in_parallel(out_fd) else asyncio.Lock())

        async def write(pieces: builtins.list[bytes], at: int, crc: int) -> int:
            if self.writes_on_loop:
                # The command's loop serves this restore alone: writing the batch here saves
                # a thread hop per batch (and that thread's wait for the GIL), 0.3 user CPU s
                # per 4 GiB, and was faster in three of four side-by-side series (a write
                # never waited long here: see docs/benchmarks.md).
                return _write_at(out_fd, pieces, at, crc)
            async with writers:
                # Waited for even when cancelled: no thread may write to out_fd once we return.
                return await settled(loop.run_in_executor(None, _write_at, out_fd, pieces, at,
                                                          crc))

        async def fetch(offset: int, length: int) -> None:
            async with self.ranges:
                what = f"reading {key} at byte {offset}"
                try:
                    answer = await self._call(what, "get_object", Bucket=self.bucket, Key=full,
                                              Range=f"bytes={offset}-{offset + length - 1}",
                                              IfMatch=etag)
                except S3Failure as exc:
                    if exc.code == "PreconditionFailed":
                        raise self._replaced(key, exc) from exc
                    raise
                crc, written = 0, 0
                # The network's chunks as they arrived, written RANGE_WRITE_BYTES at a time
                # with one pwritev: letting aiohttp join them and then gathering them into a
                # buffer copied every byte twice more on the event loop's thread.
                pieces: builtins.list[bytes] = []
                held = 0
                async with answer["Body"] as body:
                    next_piece = _piece_reader(body)
                    while True:
                        with self._translating(what):
                            piece = await next_piece()
                        if not piece:
                            break
                        if written + held + len(piece) > length:
                            raise S3Failure(f"{what} at {self.uri}: more than the {length} "
                                            "bytes of the range came back; the server sent a "
                                            "wrong answer, retry", transient=True, kind="io")
                        pieces.append(piece)
                        held += len(piece)
                        if held >= RANGE_WRITE_BYTES or len(pieces) >= MAX_PIECES:
                            crc = await write(pieces, offset + written, crc)
                            written, batch, held, pieces = written + held, held, 0, []
                            if progress is not None:
                                progress(batch)
                    if pieces:
                        crc = await write(pieces, offset + written, crc)
                        written += held
                        if progress is not None:
                            progress(held)
                if written != length:
                    raise S3Failure(f"{what} at {self.uri}: {written} bytes came back for a "
                                    f"range of {length}; the answer was cut short, retry",
                                    transient=True, kind="io")
                crcs[offset] = crc

        try:
            async with asyncio.TaskGroup() as tg:
                for offset, length in ranges:
                    tg.create_task(fetch(offset, length))
        except BaseExceptionGroup as group:
            raise first_cause(group) from None
        return size, checksums.combine([(crcs[offset], length) for offset, length in ranges])


# A range read back is written to the file this much at a time: a small batch, likelier to be
# in the CPU's cache still when the write copies it into the page cache. Restoring 1 GiB from
# SeaweedFS with 8 MiB took 3.9-4.3 CPU s in the kernel and 340 MB of resident memory here,
# with 1 MiB 1.3-3.7 s and 115 MB. Restoring 4 GiB, 256 KiB took 2.7-4.6 s of system CPU
# against 4.4-6.8 s with 1 MiB, and 64 KiB gained nothing more (docs/benchmarks.md).
RANGE_WRITE_BYTES = 256 << 10
# A batch is written early once it holds this many pieces (a server sending tiny chunks): one
# pwritev takes at most IOV_MAX (1024) buffers.
MAX_PIECES = 256


def _piece_reader(body: Any) -> Callable[[], Awaitable[bytes]]:
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


def _write_at(fd: int, pieces: builtins.list[bytes], offset: int, crc: int) -> int:
    """Write ``pieces`` one after another at ``offset`` of ``fd``; the CRC64NVME continued
    from ``crc`` over them (a worker thread's)."""
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
