"""The S3 destination's plumbing: the aiobotocore client, created lazily inside the running
loop and closed once; error translation into BackendErrors that say what to do; keys under
the destination's prefix; HEAD; and reading a staged file into a pooled buffer off the loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import gc
import hashlib
import logging
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore.exceptions import ClientError

from ckptdrain.client.recordfields import ManifestError, parse_checksum
from ckptdrain.daemon.backends.base import BackendError, ObjectInfo
from ckptdrain.daemon.backends.s3crt import CrtEngine
from ckptdrain.daemon.backends.s3errors import (
    ANSWERED_WITH_ETAG,
    S3_FAILURES,
    S3Failure,
    advice,
    classify,
    no_s3_answer,
)
from ckptdrain.daemon.backends.s3parts import (
    CHECKSUM_METADATA_KEY,
    CLEANUP_TIMEOUT_S,
    LIST_PAGE,
    READ_DRAIN_TIMEOUT_S,
    BufferPool,
    read_part,
)
from ckptdrain.daemon.backends.s3pool import WorkerSenders, open_sender
from ckptdrain.daemon.checksums import from_s3_header
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.threads import settled

if TYPE_CHECKING:
    from ckptdrain.daemon.config import DestinationConfig

log = logging.getLogger(__name__)

# Connections beyond the part uploads, so a Complete, a listing or a manifest write never
# queues behind max_concurrency parts in flight.
_CONTROL_CONNECTIONS = 4


@functools.cache
def freeze_long_lived() -> None:
    """Move everything alive now out of the cyclic collector's walks, once per process.

    botocore's service model and endpoint rules are hundreds of thousands of objects that live
    as long as the process, and every full collection walked them all: a restore of 1 GiB from
    SeaweedFS spent 4% of its CPU in the collector, and 0.3 s more user CPU than frozen
    (docs/benchmarks.md). Once only: a frozen object that later becomes cyclic garbage is never
    collected, so freezing at every client built (a process opening backend after backend)
    would keep each closed client's cycles, about 12 MB apiece.
    """
    gc.freeze()


def add_content_md5(request: Any, **_: Any) -> None:
    """Give a DeleteObjects request a Content-MD5 (a botocore event handler). botocore sends
    only a CRC32 of the body, which S3 takes, but S3-compatible stores that predate flexible
    checksums (older MinIO and Ceph RGW releases among them) refuse DeleteObjects without an
    MD5 ("MissingContentMD5"), and retention would then remove nothing."""
    body = request.body
    if isinstance(body, bytes | bytearray) and "Content-MD5" not in request.headers:
        digest = hashlib.md5(body, usedforsecurity=False).digest()
        request.headers["Content-MD5"] = base64.b64encode(digest).decode()


def absent(exc: S3Failure) -> bool:
    """Whether a HEAD's failure says the object does not exist (and the bucket does)."""
    return exc.code in ("NoSuchKey", "NotFound", "404") or (
        exc.status == 404 and exc.code != "NoSuchBucket")


class S3Client:
    """``s3://bucket/prefix``; keys are stored as ``prefix/key``. The base of S3Backend."""

    def __init__(self, config: DestinationConfig, node_id: str, *, workers: int = 0,
                 file_bodies: bool = False, writes_on_loop: bool = False,
                 readers: int = 0) -> None:
        self.uri = config.uri
        # Restore's ranges written into their file by the event loop's own thread (see
        # S3Reads.copy_into): only for a process whose loop serves nothing else.
        self.writes_on_loop = writes_on_loop
        # An upload worker's client sends bodies from the staged file (s3bodies.FileBody); it
        # turns botocore's parameter validation off, which does not know that type.
        self.file_bodies = file_bodies
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
            CLEANUP_TIMEOUT_S,
            self._max_attempts * (float(config.connect_timeout_s) + float(config.read_timeout_s)),
        )
        self.buffers = BufferPool(self._concurrency)
        # Bodies (parts and single PUTs) in flight across every shard of this backend, wherever
        # they are sent from: with upload workers, their buffers live in the workers, so this
        # is what keeps upload memory at max_concurrency x part size in all.
        self.bodies = asyncio.Semaphore(self._concurrency)
        # Restore's ranged GETs in flight across every object read at once (a restore fetches
        # several shards together): at most max_concurrency connections, each holding at most
        # one write batch (s3reads.RANGE_WRITE_BYTES) of what arrived.
        self.ranges = asyncio.Semaphore(self._concurrency)
        self._session = AioSession()
        self._client_lock = asyncio.Lock()
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        # Clients built with credentials the server has since refused (see renew_credentials):
        # requests still in flight on them end there; closed with this backend.
        self._retired: list[AsyncExitStack] = []
        self._closed = False
        # Uploads this process has open: a sweep never aborts them, journalled or not.
        self._live_uploads: set[str] = set()
        # Listing page size; tests lower it to exercise paging against a real server.
        self.list_page_size = LIST_PAGE
        self.aborted_uploads = 0
        # Who sends multipart parts: this loop, or ``workers`` processes (s3senders.py, s3pool.py).
        self._workers = workers
        self.parts = open_sender(self, config, node_id, workers)
        # Processes that read a large object's ranges for a restore (s3ranges.READERS_FROM),
        # started at the first such object: ``ckptdrain restore`` has them, the daemon not.
        # No more of them than ranges in flight (max_concurrency): the rest would sit idle.
        self.readers = (None if readers == 0 else WorkerSenders(
            self, config, node_id, min(readers, self._concurrency), role="reader"))
        # destination.engine = "crt": single PutObjects and the commit's HEADs go through
        # the AWS common runtime (s3crt.py), wherever bodies are sent from.
        self.crt = CrtEngine(self, config) if config.engine == "crt" else None

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
            parameter_validation=not self.file_bodies,
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
                self._client.meta.events.register("before-sign.s3.DeleteObjects",
                                                  add_content_md5)
                if self._workers == 0 and threading.current_thread() is threading.main_thread():
                    # Frozen once botocore's model is in, by a client built on the process's
                    # main thread (the CLI, a worker, a daemon without workers, all at their
                    # start). The daemon's reads for its clients build theirs mid-run, on the
                    # fetch thread (daemon/fetcher.py), when freezing would pin whatever is
                    # alive then (tasks, tracebacks) out of the collector's reach for good.
                    freeze_long_lived()
        return self._client

    async def start(self) -> None:
        # With upload workers, every request of the drain, the commit and the sweeps is a
        # worker's: the daemon's backend builds a client only for a streamed read, on first
        # use (a shard read for a client goes through the fetcher's backend of its own,
        # daemon/fetcher.py), and does not carry botocore's model otherwise.
        if self._workers == 0:
            await self.warm_up()
        else:
            freeze_long_lived()  # what warm_up froze before: the modules loaded by now
        await self.parts.start()

    async def warm_up(self) -> None:
        """Build the aiobotocore client now (botocore loads and parses the S3 service model
        and endpoint rules: about 0.13 CPU s per process on the test machine), so a daemon or
        worker pays it when it starts, not during the first checkpoint's drain. A failure here
        is not fatal: the first request builds the client again and reports the failure, with
        what to do."""
        with contextlib.suppress(Exception):
            client = await self._s3()
            # aiobotocore opens its aiohttp session, TLS context included (about 30 ms of
            # CPU reading the CA bundle, even for an http:// endpoint), at the first request:
            # each worker would pay it in its first drain, not at its start. Its internals are
            # not public, so where they differ the first request pays it, as before.
            http = getattr(getattr(client, "_endpoint", None), "http_session", None)
            open_session = getattr(http, "_get_session", None)
            proxies = getattr(http, "_proxy_config", None)
            if open_session is not None and proxies is not None:
                await open_session(proxies.proxy_url_for(client.meta.endpoint_url))
        if self.crt is not None:
            with contextlib.suppress(Exception):
                await self.crt.start()

    async def aclose(self) -> None:
        try:
            await self.parts.aclose()
        finally:
            if self.readers is not None:
                await self.readers.aclose()
        if self.crt is not None:
            await self.crt.aclose()
        async with self._client_lock:
            self._closed = True
            stack, self._stack, self._client = self._stack, None, None
            retired, self._retired = self._retired, []
        for old in retired:
            with contextlib.suppress(Exception):
                await old.aclose()
        if stack is not None:
            await stack.aclose()

    async def renew_credentials(self, refused: Any = None) -> bool:
        """After the server refused this process's credentials (``auth``, not transient):
        whether the credential chain now resolves other ones, with which the client is built
        again (the request may then be sent once more). botocore resolves static credentials
        (the environment, a shared credentials file, a profile) once, when a client is built,
        so a daemon whose credentials file an operator fixed failed every save and every
        ``retry`` with the refused key until it was restarted (found attacking the S3 drain;
        operations.md says new checkpoints use the new credentials). ``refused`` is the client
        that was refused: one built since counts as renewed. Costs one resolution of the chain
        per refused request, and a client (the service model, about 0.13 CPU s) only when the
        credentials really changed."""
        async with self._client_lock:
            if self._closed:
                return False
            if refused is not None and self._client is not refused:
                return True
            fresh = AioSession()
            try:
                now = await _frozen(fresh)
                then = await _frozen(self._session)
            except S3_FAILURES:
                return False  # the chain fails to resolve: the refusal stands
            if now is None or now == then:
                return False
            self._session = fresh
            if self._stack is not None:
                self._retired.append(self._stack)
            self._stack, self._client = None, None
        log_event(log, logging.WARNING, "s3_credentials_renewed", destination=self.uri,
                  action="the server refused the credentials this process had; the chain "
                  "now gives other ones, used from the next request on")
        return True

    @contextlib.contextmanager
    def _translating(self, what: str) -> Iterator[None]:
        """Turn what aiobotocore raises into an S3Failure that says what to do."""
        try:
            yield
        except S3_FAILURES as exc:
            raise self._failure(what, exc) from exc

    def _failure(self, what: str, exc: BaseException) -> S3Failure:
        transient, kind = classify(exc)
        code, status = "", 0
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        detail = str(exc) or type(exc).__name__
        message = (f"{what} at {self.uri}: {detail}; "
                   f"{advice(kind, transient, self._endpoint, code)}")
        return S3Failure(message, transient=transient, kind=kind, code=code, status=status)

    async def _call(self, what: str, operation: str, **params: Any) -> Any:
        client = await self._s3()
        try:
            with self._translating(what):
                answer = await getattr(client, operation)(**params)
        except S3Failure as exc:
            if exc.kind != "auth" or exc.transient or not await self.renew_credentials(client):
                raise
            # Refused, and the chain gives other credentials now: once more, with them.
            client = await self._s3()
            with self._translating(what):
                answer = await getattr(client, operation)(**params)
        if operation in ANSWERED_WITH_ETAG and not answer.get("ETag"):
            body = answer.get("Body")
            if body is not None:
                with contextlib.suppress(Exception):
                    body.close()
            raise no_s3_answer(what, self.uri)
        return answer

    async def _small(self, what: str, operation: str, *, body: bytes | None = None,
                     read_max: int | None = None, **params: Any) -> Any:
        """A request without a streamed body (s3senders.SMALL_OPERATIONS), sent by whoever
        sends bodies: with upload workers, a worker builds, signs and parses it, not the
        daemon's loop. ``body`` and ``read_max`` as in :meth:`PartSender.call`."""
        return await self.parts.call(what, operation, params, body=body, read_max=read_max)

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

    async def _read(self, fd: int, buf: bytearray, offset: int) -> int:
        """Fill ``buf`` from ``fd`` at ``offset`` in a worker thread; the CRC64NVME of it."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, read_part, fd, buf, offset)
        # Cancelled, the thread still writes into buf and reads fd: wait for it, so neither
        # the buffer nor the fd (closed by our caller when we return) is reused under it.
        return await settled(future, grace_s=READ_DRAIN_TIMEOUT_S)

    async def _head(self, key: str, full: str) -> dict[str, Any] | None:
        try:
            head: dict[str, Any] = await self._small(
                f"checking {key}", "head_object", Bucket=self.bucket, Key=full,
                ChecksumMode="ENABLED",
            )
        except S3Failure as exc:
            if absent(exc):
                return None
            raise
        return head

    @staticmethod
    def _info(key: str, head: dict[str, Any]) -> ObjectInfo:
        try:
            return S3Client._info_of(key, head)
        except (AttributeError, TypeError, ValueError) as exc:
            # Only an upload worker's answer can be malformed (botocore parses its own).
            raise S3Failure(f"checking {key}: the answer was malformed "
                            f"({type(exc).__name__}: {exc}); it will be sent again",
                            transient=True, kind="io") from exc

    @staticmethod
    def _info_of(key: str, head: dict[str, Any]) -> ObjectInfo:
        # The server's own checksum first: the metadata is what the writer said, and any
        # client may write an object with a copied checksum in it (found attacking verify).
        # The metadata stands in only where the server stored none (a server without
        # CRC64NVME; an object written with sha256 by an older version).
        checksum = stored_checksum(head)
        validated = checksum is not None
        if checksum is None:
            recorded = head.get("Metadata", {}).get(CHECKSUM_METADATA_KEY)
            try:
                checksum = None if recorded is None else ":".join(parse_checksum(str(recorded)))
            except ManifestError:
                checksum = None  # not one we wrote: as good as none
        return ObjectInfo(
            key=key, size=int(head.get("ContentLength") or 0),
            modified=unix_time(head.get("LastModified")), checksum=checksum,
            validated=validated,
        )


async def _frozen(session: AioSession) -> tuple[str, str, str | None] | None:
    """The credentials ``session``'s chain resolves (cached by the session once resolved)."""
    found = await session.get_credentials()
    if found is None:
        return None
    frozen = await found.get_frozen_credentials()
    return (frozen.access_key, frozen.secret_key, frozen.token)


def unix_time(last_modified: Any) -> float | None:
    """An answer's ``LastModified`` (a datetime) as Unix time; None when it has none."""
    return None if last_modified is None else float(last_modified.timestamp())


def stored_checksum(head: dict[str, Any]) -> str | None:
    """The object's full-object CRC64NVME as the server stored and validated it (HeadObject
    with ChecksumMode=ENABLED), as ``"crc64nvme:<hex>"``; None when it has none (an object an
    older version wrote, or a composite multipart checksum, which is not of the whole)."""
    value = head.get("ChecksumCRC64NVME")
    if not value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    return from_s3_header(str(value))
