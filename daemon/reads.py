"""Reads for clients. A reader's fast path (`open`): this node's local copy of a committed
shard, as a read-only fd the client reads itself, once the daemon has checked it against the
manifest. A `fetch`: a shard copied into the client's file, from the local copy or the
destination.

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
import fcntl
import logging
import os
import stat
from typing import TYPE_CHECKING, Any

from ckptdrain.client import wire
from ckptdrain.client.recordfields import parse_checksum
from ckptdrain.daemon import checksums, permissions
from ckptdrain.daemon.channel import writable
from ckptdrain.daemon.errors import DaemonError, RequestError, destination_error
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.state import GenerationState

if TYPE_CHECKING:
    from ckptdrain.daemon.connection import ClientHandler
    from ckptdrain.daemon.staging import Staging

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
    permissions.check_job_owner(h, job, "read it through this daemon")
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
    try:
        await d.copies.may_lend(shard)  # what the job's owner holds open stays within its share
    except BaseException:
        close()
        raise
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
    from ckptdrain.client.keys import shard_key
    from ckptdrain.client.recordfields import ManifestError
    from ckptdrain.daemon.backends.base import BackendError
    from ckptdrain.daemon.catalog import removed_meanwhile

    d = h.d
    await permissions.check_destination_owner(h, job)
    permissions.check_job_owner(h, job, "read it through this daemon")
    try:
        committed = await d.committer.committed_shards(job, step)
        if committed is None:
            raise RequestError(wire.NOT_FOUND, f"step {step} of job {job!r} is not committed")
        entry = committed.by_path.get(path)
        if entry is None:
            # details.missing: the step is committed, this file is not in it (a DrainReader
            # of a step not saved through DCP says so), read by field, not by wording.
            raise RequestError(wire.NOT_FOUND, f"step {step} of job {job!r} has no shard {path!r}",
                               {"missing": "shard"})
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
                shard_key(job, step, path), into, h.uid, algo=entry.algo, expected_size=entry.size,
                gone=gone)
    except (BackendError, ManifestError) as exc:
        if isinstance(exc, BackendError) and await removed_meanwhile(d.backend, job, step, exc):
            # Found attacking retention: a generation another node's retention (or `gc`)
            # removed after this daemon read its manifest was still "committed" here, and
            # each fetch said "could not read ... check the destination and retry", which no
            # retry mends (the manifest stays cached).
            d.committer.manifests.forget(job, [step])
            raise RequestError(wire.NOT_FOUND, f"step {step} of job {job!r} was removed from "
                               "the destination while it was read (retention keeps the "
                               "newest retention.keep_last committed steps): load a newer "
                               "step (`ckptdrain ls` lists them)") from None
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


async def fetch(h: ClientHandler, job: str, step: int, path: str, fd: int, *,
                from_destination: bool) -> dict[str, Any]:
    """A shard copied into the client's file ``fd`` (owned: closed, or left to a stuck
    thread): from this node's local copy, or read from the destination."""
    if not from_destination:
        return await _fetch_local(h, job, step, path, fd)
    owned = True
    try:
        # The destination's threads write into it: checked and emptied off the loop
        # (a pipe or socket is the client's mistake, not a destination error).
        owned = False
        try:
            await h.d.dataplane.client_call(
                h.uid, _prepare_target, fd,
                cleanup=lambda: h.d.dataplane.close_client_fd(fd, h.uid))
        except _BadTarget as exc:
            raise RequestError(wire.BAD_REQUEST, str(exc)) from None
        except OSError as exc:
            raise RequestError(wire.BAD_REQUEST, "could not empty the file passed for "
                               f"{path!r}: {exc.strerror or exc}") from None
        owned = True  # the call returned: the fd is ours again (dataplane.call)
        return await fetch_from_destination(h, job, step, path, fd)
    finally:
        if owned:
            h.d.dataplane.close_client_fd(fd, h.uid)


async def _fetch_local(h: ClientHandler, job: str, step: int, path: str, out_fd: int
                       ) -> dict[str, Any]:
    """Restore's fast path: copy this node's local copy of a committed shard into the
    client's file. The client checks the checksum against the manifest: a local copy is
    never trusted on its own. Owns ``out_fd`` (closes it, or leaves it to a stuck thread)."""
    owned = True
    try:
        permissions.check_job_owner(h, job, "read it through this daemon")
        gen = h.d.ledger.get(job, step)
        shard = gen.shards.get(path) if gen is not None else None
        if (gen is None or shard is None or gen.state is not GenerationState.COMMITTED
                or not shard.local_copy):
            raise RequestError(wire.NOT_FOUND, f"this node holds no local copy of {path!r} "
                               f"of step {step} of job {job!r}; read it from the destination")
        # Checked in the data plane: the client's file may sit on a mount that hangs.
        # The call owns the fd from here; if it fails, its clean-up closes it.
        owned = False
        # Checksummed with the algorithm of the recorded one (a sha256 of an older version's
        # drain), so the client's comparison with the manifest is like for like.
        algo = parse_checksum(shard.checksum)[0] if shard.checksum else checksums.ALGO
        try:
            size, checksum = await h.d.dataplane.client_call(
                h.uid, _copy_to_client, h.d.staging, shard.staged_name, out_fd, algo,
                cleanup=lambda: h.d.dataplane.close_client_fd(out_fd, h.uid))
        except _BadTarget as exc:
            raise RequestError(wire.BAD_REQUEST, str(exc)) from None
        except FileNotFoundError:
            raise RequestError(wire.NOT_FOUND, f"this node's local copy of {path!r} is gone; "
                               "read it from the destination") from None
        except OSError as exc:
            raise RequestError(wire.BAD_REQUEST, f"could not write {path!r} to the file "
                               f"passed: {exc.strerror or exc}") from None
        owned = True
        return {"path": path, "size": size, "checksum": checksum}
    finally:
        if owned:  # closing a client's file can block (NFS flushes on close): off the loop
            h.d.dataplane.close_client_fd(out_fd, h.uid)


class _BadTarget(DaemonError):
    """The fd passed to fetch cannot take the shard (raised in the data plane)."""


def _prepare_target(fd: int) -> None:
    """Make the client's file for a fetch ready to become exactly the shard: a regular file
    open for writing, without O_APPEND (which puts every write at the end, so ranges written
    at their offsets came out scrambled, with a checksum that still matched), and emptied
    (what it held would stay past the shard's end). Blocking: the data plane's."""
    if not (writable(fd) and stat.S_ISREG(os.fstat(fd).st_mode)):
        raise _BadTarget("fetch needs a regular file opened for writing")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
        raise _BadTarget("fetch needs a file opened without O_APPEND: the shard is written at "
                         "its own offsets")
    os.ftruncate(fd, 0)


def _copy_to_client(staging: Staging, name: str, out_fd: int, algo: str) -> tuple[int, str]:
    _prepare_target(out_fd)
    return staging.copy_out(name, out_fd, algo)
