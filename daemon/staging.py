"""Shard files on node-local storage (NVMe), written so a crash never leaves a half shard
that looks whole.

A shard is received into ``<name>.tmp``, fsynced, renamed to ``<name>.data`` and the
directory fsynced; only then is it journalled and acknowledged. At start-up every ``.tmp``
file and every ``.data`` file the journal does not know is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ckptdrain.daemon import checksums
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.filecopy import copy_and_checksum, hash_file, start_writeback
from ckptdrain.daemon.logs import log_event

if TYPE_CHECKING:
    from ckptdrain.daemon.journalroom import JournalReserve

TMP = ".tmp"
DATA = ".data"
# A staged file's name begins with its job owner's uid (``u<uid>-``), so that a restart that
# finds a copy a reader still holds, its job forgotten, charges it to that uid again (found
# attacking: each restart gave a reader hoarding copies a whole new share). In the name, not
# in an attribute written when the copy is lent: that changed the file's ctime, which
# vouches for it, and concurrent readers took a good copy for a damaged one.
_OWNER_PREFIX = "u"
# Bytes kept free on the staging filesystem beyond our own budget, so the journal's WAL
# and the rest of the node never hit ENOSPC because of us: 64 MiB, or 5% of a small disk.
FREE_SPACE_RESERVE_BYTES = 64 << 20
FREE_SPACE_RESERVE_FRACTION = 0.05


def free_space_reserve(st: os.statvfs_result) -> int:
    """The bytes kept free on a filesystem of ``st`` (FREE_SPACE_RESERVE_*)."""
    return min(FREE_SPACE_RESERVE_BYTES,
               int(st.f_blocks * st.f_frsize * FREE_SPACE_RESERVE_FRACTION))

log = logging.getLogger(__name__)


class _Lease:
    """What :meth:`Staging._leased` found: the open ``fd``, and whether the lease was
    granted (False: the filesystem has no leases)."""

    def __init__(self, fd: int, *, granted: bool = False) -> None:
        self.fd, self.granted = fd, granted


_HELD = _Lease(-1)  # another open file description holds the file: no lease


class StagingFull(DaemonError, OSError):
    """The staging filesystem has no room for the shard; ``out_of_inodes``: no file can be
    created on it, whatever bytes it has free."""

    out_of_inodes = False


# What to do when the staging filesystem has no inode left: lowering max_staged_bytes (the
# advice for bytes) frees none (found attacking: another user's tiny files took them all).
NO_INODES_ADVICE = ("free files on the staging filesystem (small files there, another user's "
                    "included, may hold its inodes), or save fewer, larger shards; lowering "
                    "limits.max_staged_bytes frees no inode")
NO_BYTES_ADVICE = "free space on the staging disk or lower limits.max_staged_bytes"


class Staging:
    def __init__(self, root: Path, journal_reserve: JournalReserve | None = None) -> None:
        self.root = root
        # Files held for the journal's next start (journalroom.py): part of the free-space
        # reserve already, so the room left to shards is the same whether they exist or not.
        self._journal_reserve = journal_reserve
        self.dir = root / "shards"
        self._dir = str(self.dir)  # opened per shard on the loop: no Path built each time
        # Bytes promised to hand-offs being received right now: not on disk yet, so statvfs
        # does not show them, but two concurrent shards must not both count the same room.
        self.pending_bytes = 0
        self._names_prefix = os.urandom(8).hex()
        self._names = itertools.count()

    def prepare(self) -> None:
        # Private whatever the umask (mkdir's mode is filtered by it): shard files are
        # every user's checkpoint bytes.
        if not self.root.exists():
            self.root.mkdir(parents=True, mode=0o700)
            os.chmod(self.root, 0o700)
        self.dir.mkdir(exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)

    def _statvfs(self) -> os.statvfs_result:
        """statvfs of the shards directory. Every hand-off and the daemon's refresh sample it
        first, so this is where a shards directory removed under a running daemon (a tmp
        cleaner, an operator's rm) is made again: every later hand-off failed as an internal
        error until a restart (found attacking the staging side)."""
        try:
            return os.statvfs(self.dir)
        except FileNotFoundError:
            self._remake_dir()
            return os.statvfs(self.dir)

    def _remake_dir(self) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.dir, 0o700)  # not the root: a missing staging_dir is not ours to make
        os.chmod(self.dir, 0o700)
        log_event(log, logging.WARNING, "staging_dir_recreated", path=self._dir,
                  action="something removed the staging directory under the running daemon; "
                  "the shards staged there are lost (their generations fail); keep tmp "
                  "cleaners and people out of staging_dir")

    def new_name(self, owner: int) -> str:
        """A name no staged file of this node had or will have, saying whose job it is: the
        owner's uid, 16 random hex digits drawn once per process, then a counter (uuid4 per
        hand-off was a getrandom call on the event loop: 6% of its samples with 10,000 small
        shards)."""
        return f"{_OWNER_PREFIX}{owner}-{self._names_prefix}{next(self._names):016x}"

    @staticmethod
    def owner_of(name: str) -> int | None:
        """The job owner's uid a staged name carries (None for a name without one)."""
        head, dash, _ = name.partition("-")
        if not dash or not head.startswith(_OWNER_PREFIX) or not head[1:].isdigit():
            return None
        return int(head[1:])

    def tmp_path(self, name: str) -> Path:
        return self.dir / (name + TMP)

    def data_path(self, name: str) -> Path:
        return self.dir / (name + DATA)

    def free(self) -> tuple[int, int]:
        """(free bytes, free inodes) on the staging filesystem, as an unprivileged user sees them."""
        st = self._statvfs()
        return st.f_bavail * st.f_frsize, st.f_favail

    def room(self) -> tuple[int, int, int]:
        """(free bytes, free inodes, reserve still to keep free): one statvfs (blocking: run
        in the data plane)."""
        st = self._statvfs()
        held = self._journal_reserve.held if self._journal_reserve is not None else 0
        return st.f_bavail * st.f_frsize, st.f_favail, max(0, free_space_reserve(st) - held)

    def check_room(self, size: int, room: tuple[int, int, int] | None = None) -> None:
        """Refuse before any byte is accepted when the filesystem itself cannot hold ``size``
        (on top of what concurrent hand-offs are about to write). ``room`` is a sample from
        :meth:`room` taken off the event loop; the comparison with ``pending_bytes`` runs on
        the loop, so two concurrent hand-offs never both count the same free bytes."""
        free_bytes, free_inodes, reserve = room if room is not None else self.room()
        if free_inodes < 2:
            full = StagingFull(
                errno.ENOSPC,
                f"staging filesystem {self.dir} is out of inodes (files): {free_inodes} free, "
                f"though {free_bytes} bytes are",
            )
            full.out_of_inodes = True
            raise full
        if self.shortfall(size, (free_bytes, free_inodes, reserve)) > 0:
            raise StagingFull(
                errno.ENOSPC,
                f"staging filesystem {self.dir} has {free_bytes} bytes free ({self.pending_bytes} "
                f"promised to hand-offs in progress), {size} needed plus a {reserve} byte reserve",
            )

    def shortfall(self, size: int, room: tuple[int, int, int]) -> int:
        """Bytes the filesystem lacks for ``size`` more (0 when it has them), by ``room``."""
        free_bytes, _, reserve = room
        return max(0, size + reserve + self.pending_bytes - free_bytes)

    def open_tmp(self, name: str) -> int:
        return os.open(self.tmp_path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    def open_tmp_sampling(self, name: str) -> tuple[int, tuple[int, int, int]]:
        """:meth:`room`, then :meth:`open_tmp`: a hand-off's two first blocking calls in one
        (a thread's)."""
        room = self.room()
        return self.open_tmp(name), room

    def finish(self, fd: int, name: str) -> None:
        """fsync the temp file, rename it into place, fsync the directory (blocking: run in a
        thread). The caller keeps owning ``fd``."""
        os.fsync(fd)
        os.rename(self.tmp_path(name), self.data_path(name))
        self.fsync_dir()

    def finish_later(self, fd: int, name: str, tail: bytes | memoryview | None = None) -> None:
        """Write ``tail`` (the last bytes received, not written yet), start the temp file's
        writeback and rename it into place; its fsync
        (:meth:`fsync_data`) and the directory's come with the journal commit that
        acknowledges it (blocking: run in a thread). Until that commit a crash leaves a
        ``.data`` file the journal does not know, which recovery deletes. The caller keeps
        owning ``fd``."""
        if tail:
            with memoryview(tail) as view:
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
        start_writeback(fd, 0, 0)
        os.rename(self.tmp_path(name), self.data_path(name))

    def write_sampling(self, name: str, data: bytes | memoryview) -> tuple[int, int, int]:
        """:meth:`room`, then the staged file written whole from ``data`` and renamed into
        place as :meth:`finish_later` leaves it: a small shard whose bytes all came with its
        frame, in one thread job instead of two."""
        room = self.room()
        fd = self.open_tmp(name)
        try:
            self.finish_later(fd, name, data)
        finally:
            os.close(fd)
        return room

    def fsync_data(self, name: str) -> None:
        """fsync a staged shard's bytes, by name (blocking: the journal's thread, in the
        group commit that acknowledges it)."""
        fd = self.open_data(name)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self) -> None:
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def checksum(self, name: str, algo: str = checksums.ALGO) -> str:
        """The checksum (``algo``) of a staged shard, in the manifest's format (blocking: a
        thread's)."""
        fd = self.open_data(name)
        try:
            return hash_file(fd, threading.Event(), algo, owned=True)
        finally:
            os.close(fd)

    def copy_out(self, name: str, out_fd: int, algo: str = checksums.ALGO) -> tuple[int, str]:
        """Copy a staged shard into ``out_fd`` through the kernel; (size, its checksum with
        ``algo``, read back from the page cache) (blocking: a thread's)."""
        fd = self.open_data(name)
        try:
            size = os.fstat(fd).st_size
            # Restore's local fast path: its copy is not fsynced, so no write-behind.
            return size, copy_and_checksum(fd, out_fd, size, threading.Event(), name, algo,
                                           write_behind=False, mapped=fd)
        finally:
            os.close(fd)

    def open_data(self, name: str) -> int:
        return os.open(f"{self._dir}/{name}{DATA}", os.O_RDONLY | os.O_CLOEXEC)

    def exists(self, name: str) -> bool:
        return self.data_path(name).exists()

    def discard(self, name: str) -> None:
        for path in (self.tmp_path(name), self.data_path(name)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def discard_many(self, names: list[str]) -> list[str]:
        """:meth:`discard` of every name, in one blocking call (a thread's); returns the names
        it could not remove (an error other than the file being gone, logged). Their callers
        keep them counted and ask again: raised, one EIO left the rest of the batch on the disk
        with their room given back, and staging held more than max_staged_bytes (found by the
        kill matrix, seed 79026)."""
        kept = []
        for name in names:
            try:
                self.discard(name)
            except OSError as exc:
                kept.append(name)
                log_event(log, logging.WARNING, "staged_copy_not_removed", name=name,
                          error=exc.strerror or str(exc))
        return kept

    def set_aside(self, into: Path, keep: frozenset[str] = frozenset()) -> int:
        """Move every shard file but those named in ``keep`` into ``into`` (made here) and
        remove temp files; how many shard files moved. For a start whose journal is new while
        shard files are staged, or lost its newest records: the files are acknowledged shards
        it would have named. Removed as strays, they went with one info line (found
        attacking)."""
        moved = 0
        for entry in os.scandir(self.dir):
            if entry.name.endswith(TMP):
                _remove_temp(entry.path)
            elif entry.name.endswith(DATA) and entry.name[: -len(DATA)] not in keep:
                if not moved:
                    into.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.rename(entry.path, into / entry.name)
                moved += 1
        return moved

    def discard_unless_open(self, names: list[str]) -> list[str]:
        """:meth:`discard` of each name no other open file description holds; returns the
        names removed. A local copy ``open`` lent to a reader stays in place while the reader
        holds it: unlinked, its blocks stay in use all the same, out of every count (found
        attacking: a user holding such fds filled the staging disk past their share). Asked
        of the kernel with a write lease, which it grants only to the one open of a file (an
        mmap counts as open); a file it is granted for is emptied before it goes, so an
        ``O_PATH`` handle, which no lease sees, keeps no blocks either (found attacking).
        The daemon ignores SIGIO, which an open of a leased file sends its holder."""
        removed = []
        for name in names:
            try:
                if self._unless_open(name):
                    removed.append(name)
            except OSError as exc:  # (EMFILE, EIO): kept, and counted, to be asked again
                log_event(log, logging.WARNING, "staged_copy_not_removed", name=name,
                          error=exc.strerror or str(exc))
        return removed

    def held_open(self, names: list[str]) -> set[str]:
        """Those of ``names`` another open file description holds now (a reader lent the fd
        of a local copy), asked of the kernel as :meth:`discard_unless_open` asks: a write
        lease taken and given back at once. A file that cannot be asked counts as held."""
        held = set()
        for name in names:
            try:
                with self._leased(name) as lease:
                    if lease is _HELD:
                        held.add(name)
            except FileNotFoundError:
                continue
            except OSError:
                held.add(name)
        return held

    def _unless_open(self, name: str) -> bool:
        try:
            with self._leased(name) as lease:
                if lease is _HELD:
                    return False  # open elsewhere: its bytes stay
                if lease.granted:
                    os.ftruncate(lease.fd, 0)
                # (No leases on this filesystem: as before, unlinked only.)
        except FileNotFoundError:
            pass
        self.discard(name)
        return True

    @contextlib.contextmanager
    def _leased(self, name: str) -> Iterator[_Lease]:
        """The staged file ``name`` opened for writing, under a write lease for the block if
        the kernel grants one: it grants it only to the one open of a file (an mmap counts as
        open), so :data:`_HELD` says another open holds it. FileNotFoundError when it is
        gone."""
        fd = os.open(self.data_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            except OSError as exc:
                yield _HELD if exc.errno in (errno.EAGAIN, errno.EBUSY) else _Lease(fd)
                return
            try:
                yield _Lease(fd, granted=True)
            finally:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        finally:
            os.close(fd)

    def sweep(self, keep: set[str]) -> tuple[int, list[tuple[str, int, int | None]]]:
        """Remove temp files and shard files the journal does not know: (how many went, and
        the ``(name, size, owner)`` of those a reader still holds open, left in place). A copy
        lent before a restart and dropped since is one of these: unlinked here, its blocks
        stayed in use and out of every count (found attacking)."""
        removed = 0
        strays: list[str] = []
        for entry in os.scandir(self.dir):
            stem, dot, ext = entry.name.rpartition(".")
            if not dot:
                continue
            if ("." + ext) == TMP:
                removed += _remove_temp(entry.path)
            elif ("." + ext) == DATA and stem not in keep:
                strays.append(stem)
        gone = set(self.discard_unless_open(strays))
        held = []
        for name in strays:
            if name in gone:
                continue
            with contextlib.suppress(FileNotFoundError):
                held.append((name, os.stat(self.data_path(name)).st_size, self.owner_of(name)))
        return removed + len(gone), held


def _remove_temp(path: str) -> bool:
    """Unlink a temp file a stopped daemon left; whether it went. Anything that is no file (a
    directory of such a name, not the daemon's) is left where it is, and said: its EISDIR
    ended the start, as "socket: cannot serve" (found attacking restarts)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log_event(log, logging.WARNING, "staging_entry_not_removed", path=path,
                  error=exc.strerror or str(exc),
                  action="the daemon makes only files there: move it out of staging_dir")
        return False
    return True
