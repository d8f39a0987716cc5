"""The pure pieces of the S3 destination: S3's multipart limits and the part plan, the
checksums and ETags S3 computes, and the pool of part buffers. No I/O on the event loop here:
``read_part`` runs in worker threads."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import os
import zlib
from dataclasses import dataclass

from ckptdrain.client.recordfields import ManifestError, format_checksum
from ckptdrain.daemon import checksums

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
# The checksum of a shard's bytes (``x-amz-meta-ckptdrain-checksum``), set when a single
# PutObject creates it. A multipart object records its CRC64NVME as the server-validated
# full-object checksum instead (HeadObject with ChecksumMode=ENABLED returns it).
CHECKSUM_METADATA_KEY = "ckptdrain-checksum"

# S3 answers at most 1,000 entries per listing page.
LIST_PAGE = 1000
# Longest wait for an abort and its confirmation (the sweep and the lifecycle rule catch up).
CLEANUP_TIMEOUT_S = 30.0
# How often an abort is retried when a late part re-appears after it.
ABORT_ROUNDS = 3
# A read thread cannot be interrupted; a cancelled read waits this long for it before giving
# its buffer up for lost (a hung filesystem), rather than reusing memory a thread still writes.
READ_DRAIN_TIMEOUT_S = 60.0


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
    """The ``x-amz-checksum-crc32`` value: base64 of the big-endian CRC32 (small objects:
    manifests, part records, LATEST)."""
    return base64.b64encode(bytes.fromhex(crc_hex)).decode("ascii")


def crc64_header(crc: int) -> str:
    """The ``x-amz-checksum-crc64nvme`` value of a part or object: base64, big-endian."""
    return base64.b64encode(crc.to_bytes(8, "big")).decode("ascii")


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart object: md5 of the parts' binary md5s, ``-N``."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(bytes.fromhex(etag.strip('"')))
    return f'"{digest.hexdigest()}-{len(part_etags)}"'


def part_checksum(crc: int) -> str:
    """How a part's checksum is journalled: ``"crc64nvme:<16 hex>"`` (an upload journalled
    with another algorithm by an older version is not resumed: see ``resumable_checksum``)."""
    return format_checksum(checksums.ALGO, f"{crc:016x}")


def part_crc(journalled: str) -> int | None:
    """The CRC64NVME a journalled part checksum holds; None for another algorithm."""
    try:
        return checksums.value_of(journalled)
    except (ValueError, ManifestError):
        return None


def same_etag(a: str, b: str) -> bool:
    return a.strip('"') == b.strip('"')


def read_part(fd: int, buf: bytearray, offset: int) -> int:
    """Fill ``buf`` from ``fd`` at ``offset``; the CRC64NVME of the part. Runs in a worker
    thread. Parts are checksummed independently (in any order, in any process) and their CRCs
    combined into the object's (``checksums.combine``), so no pass over the file is serial."""
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
    return checksums.crc64nvme_int(view)


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
