"""Many small shards written to a POSIX destination in one worker-thread job.

One shard at a time, a 64 KiB shard costs a thread hop, a walk from the root to its directory,
a pacing round trip to the event loop, and two fsyncs (the file's, the directory's), each
forcing its own filesystem journal commit. Here a batch of shards pays the hop and the walk
once per directory, and its fsyncs overlap: every file is written and its writeback started
first, then each is fsynced (by then their data is on its way together, and the fsyncs share
journal commits), then each is linked into place and the directory fsynced once.

The guarantees are each shard's as in :meth:`PosixBackend.put_file`: a name appears only with
its complete, fsynced bytes and its checksum xattr (``link`` of a temp file, which fails on an
existing name), and the name itself is durable (the directory fsync) before the call returns
the shard as written. A shard whose name is taken is handed back unwritten (None): the
caller sends it through ``put_file``, which decides what to do about the file in the way.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.beneath import Entry
from ckptdrain.daemon.backends.posixfs import backend_error, link_temp
from ckptdrain.daemon.checksums import Stopped
from ckptdrain.daemon.filecopy import Truncated, copy_and_checksum

if TYPE_CHECKING:
    from ckptdrain.daemon.backends.posix import PosixBackend

# What one batch may hold: small enough that a batch is one short thread job (and a stop is
# seen within it), large enough that a generation of 64 KiB shards takes few of them.
BATCH_SHARDS = 64
BATCH_BYTES = 16 << 20
# Shards up to this size go in batches; larger ones are copied on their own (put_file).
SMALL_SHARD_BYTES = 1 << 20
# Batches written at once to a local filesystem (PosixBackend.batch_lanes). There a file
# operation takes microseconds, so a batch's time is the interpreter's, and batches side by
# side only take turns at it: each turn is a lock hand-off and two context switches. 10,000
# shards of 64 KiB from 64 ranks to ext4 here: 8 batches at once cost 1.9 CPU ms a shard and
# 15 s to the commit, 2 at once 1.5 ms and 13 s (the drain of one batch overlaps its own
# fsyncs already). A network filesystem gets the drain's full concurrency: its operations
# wait on a server, and batches side by side hide the wait.
LOCAL_BATCH_LANES = 2


class _Taken:
    """The shard's name exists at the destination: send it through put_file."""


TAKEN: Final = _Taken()
Outcome = str | BackendError | _Taken


@dataclass(slots=True)
class _Open:
    index: int
    entry: Entry
    tmp: Entry
    fd: int
    checksum: str = ""


def create_many(backend: PosixBackend, items: Sequence[tuple[Entry, int, int]],
                stop: threading.Event) -> list[str | BackendError | None]:
    """Write every ``(final entry, source fd, size)``; per item, its checksum, the error that
    failed it, or None when its name was taken. Blocking: a worker thread's. On ``stop`` every temp file is
    removed and :class:`Stopped` raised."""
    outcomes: list[Outcome | None] = [None] * len(items)
    by_dir: dict[tuple[str, ...], list[int]] = {}
    for i, (entry, _, _) in enumerate(items):
        by_dir.setdefault(entry.dir, []).append(i)
    for parts, indexes in by_dir.items():
        what = f"writing {len(indexes)} shards into {'/'.join(parts)}"
        try:
            with backend.fs.dir(parts, create=True) as dir_fd:
                backend._parallel_writes(dir_fd)  # learns batch_lanes (once)
                _one_directory(backend, dir_fd, items, indexes, outcomes, stop)
        except OSError as exc:
            error = backend_error(exc, f"{what} at {backend.uri}", backend._root_str)
            for i in indexes:
                if outcomes[i] is None or isinstance(outcomes[i], str):
                    # A name not durable yet is not written: the retry finds it and settles.
                    outcomes[i] = error
        except BackendError as exc:  # a link planted on the way (UnsafePath)
            for i in indexes:
                outcomes[i] = exc
    return [None if isinstance(o, _Taken) else
            o if o is not None else BackendError("not written", transient=True)
            for o in outcomes]


def _one_directory(backend: PosixBackend, dir_fd: int, items: Sequence[tuple[Entry, int, int]],
                   indexes: list[int], outcomes: list[Outcome | None],
                   stop: threading.Event) -> None:
    opened: list[_Open] = []
    try:
        for i in indexes:
            if stop.is_set():
                raise Stopped
            entry, src_fd, size = items[i]
            try:
                tmp, out = backend._open_temp(dir_fd, entry)
            except OSError as exc:
                outcomes[i] = backend_error(exc, f"writing {entry.name} at {backend.uri}",
                                             backend._root_str)
                continue
            o = _Open(i, entry, tmp, out)
            opened.append(o)
            try:
                o.checksum = copy_and_checksum(src_fd, out, size, stop, entry.name,
                                               mapped=src_fd)
                backend._xattr.record(out, o.checksum)  # (its writeback began in the copy)
            except OSError as exc:
                outcomes[i] = backend_error(exc, f"writing {entry.name} at {backend.uri}",
                                             backend._root_str)
            except Truncated as exc:
                outcomes[i] = BackendError(str(exc), kind="integrity")
        for o in opened:
            if outcomes[o.index] is None:
                try:
                    os.fsync(o.fd)
                except OSError as exc:
                    outcomes[o.index] = backend_error(
                        exc, f"writing {o.entry.name} at {backend.uri}", backend._root_str)
        for o in opened:
            os.close(o.fd)
            o.fd = -1
            if outcomes[o.index] is not None:
                continue
            if stop.is_set():
                raise Stopped
            what = f"writing {o.entry.name} at {backend.uri}"
            try:
                # The checksum once the directory fsync below is done.
                linked = link_temp(dir_fd, o.tmp.name, o.entry.name, what)
                outcomes[o.index] = o.checksum if linked else TAKEN
            except BackendError as exc:
                outcomes[o.index] = exc
            except OSError as exc:
                outcomes[o.index] = backend_error(exc, f"writing {o.entry.name} at {backend.uri}",
                                                  backend._root_str)
    finally:
        for o in opened:
            if o.fd >= 0:
                os.close(o.fd)
            backend._unlink_temp(dir_fd, o.tmp)
    if any(isinstance(outcomes[o.index], str) for o in opened):
        os.fsync(dir_fd)  # the names: one fsync for every shard linked here

