"""``ckptdrain restore``: a committed generation copied from a destination into a directory.

The command's side of it: the checks on ``--to`` before anything is read (a file, a non-empty
directory without ``--overwrite``, the destination itself), the local fast path through this
node's daemon, and the progress bar; the copy itself is restore.py's. Apart from
cli_destination.py (the other destination commands, and what they all share, which this one
uses: the destination opened from DEST, run_on, the generation resolved).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from ckptdrain.client import Client, DrainError
from ckptdrain.daemon.cli_destination import (
    EXIT_OK,
    CommandFailed,
    human,
    print_json,
    resolve_generation,
    run_on,
)
from ckptdrain.daemon.errors import DaemonError

# The destination commands' logger, as before restore had a module of its own: the name is in
# every structured log line.
log = logging.getLogger("ckptdrain.daemon.cli_destination")


def _check_restore_target(to: Path, overwrite: bool) -> None:
    if to.exists() and not to.is_dir():
        raise CommandFailed(f"--to {to} is a file, not a directory; give a directory to restore into")
    if to.is_dir() and not overwrite and any(to.iterdir()):
        raise CommandFailed(f"--to {to} is not empty; restore into a new or empty directory, "
                            "or pass --overwrite to replace files of the same name in it")


def _destination_root(dest: str) -> Path | None:
    """The directory of a ``file://`` destination, its links resolved (None for S3)."""
    from ckptdrain.daemon.uris import split_uri

    scheme, location, _ = split_uri(dest)
    return Path(os.path.realpath(location)) if scheme == "file" else None


def _check_outside_destination(to: Path, dest: str) -> None:
    """Refuse a ``--to`` that is a ``file://`` destination's root or inside it. Found attacking
    restore: ``--to <a generation directory> --overwrite`` removed that committed generation's
    MANIFEST.json first; stopped or failing, it left the step uncommitted, and gc removed it
    as abandoned (and one that succeeded replaced committed shards). The root is looked for
    among --to's directories by identity, so a link or a bind mount to it is caught too."""
    root = _destination_root(dest)
    if root is None:
        return
    try:
        root_id = os.stat(root)
    except OSError:
        return  # no destination there: the command says so
    here = Path(os.path.realpath(to))
    for directory in (here, *here.parents):
        try:
            st = os.stat(directory)
        except OSError:
            continue  # not made yet
        if (st.st_dev, st.st_ino) == (root_id.st_dev, root_id.st_ino):
            raise CommandFailed(f"--to {to} is inside the destination {dest} (or is its root), "
                                "where a restore would replace committed files; restore "
                                "elsewhere")


def cmd_restore(ns: argparse.Namespace) -> int:
    from ckptdrain.daemon.restore import restore

    to = Path(ns.to)
    _check_outside_destination(to, ns.dest)
    _check_restore_target(to, ns.overwrite)

    async def run(backend: Any) -> tuple[int, Any]:
        # Read once and passed on: the bar's total and the restore use this manifest.
        manifest = await resolve_generation(backend, ns.job, ns.generation)
        step = manifest.generation
        bar = ProgressBar(manifest.total_bytes,
                          enabled=(not ns.quiet and sys.stderr.isatty()) or ns.progress)
        try:
            # A shard landing in the destination (mounted below --to) is refused by identity
            # as restore walks --to's directories (restoretarget.open_dir).
            report = await restore(backend, ns.job, manifest, to, progress=bar.advance,
                                   local=None if ns.no_local else _local_source(ns, step),
                                   keep_out=_destination_root(ns.dest))
        finally:
            bar.close()
        return step, report

    step, report = run_on(ns, run)
    if ns.json:
        print_json({"job": ns.job, "generation": step, "to": str(report.to_dir),
                    "files": report.files, "bytes": report.bytes,
                    "local_files": report.local_files, "local_rejected": report.local_rejected})
        return EXIT_OK
    local = ""
    if report.local_files or report.local_rejected:
        local = f" ({report.local_files} from this node's local copy"
        local += f", {report.local_rejected} local copies failed their checksum and came from {ns.dest})" if report.local_rejected else ")"
    print(f"restored generation {step} of job {ns.job!r} to {ns.to}: {report.files} files, "
          f"{human(report.bytes)}, checksums verified{local}")
    return EXIT_OK


def _local_source(ns: argparse.Namespace, step: int) -> Any:
    """Restore's fast path: when this node's daemon drains to the same destination, it copies
    the shards it still holds locally (checked against the manifest's checksums)."""
    from ckptdrain.client import NotFound
    from ckptdrain.daemon.cli_node import socket_path

    sock = socket_path(ns)
    # A socket named with --socket is asked for: that it goes unused is said, not silent
    # (found as a new operator: a mistyped path restored everything from the destination,
    # quietly). The default socket may well have no daemon behind it (a login node).
    named = bool(getattr(ns, "socket", None))
    try:
        client = Client(sock, timeout_s=600, connect_timeout_s=2)
        theirs = client.status()["destination"]
    except (DrainError, DaemonError) as exc:
        if named:
            log.warning("no local copies from %s (%s); restoring everything from %s", sock,
                        getattr(exc, "message", None) or exc, ns.dest)
        return None  # no daemon here: the destination has everything
    if theirs.rstrip("/") != ns.dest.rstrip("/"):
        if named:
            log.warning("the daemon at %s drains to %s, not %s: its local copies are not this "
                        "destination's; restoring everything from %s", sock, theirs, ns.dest,
                        ns.dest)
        return None

    gone: list[str] = []  # why the daemon did not serve a local copy, once it did not

    async def fetch(shard: Any, fd: int) -> str | None:
        if gone:
            return None
        try:
            reply = await asyncio.to_thread(client.fetch_local, ns.job, step, shard.path, fd)
        except NotFound:
            return None
        except DrainError as exc:
            # The fast path is only that: the destination has every shard. Found attacking
            # restore: the daemon stopped (killed, hung, restarted for an upgrade) part-way
            # through a restore failed it, "start it with `ckptdrain serve`", and removed
            # what it had restored, though the destination was fine; so would its refusal
            # (another user's job, a reader's share used up). Asked no more after its first
            # failure (a hung daemon costs each ask a timeout).
            if not gone:
                gone.append(exc.message)
                log.warning("this node's daemon did not serve a local copy (%s); restoring "
                            "the rest from %s", exc.message, ns.dest)
            return None
        return str(reply["checksum"])

    return fetch


class ProgressBar:
    """A one-line progress bar on stderr (only on a terminal unless asked for)."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.started = time.monotonic()
        self._last = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.2 or self.done >= self.total):
            self._last = now
            frac = self.done / self.total if self.total else 1.0
            rate = self.done / max(now - self.started, 1e-6)
            bar = "#" * int(frac * 30)
            print(f"\r[{bar:<30}] {frac:6.1%} {human(self.done)} {human(rate)}/s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)
