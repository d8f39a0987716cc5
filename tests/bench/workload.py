"""The bytes a benchmark moves, and the plain operations on them that both sides share.

Shard data is random (so no layer can compress or deduplicate it) and made once per
benchmark; ours and the baseline move exactly the same buffer or the same files.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from ckptdrain.client import Client
from tests.bench.report import MiB

# Random bytes are slow to make (os.urandom runs near 300 MB/s here): big buffers repeat one
# random block. Nothing on the path deduplicates or compresses, so repetition costs nothing.
_BLOCK_BYTES = 64 * MiB

# Settings for a daemon that takes hand-offs but does not drain (1 byte/s: the first shard
# waits longer than any benchmark runs). Used to time the hand-off path alone, and to stage
# shards for a drain timed on its own.
DRAIN_PAUSED = {"CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S": "1"}


def random_buffer(size: int) -> bytearray:
    """``size`` bytes of random data, as one contiguous buffer."""
    if size <= _BLOCK_BYTES:
        return bytearray(os.urandom(size))
    block = os.urandom(_BLOCK_BYTES)
    buf = bytearray(size)
    view = memoryview(buf)
    for off in range(0, size, _BLOCK_BYTES):
        n = min(_BLOCK_BYTES, size - off)
        view[off:off + n] = block[:n]
    view.release()
    return buf


def write_all(fd: int, data: bytes | bytearray | memoryview, offset: int | None = None) -> None:
    """Write every byte (os.write may write less than asked, and caps one call near 2 GiB)."""
    with memoryview(data) as view, view.cast("B") as flat:
        done = 0
        while done < len(flat):
            chunk = flat[done:done + (1 << 30)]
            done += os.write(fd, chunk) if offset is None else os.pwrite(fd, chunk, offset + done)


def write_files(directory: Path, names: Sequence[str], data: bytes | bytearray) -> list[Path]:
    """One fsynced file per name, each holding ``data``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / name for name in names]
    for path in paths:
        durable_write(path, data)
    return paths


def durable_write(path: Path, data: bytes | bytearray | memoryview) -> float:
    """The baseline for a hand-off: create, write, fsync, close. Returns the seconds it took."""
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def generation_dir(dest: Path, job: str, step: int) -> Path:
    return dest / job / f"{step:020d}"


def commit_and_clear(client: Client, job: str, step: int, dest: Path | None,
                     timeout_s: float = 900.0) -> None:
    """Wait until the generation is committed, then delete it from a ``file://`` destination
    (the next run must not find its bytes in the way, nor the disk fuller)."""
    client.wait(job, step, timeout_s=timeout_s)
    if dest is not None:
        shutil.rmtree(generation_dir(dest, job, step), ignore_errors=True)


def settle() -> None:
    """Before a timed step: flush every dirty page, so neither side pays for the other's
    write-back."""
    os.sync()
