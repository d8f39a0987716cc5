"""Room for the journal on a staging filesystem that someone else filled.

A daemon stopped cleanly (SIGTERM: ``systemctl stop`` or ``restart``, a reboot) checkpoints
its journal, and SQLite deletes ``journal.sqlite3-wal`` and ``-shm``: their blocks go back to
the filesystem. If another user fills it then, the next start cannot make them again and
SQLite fails ("disk I/O error") before one row is read: the start exited 1 and the shards the
journal holds, acknowledged, waited for an operator (found attacking). SQLite keeps a WAL
across a clean close only with SQLITE_FCNTL_PERSIST_WAL, a file control Python's sqlite3 does
not reach (3.11 has no ``file_control``); it deletes the -shm all the same, and the journal's
``compact()`` truncates a kept WAL to nothing anyway.

So the daemon keeps a reserve in ``staging_dir``: ``journal.reserve-wal`` and
``journal.reserve-shm``. While there is room they are fallocated (all zeros); a stop that has
none links them to the side files just before the journal closes, so SQLite's delete removes
a name and not the blocks (made again from the blocks the delete gave back, they went to a
writer filling the disk in the meantime: found testing). At start, holding the staging lock
and before the journal opens, each becomes the side file it stands for where that is
missing, by rename: a rename moves the blocks without freeing them, so whoever fills the disk
cannot take them (unlinking the reserve for SQLite to allocate from would race them, and
leave what SQLite did not take yet counted as room for new hand-offs). SQLite reads a WAL
whose header lacks its magic number as empty and writes from its start, into the blocks
there. A kept WAL's header is zeroed first: SQLite would replay its frames, which are in
the database already or, had the journal moved on since, older than its pages (tried: a
stale WAL's rows came back in place of the journal's).

The one window left: SQLite's first connection truncates a -shm it finds to 3 bytes and
writes it again, so 7 of its 8 pages go back to the filesystem for a moment (the -shm a
``kill -9`` leaves has always had it). A process that takes every block freed as it is freed
can win it (1 start in 16, measured with such a writer on a loaded machine); the start then
exits 75, and starts once there is room. Holding the -shm open for SQLite to skip that
truncation would mean a lock of SQLite's own, held by a file descriptor never closed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ckptdrain.daemon.errors import DiskFull, StartupError
from ckptdrain.daemon.journal import WAL_KEPT_BYTES
from ckptdrain.daemon.journalfaults import JournalError
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.staging import free_space_reserve

if TYPE_CHECKING:
    from ckptdrain.daemon.journal import Journal
    from ckptdrain.daemon.staging import Staging

log = logging.getLogger(__name__)

# The WAL a restart writes before its first checkpoint (SQLite's comes every 1,000 pages,
# 4 MiB): recovery's records and the drain of what the journal holds. On a small staging
# filesystem, half its free-space reserve (the other half stays free for the running WAL).
WAL_RESERVE_BYTES = WAL_KEPT_BYTES
# The -shm's first region: the wal-index of 4,062 frames, more than the WAL reserve holds.
SHM_RESERVE_BYTES = 32 << 10
_PAGE = 4096
_WAL_HEADER_BYTES = 32  # its magic number first: zeros read as "no WAL"
# A journal that cannot open on a filesystem with less than this free is taken to have
# failed for want of room (SQLite says "disk I/O error" for a -shm it cannot extend, not
# ENOSPC): the start is retried (exit 75) rather than reported as a damaged disk.
FULL_BELOW_BYTES = 1 << 20
# How long a stop waits for a reserve being made before it keeps the journal's files.
KEEP_WAIT_S = 5.0


class JournalReserve:
    """The one owner of the reserve files: only this class makes, links, counts or gives
    them up. :meth:`hand_over` gives them to the journal, once per start; :meth:`remake`
    makes what is missing while there is room; :meth:`keep_side_files` keeps the side files'
    blocks at a stop that has no reserve. ``held`` (bytes in reserve files that are not the
    journal's own files too) is read by Staging: that much of the free-space reserve is held
    in them, so hand-offs see the same room with them or without."""

    def __init__(self, journal_path: Path) -> None:
        self.journal = journal_path
        self.wal = journal_path.with_name("journal.reserve-wal")
        self.shm = journal_path.with_name("journal.reserve-shm")
        self.held = 0
        self._handed_over = False
        # The journal's -wal was missing at a start after a crash (see hand_over).
        self.tail_lost = False
        # One maker at a time: the refresh loop and start-up's first refresh both call
        # remake, each in a data-plane thread, and one unlinked the other's temporary file.
        self._making = threading.Lock()
        self._said_not_made = False  # remake runs every second: a failure is logged once

    def _pairs(self) -> tuple[tuple[Path, Path], ...]:
        return ((self.wal, Path(f"{self.journal}-wal")), (self.shm, Path(f"{self.journal}-shm")))

    def count(self) -> int:
        held = 0
        for reserve, side in self._pairs():
            with contextlib.suppress(OSError):
                st = os.stat(reserve, follow_symlinks=False)
                if not _same_file(st, side):  # still linked to the live side file: the journal's
                    # What it holds on the disk: a sparse one (a staging_dir copied with
                    # rsync -S) counted at its length took every shard's room (found attacking).
                    held += min(st.st_size, st.st_blocks * 512)
        self.held = held
        return held

    def hand_over(self, after_crash: bool = False) -> None:
        """Before the journal opens (blocking; the staging lock held, so the reserve is this
        daemon's): each reserve file becomes the side file it stands for where that is
        missing. Only for a journal that holds something: SQLite deletes the WAL of an empty
        database, blocks and all, and a new journal has nothing to drain. A second call in
        one run does nothing: the reserve made since is kept for the next start.

        ``after_crash``: the last daemon did not stop cleanly (StagingLock.unclean). SQLite
        keeps the -wal of a journal not closed, its newest records in it; missing then, it
        was removed (taken for SQLite's leftovers), and with it the records of the latest
        hand-offs: ``tail_lost``, and recovery sets their staged files aside instead of
        removing them as strays (found attacking restarts)."""
        if self._handed_over:
            return
        self._handed_over = True
        try:
            st = os.stat(self.journal, follow_symlinks=False)
            # Not a file (a directory, a link: misplaced below) is refused before the journal
            # opens; its side files are left alone for the operator to look at.
            holds = stat.S_ISREG(st.st_mode) and st.st_size > 0
        except OSError:  # none yet; or unreadable, which the journal's open reports
            holds = False
        self.tail_lost = after_crash and holds and not os.path.lexists(self._pairs()[0][1])
        for reserve, side in self._pairs() if holds else ():
            try:
                if os.path.lexists(side) or not _regular(reserve):
                    continue
                if reserve is self.wal and self.tail_lost:
                    # Left missing: a start that fails before recovery ends leaves the
                    # next one to find it so (and the pid in daemon.lock: StagingLock).
                    continue
                if reserve is self.wal:
                    _blank_header(reserve)
                os.rename(reserve, side)
            except OSError as exc:  # the journal may open without it: let it say if not
                log_event(log, logging.WARNING, "journal_reserve_unusable", path=str(reserve),
                          error=str(exc), action="none: the daemon goes on without it")
                continue
            log_event(log, logging.INFO, "journal_reserve_used", side=str(side))
        self.count()

    def keep_side_files(self) -> None:
        """Just before the journal closes (blocking): each missing reserve file becomes a
        second name of its side file, so the delete at a clean close leaves its blocks to the
        reserve. (A close that does not delete them, its checkpoint failed, leaves both
        names to one file: ``count`` leaves it out, and the next clean stop parts them.)"""
        # A remake still running in a data-plane thread finishes first; one stuck (a sick
        # disk) does not hold the stop: nothing is kept then.
        if not self._making.acquire(timeout=KEEP_WAIT_S):
            return
        try:
            for reserve, side in self._pairs():
                if os.path.lexists(reserve):
                    continue
                try:
                    os.link(side, reserve, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    log_event(log, logging.WARNING, "journal_reserve_not_kept",
                              path=str(reserve), error=str(exc),
                              action="none: made again once there is room")
            self.count()
        finally:
            self._making.release()

    def remake(self) -> None:
        """Make whichever reserve file is missing (blocking: run off the event loop), only
        where the filesystem keeps its free-space reserve free after it: the reserve never
        takes the last of the room others need. A call while another makes them returns at
        once."""
        if not self._making.acquire(blocking=False):
            return
        try:
            for reserve in (self.shm, self.wal):  # the -shm first: without it nothing opens
                if os.path.lexists(reserve):
                    continue
                st = os.statvfs(self.journal.parent)
                size = SHM_RESERVE_BYTES if reserve is self.shm else wal_reserve_bytes(st)
                if st.f_bavail * st.f_frsize < free_space_reserve(st) + size:
                    break
                failed = _make(reserve, size)
                if failed is not None and not self._said_not_made:
                    self._said_not_made = True
                    log_event(log, logging.WARNING, "journal_reserve_not_made",
                              path=str(reserve), error=str(failed),
                              action="none: tried again while the daemon runs; without it a "
                              "restart onto a full staging disk exits 75 until there is room")
            self.count()
        finally:
            self._making.release()


def wal_reserve_bytes(st: os.statvfs_result) -> int:
    return min(WAL_RESERVE_BYTES, free_space_reserve(st) // 2) // _PAGE * _PAGE


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _same_file(st: os.stat_result, other: Path) -> bool:
    try:
        o = os.stat(other, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (o.st_dev, o.st_ino)


def _blank_header(path: Path) -> None:
    """Zero the WAL header of a reserve that is not all zeros (a WAL kept at a stop, or one
    written to by hand): frames past a valid header would be replayed into the journal. A
    fallocated reserve reads as zeros, and nothing is written to it."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if any(os.pread(fd, _WAL_HEADER_BYTES, 0)):
            os.pwrite(fd, bytes(_WAL_HEADER_BYTES), 0)
            os.fsync(fd)
    finally:
        os.close(fd)


def _make(path: Path, size: int) -> OSError | None:
    """``path`` as a file of ``size`` allocated bytes, or nothing: made under a temporary
    name and renamed, so the reserve's name never stands for a file cut short. Returns what
    failed, but for a full filesystem (tried again later)."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a daemon killed while making it
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc
    return None


async def open_journal(journal: Journal, staging: Staging, reserve: JournalReserve) -> None:
    """Prepare the staging directory and open the journal (the reserve handed over by then),
    a full filesystem reported as :class:`DiskFull`: a start that is retried; something not
    a file in the journal's place as :class:`StartupError` (:func:`misplaced`). Then the
    reserve is made again where there is room, before anything is served (left to the
    refresh loop, the descriptor it holds for a moment came and went while clients were
    served, which a test that counts the daemon's descriptors may have met once)."""
    try:
        staging.prepare()
    except OSError as exc:
        # Named as what it is (it was reported as the socket's: found attacking).
        error = DiskFull if exc.errno in (errno.ENOSPC, errno.EDQUOT) else StartupError
        raise error("staging_dir", f"cannot prepare {staging.root}: {exc}; make it a "
                    "directory the daemon may write, with room on its filesystem") from None
    for path in (journal.path, Path(f"{journal.path}-wal"), Path(f"{journal.path}-shm")):
        why = misplaced(path)
        if why is not None:
            raise StartupError("staging_dir", why)
    try:
        await journal.open()
    except JournalError:
        free = _free_bytes(staging.root)
        if free is None or free >= FULL_BELOW_BYTES:
            raise
        raise DiskFull("staging_dir", f"cannot open the journal {journal.path}: its "
                       f"filesystem has {free} bytes free (another user's files?), and the "
                       "journal needs room for its -wal and -shm files; free space there"
                       ) from None
    with contextlib.suppress(OSError):  # a sick disk: the refresh loop tries again
        reserve.remake()


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
          (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def misplaced(path: Path) -> str | None:
    """Why ``path`` (the journal, its ``-wal`` or ``-shm``) is not a file the journal can
    use, or None: a regular file, or none yet. A directory, a link (the journal is opened
    with O_NOFOLLOW: a link could make it some other file) or a pipe there failed the start
    with exit 1, which systemd restarts for good, as "disk I/O error" or "Too many levels of
    symbolic links" and advice to check the disk for I/O errors (found attacking restarts):
    it is an operator's doing that no restart undoes."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # none yet; or unreadable, which the journal's open says
        return None
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return (f"{path} is {kind}, not the journal's file: the daemon keeps its journal in "
            "regular files in staging_dir, never through a link; move it out of the way (a "
            "journal moved elsewhere: move the file itself back in its place), then start the "
            "daemon again")


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
