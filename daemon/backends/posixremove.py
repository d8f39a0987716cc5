"""Removing keys from a POSIX destination: one, or many in one worker-thread job.

Only retention removes, in batches that must each be durable before the next begins (a
generation's manifest, then its part records, then its shards). One key at a time, each
delete cost a thread hop, a walk from the root to its directory, a directory fsync (a
filesystem journal commit of its own) and a walk up the tree trying to remove directories
that were not empty yet: 10,000 shards took about 4.5 CPU seconds. A batch pays the walk and
the fsync once per directory, and tries the emptied directories once, deepest first.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.beneath import Beneath, Entry

# Keys per worker-thread job: a cancelled batch stops between files, and no job holds a
# thread for long however big the generation.
REMOVE_BATCH = 2048
# Batches at once: directories of one generation are independent, and two threads overlap one
# batch's fsyncs with the other's unlinks.
REMOVE_AT_ONCE = 2


def remove_one(fs: Beneath, entry: Entry, stop: threading.Event) -> None:
    remove_many(fs, [entry], stop)


def remove_many(fs: Beneath, entries: Sequence[Entry], stop: threading.Event) -> None:
    """Unlink every entry (a name already gone is fine), fsync each directory once, then
    remove the directories left empty. Returns early, with what it removed made durable,
    when ``stop`` is set."""
    by_dir: dict[tuple[str, ...], list[str]] = {}
    for entry in entries:
        by_dir.setdefault(entry.dir, []).append(entry.name)
    emptied: list[tuple[str, ...]] = []
    for parts, names in by_dir.items():
        try:
            with fs.dir(parts) as dir_fd:
                for name in names:
                    if stop.is_set():
                        break
                    # unlink() removes a planted link itself, never what it points to. A name
                    # already gone was removed by another node's run or an earlier one.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)
                # The unlinks must be durable before the caller's next batch: retention
                # deletes a manifest before its shards, and a crash must not resurrect a
                # manifest whose shards are gone.
                os.fsync(dir_fd)
        except (FileNotFoundError, NotADirectoryError):
            continue  # the directory is gone (a concurrent removal's; durable too)
        emptied.append(parts)
        if stop.is_set():
            return
    # Directories left empty (a removed generation's) would use up Lustre inodes. Only
    # retention removes, and only generations nobody writes; <root>/<job> itself stays.
    removed: set[tuple[str, ...]] = set()
    for parts in sorted(emptied, key=len, reverse=True):
        for depth in range(len(parts), 1, -1):
            here = parts[:depth]
            if here in removed:
                continue  # removed with a deeper directory of this batch: look further up
            try:
                with fs.dir(here[:-1]) as parent_fd:
                    os.rmdir(here[-1], dir_fd=parent_fd)
            except OSError:
                break  # not empty (yet, or at all), gone, or not ours to follow: stop here
            removed.add(here)


def remove_empty_tree(fs: Beneath, parts: list[str], unchanged_since: float, dry_run: bool,
                      stop: threading.Event) -> bool:
    """Remove the directory ``parts`` and the directories under it that hold no file and were
    not changed since ``unchanged_since``, deepest first. Ages are taken before anything is
    removed (a removal changes its parent's mtime); a directory that holds a file, a link or
    anything else, or that something wrote to meanwhile, stays (its rmdir fails). Returns
    whether ``parts`` itself went; with ``dry_run`` nothing is removed, and it returns whether
    it would have (found attacking gc: `gc --dry-run` said nothing of an old, empty generation
    directory that `gc` then removed, saying nothing either)."""
    # Directories, parents before children: age, and whether it holds what is no directory.
    found: list[tuple[tuple[str, ...], float, bool]] = []
    subdirs_of: dict[tuple[str, ...], int] = {}
    pending = [tuple(parts)]
    while pending and not stop.is_set():
        here = pending.pop()
        try:
            with fs.dir(here) as dir_fd:
                changed = os.fstat(dir_fd).st_mtime
                with os.scandir(dir_fd) as entries:
                    listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        except (OSError, BackendError):
            # Gone, not ours to read (another user's), or a link on the way: it stays, and
            # so does every directory above it (their rmdir finds them not empty).
            continue
        subdirs = [name for name, is_dir in listed if is_dir]
        found.append((here, changed, len(subdirs) < len(listed)))
        subdirs_of[here] = len(subdirs)
        pending += [(*here, name) for name in subdirs]
    gone: set[tuple[str, ...]] = set()
    gone_under: dict[tuple[str, ...], int] = {}
    for here, changed, holds_more in sorted(found, key=lambda f: len(f[0]), reverse=True):
        if stop.is_set() or changed >= unchanged_since:
            continue
        if dry_run:
            # What rmdir would answer: empty once every subdirectory went before it.
            if holds_more or gone_under.get(here, 0) < subdirs_of[here]:
                continue
        else:
            try:
                with fs.dir(here[:-1]) as parent_fd:
                    os.rmdir(here[-1], dir_fd=parent_fd)
            except (OSError, BackendError):
                continue  # ENOTEMPTY (a file, a link, a directory that stayed), gone, refused
        gone.add(here)
        gone_under[here[:-1]] = gone_under.get(here[:-1], 0) + 1
    return tuple(parts) in gone
