"""Start-up checks, run before anything changes: no journal is replayed, no file is swept and
no socket is bound until the environment is known to be usable.

In order (the config itself was validated when it loaded): the paths are writable
(``staging_dir``, the directory of ``socket``), this daemon holds the lock on ``staging_dir`` (a
second daemon on the same directory would adopt the first one's shards), no live daemon answers
on ``socket``, ``metrics.listen`` is free, and ``limits.max_staged_bytes`` fits the staging
filesystem (clamped, with a warning, when it does not). Each failure is a
:class:`StartupError` naming the config key; the CLI exits 78 (EX_CONFIG) for it, so a unit
with ``Restart=on-failure`` does not loop on a problem a restart cannot fix. A filesystem full
for now is :class:`DiskFull` instead (exit 75): a later start gets past it, so it is retried.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any

from ckptdrain.daemon.config import Config
from ckptdrain.daemon.errors import DiskFull, StartupError
from ckptdrain.daemon.journalroom import JournalReserve
from ckptdrain.daemon.logs import log_event
from ckptdrain.daemon.staging import DATA, free_space_reserve
from ckptdrain.daemon.staginglock import StagingLock
from ckptdrain.daemon.staginglock import is_full as _full
from ckptdrain.daemon.staginglock import why as _why

log = logging.getLogger("ckptdrain.startup")

# Below this much room a staging filesystem cannot hold a useful checkpoint: refuse to start
# rather than clamp the limit to nothing.
MIN_STAGED_BYTES = 16 << 20
_MiB = 1 << 20




def writable_dir(key: str, directory: Path, mode: int = 0o700) -> None:
    """Create ``directory`` if needed and prove a file can be made in it."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=mode)
    except FileExistsError:
        # Said "cannot create the directory X (File exists); create it ...", of a path that
        # exists, as a file (found as a new operator).
        raise StartupError(key, f"{directory} exists and is not a directory; remove it or set "
                           "another path") from None
    except OSError as exc:
        if _full(exc):
            raise DiskFull(key, f"cannot create the directory {directory} ({_why(exc)}): its "
                           "filesystem is full; free space there") from None
        raise StartupError(key, f"cannot create the directory {directory} ({_why(exc)}); create "
                           "it with the daemon's user as owner, or set another path") from None
    probe = directory / f".ckptdrain-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if _full(exc):
            raise DiskFull(key, f"cannot write in {directory} ({_why(exc)}): its filesystem is "
                           "full; free space there") from None
        raise StartupError(key, f"{directory} is not writable by uid {os.getuid()} "
                           f"({_why(exc)}); fix its owner or mode, or set another path") from None


def socket_group_usable(group: str, *, member: bool = True) -> None:
    """``access.socket_group`` names a group here that this daemon may give its socket to
    (``member``: that this process's user is in it, as the daemon's own must be).
    Found as a new operator: an unknown group passed `config check`, and `serve` failed only
    as it bound the socket, its journal already replayed ("socket: cannot serve: ..."); a
    group the daemon's user is not in failed the same way, as chown's EPERM."""
    if not group:
        return
    from ckptdrain.daemon.listener import group_id

    try:
        gid = group_id(group)
    except OSError:
        raise StartupError("access.socket_group", f"{group!r} is not a group on this host; "
                           "create it, or give a numeric gid") from None
    if member and os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise StartupError("access.socket_group", f"uid {os.geteuid()}, the daemon's user, is "
                           f"not in group {group!r} (gid {gid}) and cannot give the socket to "
                           "it; add the user to the group, or set another group")


def port_free(host: str, port: int) -> None:
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        hint = "stop what holds it or set metrics.listen to a free port ('' disables metrics)"
        if exc.errno == errno.EADDRNOTAVAIL:
            hint = "use an address of this node in metrics.listen"
        raise StartupError("metrics.listen", f"cannot listen on {host}:{port} ({_why(exc)}); "
                           f"{hint}") from None
    finally:
        probe.close()


def socket_free(path: Path) -> None:
    """No live daemon answers on ``path`` (a stale socket is fine: bind removes it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StartupError("socket", f"cannot inspect {path} ({_why(exc)})") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError("socket", f"{path} exists and is not a socket; remove it or set "
                           "another socket path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        uid = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   struct.calcsize("3i")))[1]
    except OSError:
        return
    finally:
        probe.close()
    if st.st_uid != os.getuid() and uid != os.getuid():
        # Someone else's process holds the path (clients refuse it: daemonsocket.check_listener).
        raise StartupError("socket", f"{path} is held by a process of uid {uid}, not this "
                           "daemon's user: stop it; and if it has no business there (in a "
                           "directory other users can write, like /tmp, anyone may take the "
                           "path first), give this daemon a socket in a directory only its "
                           "user can write (XDG_RUNTIME_DIR, or `socket` in the config)")
    raise StartupError("socket", f"another daemon is already serving {path}; stop it, or give "
                       "this daemon its own socket and staging_dir")


def staging_capacity(staging_dir: Path, journal_held: int = 0) -> int:
    """Bytes the staging filesystem can hold for us: free space plus the shards already
    staged there (they count against the limit already), less the reserve kept for the journal
    and the rest of the node (``journal_held`` of it is in the journal's reserve files
    already: Staging.room)."""
    st = os.statvfs(staging_dir)
    staged = 0
    shards = staging_dir / "shards"
    with contextlib.suppress(FileNotFoundError), os.scandir(shards) as entries:
        for entry in entries:
            if entry.name.endswith(DATA):
                with contextlib.suppress(FileNotFoundError):
                    staged += entry.stat(follow_symlinks=False).st_size
    reserve = max(0, free_space_reserve(st) - journal_held)
    return max(0, st.f_bavail * st.f_frsize + staged - reserve)


def staging_size(staging_dir: Path) -> int:
    """Bytes the staging filesystem could hold for us were it empty (its size less the
    reserve): what tells a disk too small from one full for now."""
    st = os.statvfs(staging_dir)
    return max(0, st.f_blocks * st.f_frsize - free_space_reserve(st))


def clamped_from(config: Config, fitted: Config) -> int | None:
    """``config``'s ``limits.max_staged_bytes`` when ``fitted`` (fit_staged_limit's) clamped
    it, else None."""
    wanted = config.limits.max_staged_bytes
    return wanted if fitted.limits.max_staged_bytes < wanted else None


def fit_staged_limit(config: Config, capacity: int, size: int | None = None) -> Config:
    """``config`` with ``limits.max_staged_bytes`` clamped to ``capacity`` (logged, naming
    both figures), or StartupError when the filesystem cannot hold even MIN_STAGED_BYTES.
    ``size`` (:func:`staging_size`): a filesystem that could hold that much empty is full for
    now, not too small: the daemon starts, drains what its journal holds and refuses new
    work as backpressure until there is room (found attacking: a restart while another user
    filled the disk exited 78, which systemd does not retry, and acknowledged shards waited
    for an operator)."""
    wanted = config.limits.max_staged_bytes
    if wanted <= capacity:
        return config
    usable = capacity // _MiB * _MiB
    if usable < MIN_STAGED_BYTES and size is not None and size >= MIN_STAGED_BYTES:
        limit = min(wanted, size // _MiB * _MiB)
        log_event(log, logging.WARNING, "staging_full_at_start", usable=capacity,
                  staging_dir=str(config.staging_dir),
                  action="the staging filesystem is full: shards already staged drain, new "
                  "hand-offs are refused as backpressure until there is room; free space there")
        return with_staged_limit(config, limit) if limit < wanted else config
    if usable < MIN_STAGED_BYTES:
        raise StartupError(
            "staging_dir", f"the filesystem of {config.staging_dir} has {capacity} bytes usable, "
            f"under the {MIN_STAGED_BYTES} bytes a checkpoint needs; free space there or move "
            "staging_dir to a larger disk")
    log_event(log, logging.WARNING, "max_staged_bytes_clamped", configured=wanted,
              effective=usable, staging_dir=str(config.staging_dir),
              action=f"the staging filesystem holds only {usable} bytes for shards: the limit is "
              f"clamped to that; set limits.max_staged_bytes to at most {usable} to silence this")
    return with_staged_limit(config, usable)


def with_staged_limit(config: Config, limit: int) -> Config:
    limits = config.limits.model_copy(update={"max_staged_bytes": limit})
    return config.model_copy(update={"limits": limits})


def check(config: Config, *, inherited: socket.socket | None,
          journal_reserve: JournalReserve) -> tuple[Config, StagingLock]:
    """Every start-up check, in order; returns the config to run with (the staged limit fitted
    to the disk) and the lock, which the caller holds until it stops. Once the lock is held
    and the socket known free, the journal's reserve is handed over (journalroom.py), before
    the room is measured: what it gave the journal is no longer room for shards."""
    writable_dir("staging_dir", config.staging_dir)
    if inherited is None:
        writable_dir("socket", config.socket.parent, mode=0o755)
        socket_group_usable(config.access.socket_group)
    # The lock and the socket before the metrics port: a second `ckptdrain serve` with the
    # running daemon's config (an operator following the runbook's "run it in a shell to see
    # the error") was told to pick another metrics.listen, naming the port and not the daemon
    # that holds it (found trying the runbook).
    lock = StagingLock(config.staging_dir)
    lock.acquire()
    try:
        if inherited is None:
            socket_free(config.socket)
        if config.metrics.address is not None:
            port_free(config.metrics.host, config.metrics.port)
        journal_reserve.hand_over(after_crash=lock.unclean)
        try:
            capacity = staging_capacity(config.staging_dir, journal_reserve.held)
            size = staging_size(config.staging_dir)
        except OSError as exc:
            # Named as what it is (it was reported as the socket's: found attacking).
            raise StartupError("staging_dir", f"cannot read {config.staging_dir}: {exc}; make "
                               "it a directory the daemon may write, with nothing else in it"
                               ) from None
        fitted = fit_staged_limit(config, capacity, size)
    except BaseException:
        lock.release()
        raise
    root_below_mount_point(config)
    root_not_mounted(config)
    return fitted, lock


def root_below_mount_point(config: Config) -> None:
    """Warn when a ``file://`` destination's root is itself a mount point. Unmounted, such a
    root is an empty directory left on this node's disk: nothing reads as missing, so
    `latest` answers "nothing committed" (a restarting job starts again from step 0) and
    writes land on the node's own disk (found attacking). A root one directory below the
    mount point is missing then, which the daemon detects ("is its filesystem mounted?")."""
    if config.destination.scheme != "file":
        return
    root = config.destination.root_path
    with contextlib.suppress(OSError):
        if os.path.ismount(os.path.realpath(root)):  # a link to a mount point too
            log_event(log, logging.WARNING, "destination_root_is_a_mount_point", root=str(root),
                      action="set destination.uri to a directory below the mount point (e.g. "
                      f"{(root / 'ckpt').as_uri()}): if the filesystem is not mounted, the daemon "
                      "sees that directory missing and waits; with the mount point itself it "
                      "sees an empty destination and writes to this node's disk")


def root_not_mounted(config: Config) -> None:
    """Warn when a ``file://`` destination's root is missing as an unmounted filesystem's is
    (its parent missing too, say). The daemon starts all the same (a mount may come later),
    but it said `ready` and nothing else: the first word of it was a drain failing, a save
    later (found as a new operator)."""
    if config.destination.scheme != "file":
        return
    from ckptdrain.daemon.backends.beneath import why_unmounted

    root = config.destination.root_path
    with contextlib.suppress(OSError):
        why = why_unmounted(root)
        if why is not None:
            log_event(log, logging.WARNING, "destination_not_mounted", root=str(root), error=why,
                      action=f"mount its filesystem, or create the root once (mkdir -p {root}); "
                      "until then drains are retried and then fail, and `latest` fails")


# Keys a SIGHUP applies; any other key that changed is named as needing a restart.
RELOADABLE = ("limits.", "log_level", "drain.max_bandwidth_bytes_per_s")
# Limits the data plane is built with at start-up: a reload keeps them (configload.with_limits_from)
# and names them as needing a restart (it said "reloaded" and changed nothing).
RESTART_LIMITS = ("limits.io_threads", "limits.io_timeout_s")


def changed_keys(old: Config, new: Config) -> list[str]:
    """Dotted keys whose value differs between two configs."""
    a, b = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def needs_restart(keys: list[str]) -> list[str]:
    return [k for k in keys if k in RESTART_LIMITS
            or not any(k == r or (r.endswith(".") and k.startswith(r)) for r in RELOADABLE)]
