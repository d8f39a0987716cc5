"""The S3 destination (AWS S3 or anything that speaks its API: SeaweedFS, MinIO, Ceph RGW).

An object below ``multipart_threshold_bytes`` goes up in one PutObject; a larger one as a
multipart upload whose parts are read with ``os.preadv`` into pooled buffers and sent
``max_concurrency`` at a time (s3multipart.py; the client plumbing is in s3client.py, error
translation in s3errors.py). Every shard body carries its CRC64NVME (``x-amz-checksum-crc64nvme``,
per part and, at Complete, for the whole object as a FULL_OBJECT checksum), which the server
validates and stores: a corrupted byte is refused rather than stored, and HeadObject answers
the checksum the manifest records without a read of the bytes.

Shards are created once: PutObject and CompleteMultipartUpload carry ``If-None-Match: *``, and
a key that is taken goes to collision.py (same bytes: drained; committed: ShardConflict; a
leftover: replaced by an object that records its checksum in ``x-amz-meta-ckptdrain-checksum``).
A single PutObject records the checksum in metadata too; a multipart object's record is its
stored full-object CRC64NVME.

Retries of single requests (500/503/SlowDown/timeouts/resets) are botocore's, in the retry mode
the config names; what is still failing after them becomes a :class:`BackendError` whose
``transient`` flag tells the scheduler whether its longer retry budget is worth spending.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.base import Backend, BackendError, Flow, ObjectInfo, UploadLog
from ckptdrain.daemon.backends.collision import check_replaced, settle_existing
from ckptdrain.daemon.backends.s3client import absent
from ckptdrain.daemon.backends.s3errors import S3Failure, advice, classify
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
    multipart_etag,
    part_plan,
    same_etag,
)
from ckptdrain.daemon.backends.s3proof import (
    LISTING_SLACK,
    CreatedObjects,
    listing_prefix,
    worth_listing,
)
from ckptdrain.daemon.backends.s3reads import S3Reads
from ckptdrain.daemon.backends.s3senders import BATCH_AT_ONCE, Put, Whole
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.threads import settled

# Keys in one batch of the commit's HEADs (one message to an upload worker; its answer, about
# 300 bytes a key, goes in a memfd when longer than half a datagram).
STAT_BATCH = 256
# DeleteObjects takes at most 1,000 keys; a few requests at once, so retention's deletes do
# not crowd out the next checkpoint's uploads under the same prefix.
DELETE_OBJECTS_MAX = 1000
DELETE_REQUESTS_AT_ONCE = 4

# Re-exported: the names tests and older imports know this module by.
__all__ = ["GiB", "KiB", "MiB", "S3Backend", "S3Failure", "classify", "multipart_etag",
           "part_plan"]

if TYPE_CHECKING:
    from ckptdrain.daemon.config import DestinationConfig

log = logging.getLogger(__name__)

# How often a create-once write retries when the object it found vanished before it could be
# compared (retention removing an abandoned generation at that very moment).
_CREATE_ROUNDS = 3


class S3Backend(MultipartUploads, S3Reads, Backend):
    """``s3://bucket/prefix``; keys are stored as ``prefix/key`` (client plumbing in
    s3client.py, multipart uploads in s3multipart.py)."""

    # -- put_file ---------------------------------------------------------------------------

    validates_checksums = True

    def __init__(self, config: DestinationConfig, node_id: str, *, workers: int = 0,
                 writes_on_loop: bool = False, readers: int = 0) -> None:
        super().__init__(config, node_id, workers=workers, writes_on_loop=writes_on_loop,
                         readers=readers)
        # What single PutObjects created, for the commit's proof by listing (s3proof.py).
        self.created = CreatedObjects()
        self.prove_by_listing = bool(config.prove_by_listing)

    async def put_file(
        self, key: str, fd: int, size: int, *, upload_log: UploadLog | None = None,
        flow: Flow | None = None,
    ) -> str:
        """Upload ``size`` bytes of ``fd``; returns the CRC64NVME of the bytes read.

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
            checksum = await self._put_single(key, full, fd, size, flow)
            if flow is not None:
                flow.moved(size)
            return checksum
        return await self._put_multipart(key, full, fd, size, upload_log, flow)

    async def _put_single(self, key: str, full: str, fd: int, size: int,
                          flow: Flow | None) -> str:
        if flow is not None:
            await flow.pace(size)
        metadata = self._metadata(None)  # the sender adds the checksum it computes
        checksum: str | None = None
        sent: list[Put] = []

        async def create() -> None:
            async with self.bodies:
                sent.append(await self.parts.put(Whole(key, full, size, metadata, True), fd))

        for _ in range(_CREATE_ROUNDS):
            if await self._create(f"uploading {key}", create):
                checksum = checksums.combine([(sent[-1].crc, size)])
                self.created.remember(key, size, checksum, sent[-1].etag)
                return checksum
            # Refused: the sender's checksum went with its error; the page cache has the bytes.
            checksum = checksum or await self._hash_staged(fd, size)
            head = await self._head(key, full)
            if head is None:
                continue  # gone since the refused create: create it again
            if await settle_existing(self, key, size, checksum, self._info(key, head)):
                return checksum
            # A leftover no manifest names: replaced by an object with our checksum.
            async with self.bodies:
                replaced = await self.parts.put(Whole(key, full, size, metadata, False), fd)
            if checksums.combine([(replaced.crc, size)]) != checksum:
                raise S3Failure(f"the staged copy of {key} changed while it was drained; it "
                                "will be sent again", transient=True, kind="integrity")
            await check_replaced(self, key, size, checksum)
            return checksum
        raise self._flapping(key)

    async def _put_multipart(
        self, key: str, full: str, fd: int, size: int, upload_log: UploadLog | None,
        flow: Flow | None,
    ) -> str:
        # One HEAD first (against the 3+ requests of any multipart upload): a taken key is
        # settled before anything is sent, and a retried drain of a shard already there costs
        # a local hash instead of an upload.
        for _ in range(_CREATE_ROUNDS):
            head = await self._head(key, full)
            if head is not None:
                return await self._put_over(key, full, fd, size, upload_log, head, flow)
            checksum, created = await self._upload(
                key, full, fd, size, upload_log, self._metadata(None), exclusive=True, flow=flow
            )
            if created:
                return checksum
            upload_log = None  # given up and cleared: it was aborted
        raise self._flapping(key)

    async def _put_over(
        self, key: str, full: str, fd: int, size: int, upload_log: UploadLog | None,
        head: dict[str, Any], flow: Flow | None,
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
        sent, _ = await self._upload(
            key, full, fd, size, None, self._metadata(checksum), exclusive=False, flow=flow
        )
        if sent != checksum:
            raise S3Failure(
                f"the staged copy of {key} changed while it was drained ({checksum} when "
                f"hashed, {sent} when sent); it will be sent again",
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
        """The checksum of the staged copy, read in a worker thread (page cache, small buffer)."""
        stop = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(
            None, checksums.of_file, fd, size, stop
        )
        # As in _read: the fd may not be closed under the thread.
        return await settled(future, stop=stop, grace_s=READ_DRAIN_TIMEOUT_S)

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

    async def _create(self, what: str, put: Callable[[], Awaitable[object]]) -> bool:
        """Run ``put``, a PutObject with ``If-None-Match: *``: False when the key exists.
        (When a first try succeeded but its answer was lost, botocore's retry sees our own
        object and this returns False too: callers compare the bytes, as they must.)"""
        delay = 0.05
        for attempt in range(1, self._max_attempts + 1):
            try:
                await put()
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

    async def stat(self, key: str, *, checksum: bool = True) -> ObjectInfo | None:
        del checksum  # a HEAD answers the stored checksum either way, at no extra cost
        head = await self._head(key, self._key(key))
        return None if head is None else self._info(key, head)

    async def stat_many(self, keys: Sequence[str], *,
                        concurrency: int = 32) -> builtins.list[ObjectInfo | None]:
        """:meth:`stat` of every key, in order. The objects this backend created are proved
        from one listing of their directory when it shows them unchanged (s3proof.py); the
        rest as batches of HEADs: with upload workers one message per :data:`STAT_BATCH`
        keys (the daemon's loop paid a hand-over per shard), about ``concurrency`` HEADs in
        flight in all (at least one batch's
        :data:`~ckptdrain.daemon.backends.s3senders.BATCH_AT_ONCE`)."""

        found: builtins.list[ObjectInfo | None] = [None] * len(keys)
        await self._prove_by_listing(list(keys), found)
        headed = [i for i, info in enumerate(found) if info is None]

        async def batch(start: int) -> None:
            chunk = headed[start:start + STAT_BATCH]
            answers = await self.parts.call_many(
                "checking", "head_object",
                [{"Bucket": self.bucket, "Key": self._key(keys[i]), "ChecksumMode": "ENABLED"}
                 for i in chunk])
            for i, answer in zip(chunk, answers, strict=True):
                if isinstance(answer, S3Failure):
                    if not absent(answer):
                        raise answer
                else:
                    found[i] = self._info(keys[i], answer)

        await for_each_bounded(range(0, len(headed), STAT_BATCH), batch,
                               max(1, concurrency // BATCH_AT_ONCE))
        return found

    async def _prove_by_listing(self, keys: builtins.list[str],
                                found: builtins.list[ObjectInfo | None]) -> None:
        """Fill ``found`` for the keys one listing proves (s3proof.py); leave the rest None."""
        if not self.prove_by_listing:
            return
        known = self.created.known(keys)
        within = listing_prefix([keys[i] for i in known])
        if not worth_listing(len(known), len(keys)) or within is None:
            return
        listed = await self.sizes_and_etags(within, limit=len(keys) + LISTING_SLACK)
        if listed is None:
            return
        for i in known:
            found[i] = self.created.proved(keys[i], listed.get(keys[i]))

    async def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Write a small object. With ``exclusive``, ``If-None-Match: *``: False when the key
        exists. (When a first try succeeded but its answer was lost, botocore's retry sees our
        own object and this returns False too: callers compare the bytes, as they must.)"""
        full = self._key(key)
        params: dict[str, Any] = {
            "Bucket": self.bucket, "Key": full,
            "ChecksumCRC32": crc32_header(crc32_hex(data)),
            "Metadata": {NODE_METADATA_KEY: self.node_id},
        }
        if exclusive:
            return await self._create(
                f"writing {key}",
                lambda: self._small(f"writing {key}", "put_object", body=data, IfNoneMatch="*",
                                    **params))
        await self._small(f"writing {key}", "put_object", body=data, **params)
        return True

    async def delete_many(self, keys: Sequence[str]) -> None:
        """DeleteObjects, :data:`DELETE_OBJECTS_MAX` keys a request (the most S3 takes), a
        few requests at once: a 10,000-shard generation in 10 requests, not 10,000. A key
        already gone is no error (S3 reports it deleted); the first request that reports any
        other key's error fails the call (requests still in flight are cancelled, and may or
        may not have deleted their keys)."""

        async def batch(start: int) -> None:
            chunk = [self._key(key) for key in keys[start:start + DELETE_OBJECTS_MAX]]
            answer = await self._small(
                f"deleting {len(chunk)} keys from {self._strip_root(chunk[0])}",
                "delete_objects", Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})
            errors = [e for e in answer.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
            if errors:
                raise self._refused_delete(errors, len(chunk))

        await for_each_bounded(range(0, len(keys), DELETE_OBJECTS_MAX), batch,
                               DELETE_REQUESTS_AT_ONCE)

    def _refused_delete(self, errors: list[dict[str, Any]], keys: int) -> S3Failure:
        """The failure for keys a DeleteObjects answer says it did not delete (its first)."""
        first = errors[0]
        code = str(first.get("Code", ""))
        key = str(first.get("Key", ""))
        if self.root and key.startswith(f"{self.root}/"):
            key = self._strip_root(key)
        transient = code in ("InternalError", "SlowDown", "ServiceUnavailable")
        kind = ("throttled" if code == "SlowDown" else
                "auth" if code in ("AccessDenied", "AllAccessDisabled") else "io")
        return S3Failure(
            f"deleting {key} at {self.uri}: {code}: {first.get('Message', '')} ({len(errors)} "
            f"of the request's {keys} keys not deleted); "
            f"{advice(kind, transient, self._endpoint)}",
            transient=transient, kind=kind, code=code)

    async def delete(self, key: str) -> None:
        full = self._key(key)
        try:
            await self._small(f"deleting {key}", "delete_object", Bucket=self.bucket, Key=full)
        except S3Failure as exc:
            if exc.code != "NoSuchKey":
                raise

