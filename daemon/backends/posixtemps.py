"""The POSIX backend's temp files: whose each is, and the sweep of those writes left behind.

Every file and striped directory the backend creates is first made under a temp name in its
final directory (posixfs.py puts it in place). The name says which node made it, so a sweep
removes this node's leftovers at once and another node's only once it has seen it unchanged
for the grace period, on this process's own clock.

Apart from posixfs.py because the sweep is the one walk that removes what it finds, and what
it may remove is decided by the temp names made here. Logged under the POSIX backend's
logger, as before: operators filter on it.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
from pathlib import Path

from ckptdrain.client.manifest import TMP_SUFFIX
from ckptdrain.daemon.backends.beneath import Beneath
from ckptdrain.daemon.backends.posixfs import NAME_MAX, walk
from ckptdrain.daemon.checksums import Stopped
from ckptdrain.daemon.logs import log_event

__all__ = ["MAX_WATCHED_TEMPS", "RANDOM_HEX", "Watched", "sweep_temps", "temp_name",
           "temp_owner_matches"]

# Logged under the backend's name: operators filter on it.
log = logging.getLogger("ckptdrain.daemon.backends.posix")

RANDOM_HEX = 12
# What refuses a sweep one file (its directory's permissions, an immutable or append-only
# directory), not the destination as a whole (EROFS, EIO: the sweep stops and says so).
_STUCK_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EBUSY})

# Before the node id in a temp name; node ids are letters, digits, '.', '_' and '-'.
_OWNER = "~"


def temp_name(final_name: str, node_id: str) -> str:
    """``.<name>~<node>.<random>.ckptdrain-tmp``: hidden, unique, and saying whose it is, so
    a sweep can remove this node's leftovers at once and other nodes' only when old.

    The node follows the last ``~``, which no node id holds: with a ``.`` there (as before),
    node ``gpu1`` read ``.w.bin.rack2.gpu1.<random>`` as its own, and its sweep removed node
    ``rack2.gpu1``'s file while it was being written (found attacking). The name part is
    shortened to keep the whole within NAME_MAX: it is only there to help a human, while the
    owner and suffix (which sweeps parse from the end) must survive.
    """
    tail = f"{_OWNER}{node_id}.{secrets.token_hex(RANDOM_HEX // 2)}{TMP_SUFFIX}"
    budget = max(0, NAME_MAX - 1 - len(tail))
    return f".{final_name[:budget]}{tail}"


def temp_owner_matches(name: str, node_id: str) -> bool:
    """Whether temp ``name`` is ``node_id``'s. One named the older way (the node after a
    ``.``) is nobody's: it goes once older than the grace, as another node's would."""
    stem = name[: -len(TMP_SUFFIX)]
    head, dot, rand = stem.rpartition(".")
    if not dot or len(rand) != RANDOM_HEX:
        return False
    return _OWNER in head and head.rpartition(_OWNER)[2] == node_id



# Other nodes' temps a sweep keeps watching (a bound: past it, newer ones wait their turn).
MAX_WATCHED_TEMPS = 100_000
# (size, mtime, ctime, inode) of another node's temp when a sweep last saw it, and when (this
# process's monotonic clock) it first saw it so.
Watched = dict[str, tuple[tuple[int, int, int, int], float]]


def sweep_temps(
    fs: Beneath, node_id: str, live: set[str], grace_s: float, watched: Watched, now: float,
    stop: threading.Event,
) -> int:
    """Remove temp files and striping temp directories under ``root`` left by interrupted
    writes: ``node_id``'s at any age, never one in ``live`` (being written by this process),
    and another node's once this process has seen it unchanged for ``grace_s`` (``now`` and
    ``watched`` on this process's monotonic clock, kept from sweep to sweep).

    Another node's temp is judged by what this process saw, not by its mtime against this
    node's clock: a node whose clock ran two hours ahead (started before NTP stepped it)
    found every temp other nodes were writing an hour old and removed them, failing their
    generations (found attacking); a filesystem that stamps mtimes with its server's clock
    does the same. A temp being written changes; one left by a crash does not. Returns how
    many went."""
    root = fs.root
    if not root.is_dir():
        return 0
    removed = 0
    seen: set[str] = set()
    # fwalk removes by name in a directory it holds open: a directory swapped for a link
    # mid-sweep cannot send an unlink elsewhere.
    with fs.dir([]) as root_fd:
        for dirpath, dirs, files, dir_fd in walk(root_fd, 0):
            if stop.is_set():
                raise Stopped
            removed += _sweep_dir(root, dirpath, dirs, files, dir_fd, node_id, live,
                                  _Watch(watched, seen, now, grace_s))
    for gone in [path for path in watched if path not in seen]:
        del watched[gone]
    return removed


class _Watch:
    """One sweep's view of other nodes' temps: whether each has stayed unchanged long enough."""

    def __init__(self, watched: Watched, seen: set[str], now: float, grace_s: float) -> None:
        self.watched, self.seen, self.now, self.grace_s = watched, seen, now, grace_s

    def abandoned(self, path: str, st: os.stat_result) -> bool:
        self.seen.add(path)
        looks = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        before = self.watched.get(path)
        if before is None or before[0] != looks:
            if before is not None or len(self.watched) < MAX_WATCHED_TEMPS:
                self.watched[path] = (looks, self.now)
            return False
        return self.now - before[1] >= self.grace_s


def _sweep_dir(root: Path, dirpath: str, dirs: list[str], files: list[str], dir_fd: int,
               node_id: str, live: set[str], watch: _Watch) -> int:
    removed = 0
    for name in [*files, *dirs]:
        if not name.endswith(TMP_SUFFIX):
            continue
        path = os.path.normpath(os.path.join(root, dirpath, name))
        if path in live:
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not temp_owner_matches(name, node_id) and not watch.abandoned(path, st):
                continue
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=dir_fd)  # only ever an empty striping temp directory
            else:
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                continue
            if exc.errno in _STUCK_ERRNOS:
                # This one file's directory refuses it (made immutable, its permissions
                # changed): raised, it ended every sweep there, and each temp the walk met
                # after it stayed (found attacking). The next sweep tries it again.
                log_event(log, logging.WARNING, "destination_temp_left", path=path,
                          error=exc.strerror or str(exc),
                          action="let the daemon's user change that directory; the next "
                                 "sweep removes it")
                continue
            raise
        watch.watched.pop(path, None)
        removed += 1
        log.info("removed leftover temp %s", path)
    dirs[:] = [d for d in dirs if not d.endswith(TMP_SUFFIX)]
    return removed
