"""The checksums the daemon computes over shard bytes.

New shards are checksummed with CRC64NVME (``"crc64nvme:<16 hex>"``): the checksum S3 itself
validates as an object's full-object checksum, computed by the AWS common runtime (``awscrt``)
at memory speed, and combinable, so parts hashed in any order (or in different processes) make
the shard's value without a second pass. Manifests of format 1 recorded sha256; those are still
verified and restored with sha256, chosen from the checksum string itself (``for_checksum``).

Everything here is pure computation over buffers the caller holds; what reads files runs in the
caller's worker thread.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from types import ModuleType
from typing import Protocol

from ckptdrain.client.recordfields import format_checksum, parse_checksum
from ckptdrain.daemon.errors import DaemonError

# What the daemon writes; manifests say which algorithm each checksum is.
ALGO = "crc64nvme"
LEGACY_ALGO = "sha256"
# Reading a file only to checksum it: a reused buffer this size (page-cache reads).
READ_CHUNK_BYTES = 1 << 20


_crt: ModuleType | None = None


def crt() -> ModuleType:
    """``awscrt.checksums``, imported on first use: loading awscrt takes about 70 ms (its TLS
    library gathers CPU jitter entropy as it loads), which commands that never checksum a
    byte (``status``, ``ls``, ``gc``) should not pay."""
    global _crt
    if _crt is None:
        from awscrt import checksums as loaded

        _crt = loaded
    return _crt


class Stopped(DaemonError):
    """A checksum thread gave up because the coroutine awaiting it was cancelled."""


class Digest(Protocol):
    algo: str

    def update(self, data: bytes | bytearray | memoryview) -> None: ...

    def value(self) -> str:
        """``"<algo>:<hex>"`` of everything given so far."""
        ...


class Crc64nvme:
    algo = ALGO

    def __init__(self, crc: int = 0) -> None:
        self.crc = crc

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.crc = crt().crc64nvme(data, self.crc)

    def value(self) -> str:
        return format_checksum(ALGO, f"{self.crc:016x}")


class Sha256:
    algo = LEGACY_ALGO

    def __init__(self) -> None:
        self._digest = hashlib.sha256()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._digest.update(data)

    def value(self) -> str:
        return format_checksum(LEGACY_ALGO, self._digest.hexdigest())


def new(algo: str = ALGO) -> Digest:
    if algo == ALGO:
        return Crc64nvme()
    if algo == LEGACY_ALGO:
        return Sha256()
    raise ValueError(f"no checksum algorithm {algo!r}; use {ALGO!r}")


def for_checksum(expected: str) -> Digest:
    """A digest of the algorithm ``expected`` was computed with (to compare against it)."""
    return new(parse_checksum(expected)[0])


def of_bytes(data: bytes | bytearray | memoryview, algo: str = ALGO) -> str:
    digest = new(algo)
    digest.update(data)
    return digest.value()


def crc64nvme_int(data: bytes | bytearray | memoryview) -> int:
    return int(crt().crc64nvme(data))


def combine(parts: list[tuple[int, int]]) -> str:
    """The CRC64NVME of consecutive blocks given as ``[(crc, length), ...]`` in file order."""
    crc = 0
    for part_crc, length in parts:
        crc = crt().combine_crc64nvme(crc, part_crc, length) if length else crc
    return format_checksum(ALGO, f"{crc:016x}")


def value_of(checksum: str) -> int:
    """The integer of a ``"crc64nvme:<hex>"`` checksum."""
    algo, digest = parse_checksum(checksum)
    if algo != ALGO:
        raise ValueError(f"{checksum!r} is not a {ALGO} checksum")
    return int(digest, 16)


def s3_header(checksum: str) -> str:
    """The ``x-amz-checksum-crc64nvme`` value of a ``"crc64nvme:<hex>"`` checksum: base64 of
    the 8 big-endian bytes."""
    return base64.b64encode(value_of(checksum).to_bytes(8, "big")).decode("ascii")


def from_s3_header(header: str) -> str | None:
    """The checksum string of an ``x-amz-checksum-crc64nvme`` value, None if malformed."""
    try:
        raw = base64.b64decode(header, validate=True)
    except (ValueError, TypeError):
        return None
    if len(raw) != 8:
        return None
    return format_checksum(ALGO, raw.hex())


def of_file(fd: int, size: int, stop: threading.Event, algo: str = ALGO,
            buf: bytearray | None = None) -> str:
    """The checksum of the first ``size`` bytes of ``fd`` (pread from 0, through a reused
    buffer); gives up between reads once ``stop`` is set. Blocking: a worker thread's."""
    view = memoryview(buf if buf is not None else bytearray(READ_CHUNK_BYTES))
    digest = new(algo)
    offset = 0
    while offset < size:
        if stop.is_set():
            raise Stopped
        n = os.preadv(fd, [view[: min(len(view), size - offset)]], offset)
        if n == 0:
            raise OSError(
                f"staged file ended at byte {offset}, before the {size} bytes declared: it was "
                "truncated after hand-off"
            )
        digest.update(view[:n])
        offset += n
    return digest.value()
