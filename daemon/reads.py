"""A reader's fast path (`open`): this node's local copy of a committed shard, as a
read-only fd the client reads itself, once the daemon has checked it against the manifest.

The checksum the ledger holds for a drained shard is the one its part record (and so the
committed manifest) lists. The drain that computed it read the staged file, and recorded the
file's identity (:func:`identity`: device, inode, size, mtime and ctime in nanoseconds) as it
was before and after that read. When the fd opened now is that file with that identity, the
checksum still vouches for it: staged files are renamed into place once and never written
again, and any write, truncation, ``utime`` or rename since would have moved its ctime (which
no process can set back). Otherwise (an identity that differs, or none recorded: a daemon
restarted since the drain) the copy is hashed again through the staging's own checksum, and
the fd is checked to be that very file. Anything else (no copy, a copy gone or damaged) is
``not_found``: the client reads the destination instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

from ckptdrain.client import wire
from ckptdrain.client.manifest import parse_checksum
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.state import GenerationState

if TYPE_CHECKING:
    from ckptdrain.daemon.connection import ClientHandler

log = logging.getLogger("ckptdrain.reads")

Identity = tuple[int, int, int, int, int]


def identity(st: os.stat_result) -> Identity:
    """What changes whenever a file's bytes can have: which file, its size, mtime and ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _gone(path: str) -> RequestError:
    return RequestError(wire.NOT_FOUND, f"this node's local copy of {path!r} is gone; read it "
                        "from the destination")


async def open_local(h: ClientHandler, job: str, step: int, path: str) -> int:
    """A read-only fd of this node's verified local copy of ``path``; the caller sends and
    closes it. Raises ``not_found`` when the destination must serve it."""
    d = h.d
    h.check_job_owner(job)
    gen = d.ledger.get(job, step)
    shard = gen.shards.get(path) if gen is not None else None
    if (gen is None or shard is None or gen.state is not GenerationState.COMMITTED
            or not shard.local_copy or not shard.checksum):
        raise RequestError(wire.NOT_FOUND, f"this node holds no local copy of {path!r} of "
                           f"step {step} of job {job!r}; read it from the destination")
    name, expected, vouched = shard.staged_name, shard.checksum, shard.vouched
    opened: list[int] = []

    def verified() -> tuple[bool, Identity, str]:
        opened.append(d.staging.open_data(name))
        before = identity(os.fstat(opened[0]))
        now = os.stat(d.staging.data_path(name))
        if (before[0], before[1]) != (now.st_dev, now.st_ino):
            return False, before, "replaced"
        if vouched == (before, expected):
            return True, before, "recorded"
        checksum = d.staging.checksum(name, parse_checksum(expected)[0])
        # Unchanged while it was hashed, or the hash is of something else.
        return (checksum == expected and identity(os.fstat(opened[0])) == before,
                before, "hashed")

    def close() -> None:
        for fd in opened:
            with contextlib.suppress(OSError):
                os.close(fd)

    try:
        good, seen, checked = await d.dataplane.call(verified, cleanup=close)
    except FileNotFoundError:
        raise _gone(path) from None
    except OSError as exc:
        raise RequestError(wire.NOT_FOUND, f"this node's local copy of {path!r} cannot be read "
                           f"({exc.strerror or exc}); read it from the destination") from None
    if not good:
        close()
        log_event(log, logging.WARNING, "local_copy_damaged", job=job, step=step, path=path,
                  checked=checked, action="dropped; readers use the destination")
        d.copies.discard(shard)
        raise RequestError(wire.NOT_FOUND, f"this node's local copy of {path!r} does not match "
                           "the manifest; read it from the destination")
    if checked == "hashed" and shard.checksum == expected:
        shard.vouched = (seen, expected)  # the next reader need not hash it again
    if not shard.local_copy:  # dropped while it was checked: the fd must not outlive it
        close()
        raise _gone(path)
    d.copies.lent(shard)
    log_event(log, logging.INFO, "local_copy_opened", job=job, step=step, path=path,
              checked=checked)
    return opened[0]


async def fetch_from_destination(h: ClientHandler, job: str, step: int, path: str,
                                 out_fd: int) -> dict[str, object]:
    """Copy ``path`` of committed step ``step`` from the destination into the client's file
    (a reader of an S3 destination stays stdlib-only), checked against the manifest. A client
    that hangs up meanwhile stops the read (a reader killed mid-fetch must not go on pulling
    its shard into a file nobody will open) and its connection ends with no reply. The
    watch ends at a pipelined request's first byte (channel.hangup_watch); the stdlib client
    never pipelines."""
    from ckptdrain.client.manifest import ManifestError, shard_key
    from ckptdrain.daemon.backends.base import BackendError
    from ckptdrain.daemon.connection import destination_error

    d = h.d
    await h.check_destination_owner(job)
    h.check_job_owner(job)
    try:
        committed = await d.committer.committed_shards(job, step)
        if committed is None:
            raise RequestError(wire.NOT_FOUND, f"step {step} of job {job!r} is not committed")
        entry = committed.by_path.get(path)
        if entry is None:
            raise RequestError(wire.NOT_FOUND, f"step {step} of job {job!r} has no shard {path!r}")
        try:
            # The read's own fd (daemon/fetcher.py): closed when the read has ended, which
            # may be after this returns; out_fd stays the connection's.
            into = os.dup(out_fd)
        except OSError as exc:
            raise RequestError(wire.BACKPRESSURE, f"the daemon has too many files open to take "
                               f"the file for {path!r} ({exc.strerror or exc}); retry shortly"
                               ) from None
        with h.channel.hangup_watch() as gone:
            # Read on the fetcher's own loop: this one serves every client.
            size, checksum = await d.fetcher.copy_into(
                shard_key(job, step, path), into, algo=entry.algo, expected_size=entry.size,
                gone=gone)
    except (BackendError, ManifestError) as exc:
        raise destination_error(job, step, exc) from None
    except ConnectionError:
        log_event(log, logging.INFO, "fetch_abandoned", uid=h.uid, job=job, step=step,
                  path=path, action="the client hung up: its read from the destination was "
                  "stopped")
        raise  # no reply: the connection ends
    except OSError as exc:
        raise RequestError(wire.BAD_REQUEST, f"could not write {path!r} to the file passed: "
                           f"{exc.strerror or exc}") from None
    if (size, checksum) != (entry.size, entry.checksum):
        # A size that differs is known before the bytes are read: there is no checksum then.
        found = (f"{size} bytes, {checksum}" if size == entry.size
                 else f"{size} bytes where the manifest lists {entry.size}")
        raise RequestError(wire.DESTINATION, f"{path!r} of step {step} of job {job!r} at the "
                           f"destination does not match its manifest ({found}); "
                           "run `ckptdrain verify` on it")
    return {"path": path, "size": size, "checksum": checksum}
