"""What the journal's failures mean to the daemon: the errors it raises (one root,
:class:`JournalError`) and how a SQLite error is told apart: a damaged file (an operator's
work), a full filesystem or one that refuses writes (backpressure until there is room).

Apart from journal.py so that the connection's failure boundary, the ledger and the command
line can name these errors without the journal's machinery.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ckptdrain.daemon.errors import DaemonError, OperatorNeeded


class JournalError(DaemonError):
    """The journal cannot be opened or written: the daemon cannot promise durability."""


class JournalFull(JournalError):
    """The journal's filesystem has no room for a new record, or takes no writes for now
    (``unwritable``: the error it gave): nothing new (a generation, a rank, a shard's
    acknowledgement) is taken until it does. A hand-off gets backpressure."""

    def __init__(self, path: Path, unwritable: str = "") -> None:
        if unwritable:
            super().__init__(
                f"the journal {path} cannot be written ({unwritable}): its filesystem (the "
                "staging filesystem, staging_dir) may have gone read-only after a disk error "
                "(see dmesg); make it writable again, or restart the daemon once it is")
        else:
            super().__init__(f"the journal {path} cannot grow: its filesystem is full; free "
                             "space there (the staging filesystem, staging_dir) and try again")


def is_damaged(exc: sqlite3.Error) -> bool:
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in (sqlite3.SQLITE_CORRUPT,
                                                           sqlite3.SQLITE_NOTADB)


class JournalDamaged(JournalError, OperatorNeeded):
    """The journal's file is damaged (SQLite says corrupt, or not a database): no restart
    mends it. It exited 1, which systemd restarted every 5 s for good (found attacking
    restarts)."""


class JournalTooOld(JournalError, OperatorNeeded):
    """The journal was written by a version whose tables this one cannot extend in place: no
    restart mends it, the operator chooses (the message says how)."""


def damaged(path: Path, exc: sqlite3.Error) -> JournalError:
    return JournalDamaged(
        f"cannot read the journal {path}: {exc}; check the staging disk (staging_dir) for I/O "
        "errors. Its records of acknowledged shards are in no other place: copy the staging "
        "directory before trying to repair the file (`sqlite3 FILE .recover`), then start the "
        "daemon again")


def is_full(exc: BaseException) -> bool:
    return (isinstance(exc, sqlite3.Error)
            and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_FULL)


def unwritable(exc: BaseException) -> str:
    """What SQLite said, for a write its file refused (SQLITE_IOERR: a filesystem remounted
    read-only after a disk error fails the open -wal's writes with EROFS; SQLITE_READONLY), or
    ''. Such a write waits as a full disk's does: failed, it ended the generation of a drain
    that had gone through as an internal error ("OperationalError: disk I/O error") while the
    journal, which the next start goes by, still held it open, and a begin was "an internal
    error" (found attacking with EROFS injected on the -wal's writes)."""
    if isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in (
            sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY):
        return str(exc) or type(exc).__name__
    return ""


def cannot_write(exc: BaseException) -> bool:
    return is_full(exc) or bool(unwritable(exc))
