"""The read side of the S3 destination: listings, small objects, streaming reads (resumed
when cut), and restore's bulk path of parallel ranged GETs. A base of
:class:`~ckptdrain.daemon.backends.s3.S3Backend`, on the plumbing of
:class:`~ckptdrain.daemon.backends.s3client.S3Client`."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from ckptdrain.client.manifest import MAX_RECORD_BYTES
from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import Backend, ObjectInfo
from ckptdrain.daemon.backends.posixlayout import writes_in_parallel
from ckptdrain.daemon.backends.s3client import S3Client, unix_time
from ckptdrain.daemon.backends.s3errors import S3Failure, first_cause
from ckptdrain.daemon.backends.s3proof import Listed
from ckptdrain.daemon.backends.s3ranges import (
    READERS_FROM,
    Range,
    at_least_min_rate,
    fetch_range,
    replaced,
    writer,
)
from ckptdrain.daemon.logs import log_event

log = logging.getLogger("ckptdrain.daemon.backends.s3")


class S3Reads(S3Client, Backend):
    """Reading objects (a base of S3Backend)."""

    async def list_dirs(self, prefix: str) -> builtins.list[str]:
        full_prefix = self._full_prefix(prefix)
        names: set[str] = set()
        files: set[str] = set()
        paging = _Paging(f"listing {prefix or '/'} at {self.uri}")
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix,
                                      "Delimiter": "/", "MaxKeys": self.list_page_size}
            if paging.token:
                params["ContinuationToken"] = paging.token
            page = await self._small(f"listing {prefix or '/'}", "list_objects_v2", **params)
            # Progress is any entry not listed before: a page may hold only objects directly
            # under the prefix (no directories) and still advance.
            before = len(names) + len(files)
            for common in page.get("CommonPrefixes", []):
                name = str(common["Prefix"])[len(full_prefix):].rstrip("/")
                if name:
                    names.add(name)
            files.update(str(item["Key"]) for item in page.get("Contents", []))
            if not paging.next(page, new=len(names) + len(files) > before):
                break
        return sorted(names)

    async def get_bytes(self, key: str, *, max_bytes: int = MAX_RECORD_BYTES) -> bytes | None:
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
        paging = _Paging(f"listing {prefix or '/'} at {self.uri}")
        keys: set[str] = set()
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix,
                                      "MaxKeys": self.list_page_size}
            if paging.token:
                params["ContinuationToken"] = paging.token
            page = await self._small(f"listing {prefix or '/'}", "list_objects_v2", **params)
            before = len(keys)
            for item in page.get("Contents", []):
                full_key = str(item["Key"])
                if full_key in keys:
                    continue  # listed again
                keys.add(full_key)  # a "directory" marker too: it is progress, not a shard
                if not full_key.endswith("/"):
                    yield self._strip_root(full_key), item
            if not paging.next(page, new=len(keys) > before):
                break

    async def read_chunks(self, key: str, *, chunk_bytes: int = 8 << 20) -> AsyncGenerator[bytes, None]:
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
                    raise replaced(self.uri, key, exc) from exc
                raise
            resumed = etag is not None
            etag = str(answer.get("ETag") or "") or None
            try:
                async with answer["Body"] as body:
                    answered = str(answer.get("ContentRange") or "")
                    # Another range's bytes would pass for the rest of this object's
                    # (s3ranges.py checks the same of a restore's ranges); read again from
                    # its start, the whole object is the right answer.
                    if resumed and not (answered.startswith(f"bytes {offset}-")
                                        or (offset == 0 and not answered)):
                        raise S3Failure(f"{what} at {self.uri}: the server answered the range "
                                        f"{answered or '(none)'} for bytes {offset}-; it sent "
                                        "a wrong answer, retry", transient=True, kind="io")
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

    async def copy_into(
        self, key: str, out_fd: int, *, algo: str = checksums.ALGO,
        progress: Callable[[int], None] | None = None, owned: bool = False,
        expected_size: int | None = None,
    ) -> tuple[int, str]:
        """Restore's bulk path: a large object is fetched as ``part_size_bytes`` ranges,
        ``max_concurrency`` at a time (one connection each, as the upload was), each written at
        its offset and checksummed as it arrives (s3ranges.py), by this process or, for an
        object of READERS_FROM bytes or more, by the backend's reader processes where it has
        some (``readers``); the ranges' CRC64NVMEs are combined. A
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
        if head is not None and expected_size is not None and size != expected_size:
            return size, ""  # the caller reports the size; nothing read for nothing
        if head is None or size <= self._part_size:  # one stream: no HEAD asked, or small
            length = size if head is not None else expected_size
            async with (contextlib.nullcontext() if length is None
                        else at_least_min_rate(self, f"reading {key}", length)):
                return await super().copy_into(key, out_fd, algo=algo, progress=progress,
                                               expected_size=expected_size)
        etag = str(head.get("ETag") or "")
        ranges = [Range(key, full, offset, min(self._part_size, size - offset), etag)
                  for offset in range(0, size, self._part_size)]
        crcs: dict[int, int] = {}
        # A large object's ranges go to reader processes where the caller has them (the
        # ``ckptdrain restore`` command): one process's loop reads about 1 GB/s at most.
        # Once started, they take every ranged object; only where the object's ETag pins
        # each range to one version of it (a range read again after its reader died writes
        # the same bytes).
        readers = (self.readers if self.readers is not None and etag
                   and (size >= READERS_FROM or self.readers.running) else None)
        if readers is None:
            write = writer(out_fd, on_loop=self.writes_on_loop)

            async def fetch(rng: Range) -> None:
                async with self.ranges:
                    crcs[rng.offset] = await fetch_range(self, rng, write, progress)
        else:
            # One reader writes one file: two processes writing one file on a local
            # filesystem take its inode's lock in turn and spin for it (8% of a restore's
            # samples in perf with two readers); the files are spread over the readers.
            lane = None if writes_in_parallel(out_fd) else readers.next_lane()

            async def fetch(rng: Range) -> None:
                async with self.ranges:
                    crcs[rng.offset] = await readers.fetch(rng, out_fd, lane=lane,
                                                           on_loop=self.writes_on_loop)
                if progress is not None:
                    progress(rng.length)

        try:
            async with asyncio.TaskGroup() as tg:
                for rng in ranges:
                    tg.create_task(fetch(rng))
        except BaseExceptionGroup as group:
            raise first_cause(group) from None
        return size, checksums.combine([(crcs[rng.offset], rng.length) for rng in ranges])


class _Paging:
    """Where a listing is in the server's pages, and whether it still gets anywhere.

    Found attacking a misbehaving server: "truncated" answered with the same token every time
    held a commit's listing, ``ls`` and ``restore`` in a loop for good (~600 requests a
    second); so did fresh tokens over the same page, and "truncated" with no token passed
    for the last page (``ls`` left generations out). A token given before, a truncated page
    with no token, or STALL_PAGES truncated pages in a row that list nothing new fail the
    listing as transient (empty truncated pages happen, rarely, on real stores).
    """

    STALL_PAGES = 16

    def __init__(self, what: str) -> None:
        self.what = what
        self.token: str | None = None
        self._seen: set[str] = set()
        self._stalled = 0

    def next(self, page: dict[str, Any], *, new: bool) -> bool:
        """Whether another page follows ``page`` (``new``: it listed something not listed
        before); its token is then :attr:`token`."""
        if not page.get("IsTruncated"):
            return False
        following = str(page.get("NextContinuationToken") or "")
        self._stalled = 0 if new else self._stalled + 1
        if not following:
            problem = "said more pages follow but gave no continuation token"
        elif following in self._seen:
            problem = "gave the same continuation token again"
        elif self._stalled >= self.STALL_PAGES:
            problem = f"answered {self._stalled} pages in a row that listed nothing new"
        else:
            self._seen.add(following)
            self.token = following
            return True
        raise S3Failure(f"{self.what} did not advance (the server {problem}); its paging is "
                        "broken: check the endpoint, and retry", transient=True, kind="io")
