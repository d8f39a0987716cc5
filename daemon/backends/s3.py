"""The S3 destination (AWS S3 or anything that speaks its API: SeaweedFS, MinIO, Ceph RGW).

An object below ``multipart_threshold_bytes`` goes up in one PutObject; a larger one as a
multipart upload whose parts are read with ``os.preadv`` into pooled buffers, hashed in file
order, and sent ``max_concurrency`` at a time. Every body carries a CRC32 the server checks
(``x-amz-checksum-crc32``), so a corrupted byte is refused rather than stored.

A multipart upload is resumable through the :class:`UploadLog` journal, and it is aborted where
it is created when it can no longer complete: on a permanent failure, on cancellation, or on
any failure when there is no journal to resume it from. The abort waits for in-flight parts
first and then checks that nothing is left, because a part that lands after an abort keeps its
bytes (and its bill). :meth:`S3Backend.sweep_orphans` removes what a dead process left.

Retries of single requests (500/503/SlowDown/timeouts/resets) are botocore's, in the retry mode
the config names; what is still failing after them becomes a :class:`BackendError` whose
``transient`` flag tells the scheduler whether its longer retry budget is worth spending.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import datetime as dt
import hashlib
import logging
import os
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    FlexibleChecksumError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from ckptdrain.client.manifest import format_checksum
from ckptdrain.daemon.backends.base import Backend, BackendError, ObjectInfo, UploadLog
from ckptdrain.daemon.logs import log_event

if TYPE_CHECKING:
    from ckptdrain.daemon.config import DestinationConfig

log = logging.getLogger(__name__)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# S3's multipart limits (AWS user guide, "Amazon S3 multipart upload limits").
MIN_PART_BYTES = 5 * MiB
MAX_PART_BYTES = 5 * GiB
MAX_PARTS = 10_000
MAX_OBJECT_BYTES = MAX_PARTS * MAX_PART_BYTES
MAX_PUT_BYTES = 5 * GiB

# Metadata on every object and upload we create, so an operator (and a sweep on servers that
# expose it) can tell which node wrote it.
NODE_METADATA_KEY = "ckptdrain-node"

# Connections beyond the part uploads, so a Complete, a listing or a manifest write never
# queues behind max_concurrency parts in flight.
_CONTROL_CONNECTIONS = 4
# S3 answers at most 1,000 entries per listing page.
_LIST_PAGE = 1000
# Longest wait for an abort and its confirmation (the sweep and the lifecycle rule catch up).
_CLEANUP_TIMEOUT_S = 30.0
# How often an abort is retried when a late part re-appears after it.
_ABORT_ROUNDS = 3
# A read thread cannot be interrupted; a cancelled read waits this long for it before giving
# its buffer up for lost (a hung filesystem), rather than reusing memory a thread still writes.
_READ_DRAIN_TIMEOUT_S = 60.0


# -- pure helpers ---------------------------------------------------------------------------


def part_plan(size: int, part_size: int) -> tuple[int, int]:
    """The part size and part count for a multipart upload of ``size`` bytes.

    ``part_size`` is the configured wish; it is clamped to S3's 5 MiB-5 GiB and raised (to a
    whole MiB) when the object would otherwise need more than 10,000 parts. The last part may
    be shorter. An empty object is one empty part. ValueError when ``size`` exceeds what
    10,000 parts of 5 GiB can hold.
    """
    if size < 0:
        raise ValueError(f"object size must not be negative, got {size}")
    if size > MAX_OBJECT_BYTES:
        raise ValueError(
            f"an object of {size} bytes exceeds S3's limit of {MAX_OBJECT_BYTES} bytes "
            "(10,000 parts of 5 GiB); split the shard into smaller files"
        )
    part = min(max(part_size, MIN_PART_BYTES), MAX_PART_BYTES)
    if -(-size // part) > MAX_PARTS:
        needed = -(-size // MAX_PARTS)
        # Whole MiB keep part boundaries page- and stripe-aligned; still <= 5 GiB because
        # 5 GiB is itself a whole number of MiB and needed <= 5 GiB.
        part = -(-needed // MiB) * MiB
    return part, max(1, -(-size // part))


def crc32_hex(data: bytes | bytearray | memoryview) -> str:
    return f"{zlib.crc32(data):08x}"


def crc32_header(crc_hex: str) -> str:
    """The ``x-amz-checksum-crc32`` value: base64 of the big-endian CRC32."""
    return base64.b64encode(bytes.fromhex(crc_hex)).decode("ascii")


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart object: md5 of the parts' binary md5s, ``-N``."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(bytes.fromhex(etag.strip('"')))
    return f'"{digest.hexdigest()}-{len(part_etags)}"'


def _part_checksum(crc_hex: str) -> str:
    """How a part's checksum is journalled: ``"crc32:<8 hex>"``."""
    return f"crc32:{crc_hex}"


def _same_etag(a: str, b: str) -> bool:
    return a.strip('"') == b.strip('"')


def _read_part(fd: int, buf: bytearray, offset: int, sha: Any) -> str:
    """Fill ``buf`` from ``fd`` at ``offset``, add it to the running sha256, return its CRC32.

    Runs in a worker thread: preadv, sha256 and crc32 all release the GIL on large buffers.
    """
    view = memoryview(buf)
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise OSError(
                f"staged file ended at byte {offset + got}, before the {offset + len(view)} "
                "bytes declared: it was truncated after hand-off"
            )
        got += n
    sha.update(view)
    return crc32_hex(view)


# -- errors ---------------------------------------------------------------------------------

_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "TooManyRequestsException", "RequestThrottled", "RequestThrottledException",
    "BandwidthLimitExceeded", "ServiceUnavailable",
})
_TIMEOUT_CODES = frozenset({"RequestTimeout", "RequestTimeoutException"})
_AUTH_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
    "AllAccessDisabled", "AccountProblem", "InvalidSecurity", "AuthorizationHeaderMalformed",
    "RequestTimeTooSkewed",
})
# Expired temporary credentials are refreshed by the credential chain on the next attempt.
_AUTH_TRANSIENT_CODES = frozenset({"ExpiredToken", "TokenRefreshRequired"})
_INTEGRITY_CODES = frozenset({
    "BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest", "IncompleteBody",
})
_NOT_FOUND_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "NoSuchUpload", "NotFound"})
_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict",
                             "OperationAborted", "InvalidPart", "InvalidPartOrder"})

# Everything a call through aiobotocore can raise for a reason outside our own code.
_S3_FAILURES: tuple[type[BaseException], ...] = (
    BotoCoreError, ClientError, aiohttp.ClientError, ConnectionError, TimeoutError,
)


class S3Failure(BackendError):
    """A failed S3 request; ``code`` is the S3 error code ("" when no response came back)."""

    def __init__(self, message: str, *, transient: bool, kind: str, code: str = "",
                 status: int = 0) -> None:
        super().__init__(message, transient=transient, kind=kind)
        self.code = code
        self.status = status


def classify(exc: BaseException) -> tuple[bool, str]:
    """(transient, kind) for an exception raised by aiobotocore/botocore/aiohttp."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _THROTTLE_CODES or status in (429, 503):
            return True, "throttled"
        if code in _TIMEOUT_CODES or status in (408, 504):
            return True, "timeout"
        if code in _AUTH_TRANSIENT_CODES:
            return True, "auth"
        if code in _AUTH_CODES or status in (401, 403):
            return False, "auth"
        if code == "BadDigest":
            # The bytes changed on the way (we computed the checksum from what we read).
            return True, "integrity"
        if code in _INTEGRITY_CODES:
            return False, "integrity"
        if code in _NOT_FOUND_CODES or status == 404:
            return False, "not_found"
        if code == "ConditionalRequestConflict":
            return True, "conflict"
        if code in _CONFLICT_CODES or status in (409, 412):
            return False, "conflict"
        if status >= 500 or code in ("InternalError", "ServiceUnavailable"):
            return True, "io"
        return False, "io"
    if isinstance(exc, ConnectTimeoutError | ReadTimeoutError | TimeoutError):
        return True, "timeout"
    if isinstance(exc, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return False, "auth"
    if isinstance(exc, FlexibleChecksumError):
        return True, "integrity"
    if isinstance(exc, ParamValidationError):
        return False, "io"
    # Connection refused/reset/closed, a short body, a DNS failure: the network, not the data.
    return True, "io"


def _advice(kind: str, transient: bool, endpoint: str) -> str:
    if kind == "throttled":
        return "the store is throttling: lower destination.max_concurrency or wait"
    if kind == "timeout":
        return (f"no answer from {endpoint} in time: check the network path or raise "
                "destination.read_timeout_s / connect_timeout_s")
    if kind == "auth":
        return ("check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                "the instance role), the bucket policy and the clock")
    if kind == "integrity":
        return "the server refused the body's checksum: the bytes changed in transit; retry"
    if kind == "not_found":
        return "check destination.uri (bucket and prefix) and that the bucket exists"
    if kind == "conflict":
        return "another writer got there first or is writing the same key"
    if transient:
        return f"check that {endpoint} is reachable (destination.endpoint_url) and healthy"
    return "the request was refused; see the S3 error code"


# -- buffers --------------------------------------------------------------------------------


class BufferPool:
    """At most ``slots`` part buffers exist at once, so upload memory stays below slots x part
    size whatever the number of objects in flight. Buffers are reused: filling fresh memory
    costs about ten times more than filling memory already mapped."""

    def __init__(self, slots: int) -> None:
        self._capacity = slots
        self._slots = asyncio.Semaphore(slots)
        self._free: list[bytearray] = []
        self._in_use = 0

    @property
    def allocated(self) -> int:
        """Buffers alive (in use or kept for reuse); never more than the slots."""
        return self._in_use + len(self._free)

    async def acquire(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes (an S3 body is the whole buffer)."""
        await self._slots.acquire()
        self._in_use += 1
        for i, buf in enumerate(self._free):
            if len(buf) == size:
                return self._free.pop(i)
        if self._free and self.allocated > self._capacity:
            self._free.pop(0)  # make room: a size nobody asked for lately
        return bytearray(size)

    def release(self, buf: bytearray, *, reuse: bool = True) -> None:
        self._in_use -= 1
        if reuse:
            self._free.append(buf)
        self._slots.release()


@dataclass(frozen=True, slots=True)
class UploadInfo:
    """An incomplete multipart upload as ListMultipartUploads reports it."""

    key: str
    upload_id: str
    initiated: dt.datetime | None


# -- the backend ----------------------------------------------------------------------------


class S3Backend(Backend):
    """``s3://bucket/prefix``; keys are stored as ``prefix/key``."""

    def __init__(self, config: DestinationConfig, node_id: str) -> None:
        self.uri = config.uri
        self.node_id = node_id
        self.bucket: str = config.bucket
        self.root: str = config.prefix.strip("/")
        self._config = config
        self._endpoint = config.endpoint_url or "the S3 endpoint"
        self._part_size = int(config.part_size_bytes)
        self._threshold = int(config.multipart_threshold_bytes)
        self._concurrency = int(config.max_concurrency)
        self._max_attempts = int(config.max_attempts)
        # Bound on one abort-and-confirm, so a dead endpoint cannot hold a cancelled task (or
        # a stopping daemon) for long: what is not aborted by then is left to the sweep.
        self.cleanup_timeout_s = min(
            _CLEANUP_TIMEOUT_S,
            self._max_attempts * (float(config.connect_timeout_s) + float(config.read_timeout_s)),
        )
        self.buffers = BufferPool(self._concurrency)
        self._session = AioSession()
        self._client_lock = asyncio.Lock()
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._closed = False
        # Uploads this process has open: a sweep never aborts them, journalled or not.
        self._live_uploads: set[str] = set()
        # Listing page size; tests lower it to exercise paging against a real server.
        self.list_page_size = _LIST_PAGE
        self.aborted_uploads = 0

    # -- client -----------------------------------------------------------------------------

    def _client_config(self) -> AioConfig:
        c = self._config
        return AioConfig(
            region_name=c.region,
            signature_version="s3v4",
            # Every body carries a CRC32 the server verifies, so SigV4 need not hash it again
            # on the event loop (botocore signs payloads over plain http unless told not to).
            s3={"addressing_style": c.addressing_style, "payload_signing_enabled": False},
            request_checksum_calculation=c.checksum,
            response_checksum_validation=c.checksum,
            retries={"mode": c.retry_mode, "total_max_attempts": self._max_attempts},
            connect_timeout=float(c.connect_timeout_s),
            read_timeout=float(c.read_timeout_s),
            max_pool_connections=self._concurrency + _CONTROL_CONNECTIONS,
            user_agent_extra="ckptdrain",
        )

    async def _s3(self) -> Any:
        """The aiobotocore client, created on first use inside the running loop."""
        if self._client is not None:
            return self._client
        async with self._client_lock:
            if self._closed:
                raise BackendError(f"the S3 backend for {self.uri} is closed", kind="io")
            if self._client is None:
                stack = AsyncExitStack()
                with self._translating(f"connecting to {self.uri}"):
                    self._client = await stack.enter_async_context(
                        self._session.create_client(
                            "s3", endpoint_url=self._config.endpoint_url,
                            config=self._client_config(),
                        )
                    )
                self._stack = stack
        return self._client

    async def aclose(self) -> None:
        async with self._client_lock:
            self._closed = True
            stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    @contextlib.contextmanager
    def _translating(self, what: str) -> Iterator[None]:
        """Turn what aiobotocore raises into an S3Failure that says what to do."""
        try:
            yield
        except _S3_FAILURES as exc:
            raise self._failure(what, exc) from exc

    def _failure(self, what: str, exc: BaseException) -> S3Failure:
        transient, kind = classify(exc)
        code, status = "", 0
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        detail = str(exc) or type(exc).__name__
        message = (f"{what} at {self.uri}: {detail}; {_advice(kind, transient, self._endpoint)}")
        return S3Failure(message, transient=transient, kind=kind, code=code, status=status)

    async def _call(self, what: str, operation: str, **params: Any) -> Any:
        client = await self._s3()
        with self._translating(what):
            return await getattr(client, operation)(**params)

    def _key(self, key: str) -> str:
        if not key or key.startswith("/") or any(s in ("", ".", "..") for s in key.split("/")):
            raise ValueError(f"{key!r} is not a relative key without empty, . or .. segments")
        return f"{self.root}/{key}" if self.root else key

    def _strip_root(self, full_key: str) -> str:
        return full_key[len(self.root) + 1:] if self.root else full_key

    def _full_prefix(self, prefix: str) -> str:
        # String-prefix semantics, as on POSIX and in memory: "a/b" also matches "a/bc".
        if not self.root:
            return prefix
        return f"{self.root}/{prefix}"

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

    async def _read(self, fd: int, buf: bytearray, offset: int, sha: Any) -> str:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, _read_part, fd, buf, offset, sha)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread still writes into buf and reads fd: wait for it, so neither the buffer
            # nor the fd (closed by our caller when we return) is reused under it.
            await asyncio.wait([future], timeout=_READ_DRAIN_TIMEOUT_S)
            raise

    async def _put_single(self, key: str, full: str, fd: int, size: int) -> str:
        sha = hashlib.sha256()
        buf = await self.buffers.acquire(size)
        reuse = False
        try:
            crc = await self._read(fd, buf, 0, sha)
            await self._call(
                f"uploading {key}", "put_object", Bucket=self.bucket, Key=full, Body=buf,
                ChecksumCRC32=crc32_header(crc), Metadata={NODE_METADATA_KEY: self.node_id},
            )
            reuse = True
        finally:
            self.buffers.release(buf, reuse=reuse)
        return format_checksum("sha256", sha.hexdigest())

    async def _put_multipart(
        self, key: str, full: str, fd: int, size: int, upload_log: UploadLog | None
    ) -> str:
        part_size, count = part_plan(size, self._part_size)
        upload_id, kept = await self._resume(key, full, upload_log, part_size, size)
        new = upload_id is None
        if upload_id is None:
            created = await self._call(
                f"starting the upload of {key}", "create_multipart_upload",
                Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32",
                Metadata={NODE_METADATA_KEY: self.node_id},
            )
            upload_id = str(created["UploadId"])
        # Cleanup is registered here, where the upload exists.
        self._live_uploads.add(upload_id)
        done = False
        resumable = False
        try:
            if new and upload_log is not None:
                await upload_log.begun(upload_id)
            parts, digest = await self._send_parts(
                key, full, fd, size, part_size, count, upload_id, kept, upload_log
            )
            await self._complete(key, full, upload_id, parts)
            done = True
            if upload_log is not None:
                await upload_log.finished()
        except BackendError as exc:
            # With a journal, a transient failure leaves the upload for the next attempt to
            # resume (ListParts); without one nothing could, so it is aborted like the rest.
            resumable = exc.transient and upload_log is not None
            raise
        finally:
            self._live_uploads.discard(upload_id)
            if not done and not resumable:
                await self._abort(key, full, upload_id)
        return format_checksum("sha256", digest)

    async def _resume(
        self, key: str, full: str, upload_log: UploadLog | None, part_size: int, size: int
    ) -> tuple[str | None, dict[int, tuple[str, str]]]:
        """The journalled upload id and the parts that need not be sent again, or (None, {})
        when there is nothing to resume."""
        if upload_log is None:
            return None, {}
        upload_id, journal = await upload_log.load()
        if upload_id is None:
            return None, {}
        on_server = await self._list_parts(key, full, upload_id)
        if on_server is None:
            log_event(log, logging.INFO, "s3_upload_gone", key=key, upload_id=upload_id)
            return None, {}
        kept: dict[int, tuple[str, str]] = {}
        for number, (etag, checksum) in journal.items():
            expected = min(part_size, size - (number - 1) * part_size)
            found = on_server.get(number)
            if found is not None and _same_etag(found[0], etag) and found[1] == expected:
                kept[number] = (etag, checksum)
        log_event(log, logging.INFO, "s3_upload_resumed", key=key, upload_id=upload_id,
                  parts_kept=len(kept))
        return upload_id, kept

    async def _send_parts(
        self, key: str, full: str, fd: int, size: int, part_size: int, count: int,
        upload_id: str, kept: dict[int, tuple[str, str]], upload_log: UploadLog | None,
    ) -> tuple[list[tuple[int, str, str]], str]:
        """Read every part in file order (hashing as it goes), send those not ``kept``
        concurrently; returns [(number, etag, crc32 hex)] in order and the sha256 hex."""
        sha = hashlib.sha256()
        results: dict[int, tuple[str, str]] = {}
        # Buffers handed to part tasks and not yet given back. A task cancelled before its
        # first step never runs its finally, so what is left here is released below.
        lent: dict[int, bytearray] = {}

        async def send(number: int, crc: str) -> None:
            buf = lent[number]
            reuse = False
            try:
                answer = await self._call(
                    f"uploading part {number} of {key}", "upload_part", Bucket=self.bucket,
                    Key=full, UploadId=upload_id, PartNumber=number, Body=buf,
                    ChecksumCRC32=crc32_header(crc),
                )
                reuse = True
            finally:
                del lent[number]
                self.buffers.release(buf, reuse=reuse)
            etag = str(answer["ETag"])
            results[number] = (etag, crc)
            if upload_log is not None:
                await upload_log.part_done(number, etag, _part_checksum(crc))

        try:
            async with asyncio.TaskGroup() as tg:
                for number in range(1, count + 1):
                    offset = (number - 1) * part_size
                    buf = await self.buffers.acquire(min(part_size, size - offset))
                    try:
                        crc = await self._read(fd, buf, offset, sha)
                    except BaseException:
                        self.buffers.release(buf, reuse=False)
                        raise
                    old = kept.get(number)
                    if old is not None and old[1] == _part_checksum(crc):
                        # Already on the server with these very bytes: hashed, not re-sent.
                        results[number] = (old[0], crc)
                        self.buffers.release(buf)
                        continue
                    lent[number] = buf
                    tg.create_task(send(number, crc), name=f"s3-part-{number}")
        except BaseExceptionGroup as group:
            raise _first_cause(group) from None
        finally:
            for buf in lent.values():
                self.buffers.release(buf, reuse=False)
            lent.clear()
        return [(n, *results[n]) for n in range(1, count + 1)], sha.hexdigest()

    async def _complete(
        self, key: str, full: str, upload_id: str, parts: list[tuple[int, str, str]]
    ) -> None:
        listing = [
            {"PartNumber": n, "ETag": etag, "ChecksumCRC32": crc32_header(crc)}
            for n, etag, crc in parts
        ]
        try:
            # botocore turns an error inside a 200 answer to Complete into a retried 500.
            await self._call(
                f"completing the upload of {key}", "complete_multipart_upload",
                Bucket=self.bucket, Key=full, UploadId=upload_id,
                MultipartUpload={"Parts": listing},
            )
        except S3Failure as exc:
            if exc.code != "NoSuchUpload":
                raise
            # A retried Complete whose first try succeeded finds the upload gone: the object
            # is there if its ETag is the one these parts make.
            expected = multipart_etag([etag for _, etag, _ in parts])
            try:
                head = await self._call(f"checking {key}", "head_object",
                                        Bucket=self.bucket, Key=full)
            except S3Failure:
                head = {}
            if not _same_etag(str(head.get("ETag", "")), expected):
                raise S3Failure(
                    f"the upload of {key} at {self.uri} vanished before it completed "
                    "(aborted by another node's sweep or a lifecycle rule); it will be sent "
                    "again. Raise destination.orphan_grace_s above the longest upload",
                    transient=True, kind="not_found", code="NoSuchUpload",
                ) from exc

    async def abort_upload(self, key: str, upload_log: UploadLog) -> bool:
        upload_id, _ = await upload_log.load()
        if upload_id is None:
            return True
        if await self._abort(key, self._key(key), upload_id):
            await upload_log.finished()
            return True
        return False

    async def _abort(self, key: str, full: str, upload_id: str) -> bool:
        """Abort and confirm nothing is left; False (and a log line) when that could not be
        done, leaving the upload to the orphan sweep and the lifecycle rule."""
        aborted = False
        try:
            async with asyncio.timeout(self.cleanup_timeout_s):
                for _ in range(_ABORT_ROUNDS):
                    try:
                        await self._call(f"aborting the upload of {key}",
                                         "abort_multipart_upload", Bucket=self.bucket,
                                         Key=full, UploadId=upload_id)
                        aborted = True
                    except S3Failure as exc:
                        if exc.code != "NoSuchUpload":
                            raise
                    # A part in flight during the abort can land after it and bring the
                    # upload back on some stores: look, and abort again if so.
                    if await self._list_parts(key, full, upload_id) is None and not any(
                        u.upload_id == upload_id for u in await self._list_uploads(full)
                    ):
                        if aborted:
                            self.aborted_uploads += 1
                        log_event(log, logging.INFO, "s3_upload_aborted", key=key,
                                  upload_id=upload_id)
                        return True
        except (BackendError, TimeoutError) as exc:
            log_event(log, logging.WARNING, "s3_abort_failed", key=key, upload_id=upload_id,
                      error=str(exc) or "timed out",
                      action="left to the orphan sweep and the lifecycle rule")
            if aborted:
                self.aborted_uploads += 1
            return False
        log_event(log, logging.WARNING, "s3_abort_unconfirmed", key=key, upload_id=upload_id,
                  action="left to the orphan sweep and the lifecycle rule")
        if aborted:
            self.aborted_uploads += 1
        return False

    async def _list_parts(
        self, key: str, full: str, upload_id: str
    ) -> dict[int, tuple[str, int]] | None:
        """number -> (etag, size) of the parts on the server; None when the upload is gone."""
        found: dict[int, tuple[str, int]] = {}
        marker = 0
        for _ in range(MAX_PARTS):
            params: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id,
                                      "MaxParts": self.list_page_size}
            if marker:
                params["PartNumberMarker"] = marker
            try:
                page = await self._call(f"listing the parts of {key}", "list_parts", **params)
            except S3Failure as exc:
                if exc.code == "NoSuchUpload":
                    return None
                raise
            for part in page.get("Parts", []):
                found[int(part["PartNumber"])] = (str(part["ETag"]), int(part["Size"]))
            following = int(page.get("NextPartNumberMarker") or 0)
            if not page.get("IsTruncated") or following <= marker:
                break
            marker = following
        return found

    async def _list_uploads(self, prefix: str) -> builtins.list[UploadInfo]:
        """Every incomplete upload whose key starts with ``prefix`` (a full key prefix)."""
        found: dict[str, UploadInfo] = {}
        key_marker: str | None = None
        id_marker: str | None = None
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix,
                                      "MaxUploads": self.list_page_size}
            if key_marker:
                params["KeyMarker"] = key_marker
            if id_marker:
                params["UploadIdMarker"] = id_marker
            page = await self._call("listing multipart uploads", "list_multipart_uploads",
                                    **params)
            for upload in page.get("Uploads", []):
                info = UploadInfo(str(upload["Key"]), str(upload["UploadId"]),
                                  upload.get("Initiated"))
                found[info.upload_id] = info
            if not page.get("IsTruncated"):
                break
            # AWS returns both markers; SeaweedFS pages by upload id alone (no NextKeyMarker).
            next_key = page.get("NextKeyMarker") or None
            next_id = page.get("NextUploadIdMarker") or None
            if (next_key, next_id) == (key_marker, id_marker) or not (next_key or next_id):
                raise S3Failure(
                    f"listing multipart uploads at {self.uri} did not advance past "
                    f"{key_marker!r}/{id_marker!r}; the server's paging is broken",
                    transient=True, kind="io",
                )
            key_marker, id_marker = next_key, next_id
        return list(found.values())

    async def sweep_orphans(self, owned_upload_ids: set[str], grace_s: float) -> int:
        """Abort uploads under the root that are neither owned (journalled) nor open in this
        process and were initiated more than ``grace_s`` ago."""
        prefix = f"{self.root}/" if self.root else ""
        now = dt.datetime.now(dt.UTC)
        aborted = 0
        for upload in await self._list_uploads(prefix):
            if upload.upload_id in owned_upload_ids or upload.upload_id in self._live_uploads:
                continue
            if grace_s > 0:
                if upload.initiated is None:
                    continue
                initiated = upload.initiated
                if initiated.tzinfo is None:
                    initiated = initiated.replace(tzinfo=dt.UTC)
                if (now - initiated).total_seconds() <= grace_s:
                    continue
            try:
                await self._call(f"aborting orphaned upload of {upload.key}",
                                 "abort_multipart_upload", Bucket=self.bucket, Key=upload.key,
                                 UploadId=upload.upload_id)
            except S3Failure as exc:
                if exc.code != "NoSuchUpload":
                    raise
                continue
            aborted += 1
            self.aborted_uploads += 1
            log_event(log, logging.INFO, "s3_orphan_aborted", key=upload.key,
                      upload_id=upload.upload_id, initiated=str(upload.initiated))
        return aborted

    # -- small objects ----------------------------------------------------------------------

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
            params["IfNoneMatch"] = "*"
        delay = 0.05
        for attempt in range(1, self._max_attempts + 1):
            try:
                await self._call(f"writing {key}", "put_object", **params)
                return True
            except S3Failure as exc:
                if not exclusive:
                    raise
                if exc.code == "PreconditionFailed" or exc.status == 412:
                    return False
                # 409: a concurrent conditional write is still in flight. Its outcome decides
                # ours, so ask again instead of guessing (it may yet fail and leave no object).
                if exc.code != "ConditionalRequestConflict" or attempt == self._max_attempts:
                    raise
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

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


def _first_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to raise for a failed set of parts: cancellation first, then a permanent
    failure (retrying cannot help), then any other."""
    leaves: builtins.list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for exc in leaves:
        if isinstance(exc, asyncio.CancelledError):
            return exc
    for exc in leaves:
        if isinstance(exc, BackendError) and not exc.transient:
            return exc
    for exc in leaves:
        if not isinstance(exc, BackendError):
            return exc
    return leaves[0]
