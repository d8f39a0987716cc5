"""The S3 destination (AWS S3 or anything that speaks its API: SeaweedFS, MinIO, Ceph RGW).

An object below ``multipart_threshold_bytes`` goes up in one PutObject; a larger one as a
multipart upload whose parts are read with ``os.preadv`` into pooled buffers, hashed in file
order, and sent ``max_concurrency`` at a time (s3multipart.py; the client plumbing is in
s3client.py, error translation in s3errors.py). Every body carries a CRC32 the
server checks (``x-amz-checksum-crc32``), so a corrupted byte is refused rather than stored.

Shards are created once: PutObject and CompleteMultipartUpload carry ``If-None-Match: *``, and
a key that is taken goes to collision.py (same bytes: drained; committed: ShardConflict; a
leftover: replaced by an object that records its checksum in ``x-amz-meta-ckptdrain-checksum``).
A single PutObject records the checksum of a new object too; a new multipart object cannot
(its metadata is fixed before its bytes are read) and is proved by its size, which is sound
because only its writer's part record can name it: every other writer that finds it either
proves it is the same bytes or replaces it with an object that carries its checksum.

Retries of single requests (500/503/SlowDown/timeouts/resets) are botocore's, in the retry mode
the config names; what is still failing after them becomes a :class:`BackendError` whose
``transient`` flag tells the scheduler whether its longer retry budget is worth spending.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from ckptdrain.client.manifest import format_checksum
from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo, UploadLog
from ckptdrain.daemon.backends.collision import check_replaced, settle_existing
from ckptdrain.daemon.backends.s3errors import S3Failure, classify
from ckptdrain.daemon.backends.s3multipart import MultipartUploads
from ckptdrain.daemon.backends.s3parts import (
    CHECKSUM_METADATA_KEY,
    MAX_OBJECT_BYTES,
    MAX_PUT_BYTES,
    NODE_METADATA_KEY,
    READ_DRAIN_TIMEOUT_S,
    GiB,
    KiB,
    MiB,
    crc32_header,
    crc32_hex,
    hash_staged,
    multipart_etag,
    part_plan,
    same_etag,
)
from ckptdrain.daemon.logs import log_event

# Re-exported: the names tests and older imports know this module by.
__all__ = ["GiB", "KiB", "MiB", "S3Backend", "S3Failure", "classify", "multipart_etag",
           "part_plan"]

log = logging.getLogger(__name__)

# How often a create-once write retries when the object it found vanished before it could be
# compared (retention removing an abandoned generation at that very moment).
_CREATE_ROUNDS = 3


class S3Backend(MultipartUploads, Backend):
    """``s3://bucket/prefix``; keys are stored as ``prefix/key`` (client plumbing in
    s3client.py, multipart uploads in s3multipart.py)."""

    # -- put_file ---------------------------------------------------------------------------

    async def put_file(
        self, key: str, fd: int, size: int, *, upload_log: UploadLog | None = None
    ) -> str:
        """Upload ``size`` bytes of ``fd``; returns ``"sha256:<hex>"`` of the bytes read.

        An OSError reading ``fd`` (or a file shorter than ``size``) propagates as OSError: the
        staged copy is at fault, not the destination.
        """
        full = self._key(key)
        if size < 0:
            raise ValueError(f"size must not be negative, got {size}")
        if size > MAX_OBJECT_BYTES:
            raise BackendError(
                f"{key} is {size} bytes, more than an S3 object can hold ({MAX_OBJECT_BYTES}); "
                "split the shard into smaller files", kind="io",
            )
        if size == 0 or (size < self._threshold and size <= MAX_PUT_BYTES):
            return await self._put_single(key, full, fd, size)
        return await self._put_multipart(key, full, fd, size, upload_log)

    async def _put_single(self, key: str, full: str, fd: int, size: int) -> str:
        sha = hashlib.sha256()
        buf = await self.buffers.acquire(size)
        reuse = False
        try:
            crc = await self._read(fd, buf, 0, sha)
            reuse = True  # no thread writes into buf any more
            checksum = format_checksum("sha256", sha.hexdigest())
            params: dict[str, Any] = {
                "Bucket": self.bucket, "Key": full, "Body": buf,
                "ChecksumCRC32": crc32_header(crc), "Metadata": self._metadata(checksum),
            }
            for _ in range(_CREATE_ROUNDS):
                if await self._create(f"uploading {key}", params):
                    return checksum
                head = await self._head(key, full)
                if head is None:
                    continue  # gone since the refused create: create it again
                if await settle_existing(self, key, size, checksum, self._info(key, head)):
                    return checksum
                # A leftover no manifest names: replaced by an object with our checksum.
                await self._call(f"replacing {key}", "put_object", **params)
                await check_replaced(self, key, size, checksum)
                return checksum
            raise self._flapping(key)
        finally:
            self.buffers.release(buf, reuse=reuse)

    async def _put_multipart(
        self, key: str, full: str, fd: int, size: int, upload_log: UploadLog | None
    ) -> str:
        # One HEAD first (against the 3+ requests of any multipart upload): a taken key is
        # settled before anything is sent, and a retried drain of a shard already there costs
        # a local hash instead of an upload.
        for _ in range(_CREATE_ROUNDS):
            head = await self._head(key, full)
            if head is not None:
                return await self._put_over(key, full, fd, size, upload_log, head)
            digest, created = await self._upload(
                key, full, fd, size, upload_log, self._metadata(None), exclusive=True
            )
            if created:
                return format_checksum("sha256", digest)
            upload_log = None  # given up and cleared: it was aborted
        raise self._flapping(key)

    async def _put_over(
        self, key: str, full: str, fd: int, size: int, upload_log: UploadLog | None,
        head: dict[str, Any],
    ) -> str:
        """``key`` is taken by a large object: accept it (same bytes), refuse (committed), or
        replace it (a leftover) with an upload that records its checksum."""
        checksum = await self._hash_staged(fd, size)
        if upload_log is not None and await self._is_journalled(key, size, upload_log, head):
            await upload_log.finished()
            return checksum
        try:
            same = await settle_existing(self, key, size, checksum, self._info(key, head))
        finally:
            # Whatever the answer, an upload begun earlier for this key is of no use: a
            # replacement must carry its checksum, which that upload's metadata lacks.
            if upload_log is not None:
                await self.abort_upload(key, upload_log)
        if same:
            return checksum
        digest, _ = await self._upload(
            key, full, fd, size, None, self._metadata(checksum), exclusive=False
        )
        if format_checksum("sha256", digest) != checksum:
            raise S3Failure(
                f"the staged copy of {key} changed while it was drained ({checksum} when "
                f"hashed, sha256:{digest} when sent); it will be sent again",
                transient=True, kind="integrity",
            )
        await check_replaced(self, key, size, checksum)
        return checksum

    async def _is_journalled(
        self, key: str, size: int, upload_log: UploadLog, head: dict[str, Any]
    ) -> bool:
        """Whether the object is this shard's own journalled upload, completed before the
        daemon could record that (it stopped between Complete and the journal): its ETag is
        the one the journalled parts make. No re-upload then, and no checksum is needed."""
        upload_id, parts = await upload_log.load()
        _, count = part_plan(size, self._part_size)
        if upload_id is None or sorted(parts) != list(range(1, count + 1)):
            return False
        expected = multipart_etag([parts[n][0] for n in range(1, count + 1)])
        return int(head.get("ContentLength") or -1) == size and same_etag(
            str(head.get("ETag", "")), expected
        )

    async def _hash_staged(self, fd: int, size: int) -> str:
        """The sha256 of the staged copy, read in a worker thread into a pooled buffer."""
        part_size, _ = part_plan(size, self._part_size)
        buf = await self.buffers.acquire(min(part_size, size) or 1)
        stop = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(
            None, hash_staged, fd, size, buf, stop
        )
        reuse = False
        try:
            checksum = await asyncio.shield(future)
            reuse = True
            return checksum
        except asyncio.CancelledError:
            stop.set()
            # As in _read: neither the buffer nor the fd may be reused under the thread.
            await asyncio.wait([future], timeout=READ_DRAIN_TIMEOUT_S)
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: the cancellation is what the caller sees
            raise
        finally:
            self.buffers.release(buf, reuse=reuse)

    def _flapping(self, key: str) -> S3Failure:
        return S3Failure(
            f"{key} at {self.uri} kept appearing and vanishing while it was written; "
            "something else is writing or deleting it", transient=True, kind="conflict",
        )

    def _metadata(self, checksum: str | None) -> dict[str, str]:
        metadata = {NODE_METADATA_KEY: self.node_id}
        if checksum is not None:
            metadata[CHECKSUM_METADATA_KEY] = checksum
        return metadata

    async def _create(self, what: str, params: dict[str, Any]) -> bool:
        """PutObject with ``If-None-Match: *``: False when the key exists. (When a first try
        succeeded but its answer was lost, botocore's retry sees our own object and this
        returns False too: callers compare the bytes, as they must.)"""
        params = {**params, "IfNoneMatch": "*"}
        delay = 0.05
        for attempt in range(1, self._max_attempts + 1):
            try:
                await self._call(what, "put_object", **params)
                return True
            except S3Failure as exc:
                if exc.code == "PreconditionFailed" or exc.status == 412:
                    return False
                # 409: a concurrent conditional write is still in flight. Its outcome decides
                # ours, so ask again instead of guessing (it may yet fail and leave no object).
                if exc.code != "ConditionalRequestConflict" or attempt == self._max_attempts:
                    raise
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    # -- metadata ---------------------------------------------------------------------------

    async def stat(self, key: str) -> ObjectInfo | None:
        head = await self._head(key, self._key(key))
        return None if head is None else self._info(key, head)

    async def list_dirs(self, prefix: str) -> builtins.list[str]:
        full_prefix = self._full_prefix(prefix)
        names: set[str] = set()
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix,
                                      "Delimiter": "/", "MaxKeys": self.list_page_size}
            if token:
                params["ContinuationToken"] = token
            page = await self._call(f"listing {prefix or '/'}", "list_objects_v2", **params)
            for common in page.get("CommonPrefixes", []):
                name = str(common["Prefix"])[len(full_prefix):].rstrip("/")
                if name:
                    names.add(name)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
        return sorted(names)


    async def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Write a small object. With ``exclusive``, ``If-None-Match: *``: False when the key
        exists. (When a first try succeeded but its answer was lost, botocore's retry sees our
        own object and this returns False too: callers compare the bytes, as they must.)"""
        full = self._key(key)
        params: dict[str, Any] = {
            # A bytearray, not bytes: botocore wraps bytes in a BytesIO and then sends
            # "Expect: 100-continue", a round trip per manifest and one aiohttp waits on
            # without a timeout if a proxy never answers it.
            "Bucket": self.bucket, "Key": full, "Body": bytearray(data),
            "ChecksumCRC32": crc32_header(crc32_hex(data)),
            "Metadata": {NODE_METADATA_KEY: self.node_id},
        }
        if exclusive:
            return await self._create(f"writing {key}", params)
        await self._call(f"writing {key}", "put_object", **params)
        return True

    async def get_bytes(self, key: str, *, max_bytes: int = 64 << 20) -> bytes | None:
        full = self._key(key)
        what = f"reading {key}"
        try:
            answer = await self._call(what, "get_object", Bucket=self.bucket, Key=full)
        except S3Failure as exc:
            if exc.code == "NoSuchKey" or (exc.status == 404 and exc.code != "NoSuchBucket"):
                return None
            raise
        async with answer["Body"] as body:
            length = int(answer.get("ContentLength") or 0)
            if length > max_bytes:
                raise BackendError(
                    f"{key} at {self.uri} is {length} bytes, more than the {max_bytes} expected "
                    "of a small object; it is not one this daemon wrote", kind="integrity",
                )
            with self._translating(what):
                data: bytes = await body.read()
        return data

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        full_prefix = self._full_prefix(prefix)
        found: builtins.list[ObjectInfo] = []
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix,
                                      "MaxKeys": self.list_page_size}
            if token:
                params["ContinuationToken"] = token
            page = await self._call(f"listing {prefix or '/'}", "list_objects_v2", **params)
            for item in page.get("Contents", []):
                full_key = str(item["Key"])
                if full_key.endswith("/"):
                    continue  # a "directory" marker some stores list
                modified = item.get("LastModified")
                found.append(ObjectInfo(
                    key=self._strip_root(full_key), size=int(item["Size"]),
                    modified=modified.timestamp() if modified is not None else None,
                ))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
        found.sort(key=lambda info: info.key)
        return found

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

    async def delete(self, key: str) -> None:
        full = self._key(key)
        try:
            await self._call(f"deleting {key}", "delete_object", Bucket=self.bucket, Key=full)
        except S3Failure as exc:
            if exc.code != "NoSuchKey":
                raise
