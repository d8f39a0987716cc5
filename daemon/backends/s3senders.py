"""Who sends shard bodies to S3 (multipart parts and single PutObjects): the daemon's own event
loop, or worker processes (the pool of them is s3pool.py).

Sending a body is the S3 drain's byte work: read it from the staged file, checksum it, and
write it into an HTTP request. In one process that work sits on the event loop thread (aiohttp
writes bodies there), which caps a daemon near one core. ``s3pool.WorkerSenders`` moves it
into ``drain.workers`` processes (s3worker.py), each with its own event loop and S3 client,
together with the small requests each shard makes (HEAD, create, complete, abort); the daemon
keeps everything that decides: which upload to create or complete, the journal, the commit.
"""

from __future__ import annotations

import abc
import datetime
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.s3bodies import FileBody, checksum_range, in_thread
from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3parts import (
    CHECKSUM_METADATA_KEY,
    crc64_header,
)
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.logs import log_event

if TYPE_CHECKING:
    from ckptdrain.daemon.backends.s3client import S3Client

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class Part:
    """One part to send: ``length`` bytes of the staged file at ``offset``. ``kept_crc`` is the
    CRC64NVME of a part already on the server (a resumed upload): when the staged bytes have
    that checksum the part is not sent again and ``kept_etag`` is its answer."""

    key: str  # the shard's key (for messages)
    full: str  # the object key in the bucket
    upload_id: str
    number: int
    offset: int
    length: int
    kept_crc: int | None = None
    kept_etag: str = ""


@dataclass(frozen=True, slots=True)
class Whole:
    """A whole object sent in one PutObject: ``size`` bytes of the staged file from offset 0,
    with ``metadata`` (the sender adds the checksum it computes) and, when ``exclusive``,
    ``If-None-Match: *`` (a taken key fails with the server's PreconditionFailed)."""

    key: str
    full: str
    size: int
    metadata: dict[str, str]
    exclusive: bool


@dataclass(frozen=True, slots=True)
class Sent:
    etag: str
    crc: int
    uploaded: bool  # False: a kept part, checksummed and found unchanged


@dataclass(frozen=True, slots=True)
class Put:
    """A whole object's PutObject, answered: the CRC64NVME of its bytes, and the ETag the
    server gave the object ("" when the answer carried none)."""

    crc: int
    etag: str


class PartSender(abc.ABC):
    """Who moves shard bodies to S3: :class:`InProcessSender` or :class:`WorkerSenders`."""

    @abc.abstractmethod
    async def send(self, part: Part, fd: int) -> Sent:
        """Send ``part`` of the file ``fd`` (the caller keeps owning ``fd``)."""

    @abc.abstractmethod
    async def put(self, whole: Whole, fd: int) -> Put:
        """PutObject ``whole`` from the file ``fd``: the CRC64NVME of its bytes and its ETag."""

    @abc.abstractmethod
    async def call(self, what: str, operation: str, params: dict[str, Any], *,
                   body: bytes | None = None, read_max: int | None = None) -> dict[str, Any]:
        """One request of :data:`SMALL_OPERATIONS`: its answer. ``body`` is a small object's
        bytes to send (PutObject); with ``read_max``, the object's bytes are read whole into
        the answer's ``Body`` (GetObject), and one longer than that fails as ``integrity``."""

    @abc.abstractmethod
    async def call_many(self, what: str, operation: str,
                        params: list[dict[str, Any]]) -> list[dict[str, Any] | S3Failure]:
        """Many requests of one of :data:`BATCHED_OPERATIONS` (the commit's HEAD of every
        shard): each one's answer, or the S3Failure it got, in order. An upload worker takes
        them as one message, so the daemon's loop pays one hand-over per batch, not per
        shard."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Start what the sender runs before the first shard needs it."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Stop whatever the sender runs."""


# Every request the daemon makes besides shard bodies and streamed reads: what each shard
# makes (HEAD before a multipart upload, create, complete, abort) and what the commit and the
# sweeps make (part records, manifests and LATEST written and read, listings, deletes). With
# upload workers a worker sends them: building, signing and parsing one botocore request costs
# 1.6-2.6 CPU ms, against about 0.4 ms for the daemon's loop to hand it to a worker.
SMALL_OPERATIONS = frozenset({
    "head_object", "create_multipart_upload", "complete_multipart_upload",
    "abort_multipart_upload", "list_parts", "list_multipart_uploads", "list_objects_v2",
    "get_object", "put_object", "delete_object", "delete_objects"})


# Requests that may go in one batch (PartSender.call_many): reads whose answers are small.
BATCHED_OPERATIONS = frozenset({"head_object"})
# How many requests of one batch are in flight at once (one connection each).
BATCH_AT_ONCE = 16


async def call_each(client: S3Client, what: str, operation: str,
                    params: list[dict[str, Any]]) -> list[dict[str, Any] | S3Failure]:
    """:meth:`PartSender.call_many` from this process: each request's answer, or the
    S3Failure it got, in order; at most :data:`BATCH_AT_ONCE` at once. Any other failure
    (a closed backend) fails the batch as itself, as it fails one request."""

    if operation not in BATCHED_OPERATIONS:
        raise ValueError(f"{operation} is not sent in batches")
    results: list[dict[str, Any] | S3Failure] = [{} for _ in params]

    # The only batched operation is HEAD, which the runtime also sends (where it can).
    crt = client.crt if client.crt is not None and await client.crt.available() else None

    async def one(i: int) -> None:
        # Each its own label: a failure names its own key, not the batch's first.
        label = f"{what} {params[i].get('Key', '')}"
        try:
            if crt is not None:
                results[i] = await crt.head(label, str(params[i]["Key"]))
            else:
                results[i] = await client._call(label, operation, **params[i])
        except S3Failure as exc:
            results[i] = exc

    await for_each_bounded(range(len(params)), one, BATCH_AT_ONCE)
    return results


async def call_in_process(client: S3Client, what: str, operation: str, params: dict[str, Any],
                          body: bytes | None, read_max: int | None) -> dict[str, Any]:
    """:meth:`PartSender.call` from this process (a worker's, or the daemon's own).

    A small object's bytes cut short after its answer's headers came (a reset, fewer bytes
    than its Content-Length) are asked for again, up to ``max_attempts`` requests in all:
    botocore's retries end where the headers arrive, and one cut read of a MANIFEST.json
    failed `ls`, `verify`, `restore` and a loader's fetch (found attacking). Only reads take
    ``read_max``, and reading again changes nothing at the destination."""
    if body is not None:
        # A bytearray, not bytes: botocore wraps bytes in a BytesIO and then sends "Expect:
        # 100-continue", a round trip per object, which aiohttp waits on without a timeout.
        params = {**params, "Body": bytearray(body)}
    attempt = 1
    while True:
        answer: dict[str, Any] = await client._call(what, operation, **params)
        if read_max is None:
            return answer
        try:
            return {**answer, "Body": await _small_body(client, what, answer, params, read_max)}
        except S3Failure as exc:
            if not exc.transient or attempt >= client._max_attempts:
                raise
            log_event(log, logging.INFO, "s3_read_retried", key=params.get("Key"),
                      attempt=attempt, error=str(exc))
            attempt += 1


async def _small_body(client: S3Client, what: str, answer: dict[str, Any],
                      params: dict[str, Any], read_max: int) -> bytes:
    """A small object's whole body, read from ``answer``; no more than ``read_max`` bytes."""
    async with answer["Body"] as stream:
        length = int(answer.get("ContentLength") or 0)
        if length > read_max:
            raise S3Failure(
                f"{params.get('Key')} at {client.uri} is {length} bytes, more than the "
                f"{read_max} expected of a small object; it is not one this daemon wrote",
                transient=False, kind="integrity")
        with client._translating(what):
            data: bytes = await stream.read()
    return data


def to_message(answer: dict[str, Any]) -> dict[str, Any]:
    """A botocore answer as JSON: its datetimes (LastModified) as tagged ISO strings. A dict
    of the answer that looks like a tag (user metadata may name a key ``__datetime__``) is
    wrapped in a tag of its own, so :func:`from_message` never takes data for a tag."""
    def convert(value: Any) -> Any:
        if isinstance(value, datetime.datetime):
            return {_DATETIME_TAG: value.isoformat()}
        if isinstance(value, dict):
            converted = {str(k): convert(v) for k, v in value.items()}
            if len(converted) == 1 and next(iter(converted)) in _TAGS:
                return {_DICT_TAG: converted}
            return converted
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        return value
    return {str(k): convert(v) for k, v in answer.items() if k != "Body"}


def from_message(message: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`to_message`."""
    def convert(value: Any) -> Any:
        if isinstance(value, dict):
            if len(value) == 1:
                ((key, inner),) = value.items()
                if key == _DATETIME_TAG:
                    return datetime.datetime.fromisoformat(str(inner))
                if key == _DICT_TAG:
                    return {k: convert(v) for k, v in dict(inner).items()}
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value
    return {k: convert(v) for k, v in message.items()}


_DATETIME_TAG = "__datetime__"
_DICT_TAG = "__dict__"
_TAGS = frozenset({_DATETIME_TAG, _DICT_TAG})

async def send_in_process(client: S3Client, part: Part, fd: int) -> Sent:
    """Checksum and upload one part from this process (a worker's, or the daemon's own when
    ``drain.workers = 0``). A worker sends it from the file (s3bodies.FileBody); the daemon
    reads it into a buffer from the client's pool."""
    if client.file_bodies:
        crc = await in_thread(checksum_range, fd, part.offset, part.length)
        if part.kept_crc is not None and part.kept_crc == crc:
            return Sent(part.kept_etag, crc, uploaded=False)
        answer = await client._call(
            f"uploading part {part.number} of {part.key}", "upload_part",
            Bucket=client.bucket, Key=part.full, UploadId=part.upload_id,
            PartNumber=part.number, Body=FileBody(fd, part.offset, part.length),
            ContentLength=part.length, ChecksumCRC64NVME=crc64_header(crc),
        )
        return Sent(str(answer["ETag"]), crc, uploaded=True)
    buf = await client.buffers.acquire(part.length)
    reuse = False
    try:
        crc = await client._read(fd, buf, part.offset)
        reuse = True  # no thread writes into buf any more
        if part.kept_crc is not None and part.kept_crc == crc:
            return Sent(part.kept_etag, crc, uploaded=False)
        answer = await client._call(
            f"uploading part {part.number} of {part.key}", "upload_part",
            Bucket=client.bucket, Key=part.full, UploadId=part.upload_id,
            PartNumber=part.number, Body=buf, ContentLength=part.length,
            ChecksumCRC64NVME=crc64_header(crc),
        )
        return Sent(str(answer["ETag"]), crc, uploaded=True)
    finally:
        client.buffers.release(buf, reuse=reuse)


async def put_in_process(client: S3Client, whole: Whole, fd: int) -> Put:
    """Checksum and PutObject a whole object from this process (from the file in a worker)."""
    crc: int | None = None
    if client.crt is not None and await client.crt.available():
        whole_file: bool
        crc, whole_file = await in_thread(_checksum_whole, fd, whole.size)
        if whole_file:  # the runtime sends the whole file: only when it is the whole object
            etag = await client.crt.put(f"uploading {whole.key}", whole.full, fd, whole.size,
                                        crc, _metadata(whole, crc), whole.exclusive)
            return Put(crc, etag)
    if client.file_bodies:
        if crc is None:  # not read above already
            crc = await in_thread(checksum_range, fd, 0, whole.size)
        answer = await client._call(
            f"uploading {whole.key}", "put_object",
            **_put_params(client, whole, FileBody(fd, 0, whole.size), crc))
        return Put(crc, str(answer.get("ETag") or ""))
    buf = await client.buffers.acquire(whole.size)
    reuse = False
    try:
        read_crc = await client._read(fd, buf, 0)
        reuse = True
        answer = await client._call(f"uploading {whole.key}", "put_object",
                                    **_put_params(client, whole, buf, read_crc))
        return Put(read_crc, str(answer.get("ETag") or ""))
    finally:
        client.buffers.release(buf, reuse=reuse)


def _checksum_whole(fd: int, size: int) -> tuple[int, bool]:
    """The CRC64NVME of the object's ``size`` bytes, and whether they are all of the file
    (blocking: worker threads only)."""
    return checksum_range(fd, 0, size), os.fstat(fd).st_size == size


def _metadata(whole: Whole, crc: int) -> dict[str, str]:
    return {**whole.metadata, CHECKSUM_METADATA_KEY: checksums.combine([(crc, whole.size)])}


def _put_params(client: S3Client, whole: Whole, body: Any, crc: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "Bucket": client.bucket, "Key": whole.full, "Body": body,
        "ContentLength": whole.size, "ChecksumCRC64NVME": crc64_header(crc),
        "Metadata": _metadata(whole, crc),
    }
    if whole.exclusive:
        params["IfNoneMatch"] = "*"
    return params


class InProcessSender(PartSender):
    """``drain.workers = 0``: bodies go out on the daemon's own event loop."""

    def __init__(self, client: S3Client) -> None:
        self._client = client

    async def send(self, part: Part, fd: int) -> Sent:
        return await send_in_process(self._client, part, fd)

    async def put(self, whole: Whole, fd: int) -> Put:
        return await put_in_process(self._client, whole, fd)

    async def call(self, what: str, operation: str, params: dict[str, Any], *,
                   body: bytes | None = None, read_max: int | None = None) -> dict[str, Any]:
        return await call_in_process(self._client, what, operation, params, body, read_max)

    async def call_many(self, what: str, operation: str,
                        params: list[dict[str, Any]]) -> list[dict[str, Any] | S3Failure]:
        return await call_each(self._client, what, operation, params)
