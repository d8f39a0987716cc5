"""The daemon's socket as a client finds it: where it is, and whether whoever listens on it
is trusted with the caller's bytes and descriptors.

Apart from channel.py, which speaks to the daemon once connected, because trusting the listener
is a question about the node (its uids, the caller's user namespace, the path to the node's
socket) and not about the conversation; ``Channel.open`` asks it between the connect and the
hello.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

from ckptdrain.client.errors import DaemonUnavailable

__all__ = ["SYSTEM_SOCKET_PATH", "check_listener", "default_socket_path"]

SYSTEM_SOCKET_PATH = "/run/ckptdrain.sock"


def default_socket_path() -> str:
    """``$CKPTDRAIN_SOCKET``, else the system socket if it exists, else a per-user socket."""
    configured = os.environ.get("CKPTDRAIN_SOCKET")
    if configured:
        return configured
    if os.path.exists(SYSTEM_SOCKET_PATH):
        return SYSTEM_SOCKET_PATH
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return f"{runtime_dir}/ckptdrain-{os.getuid()}.sock"

def check_listener(sock: socket.socket, path: str) -> None:
    """Refuse a daemon run by someone the caller has no reason to trust.

    Shard bytes and open descriptors of the caller's files (read-only for ``put_file``,
    writable for a fetch) go to whoever listens on the socket. Trusted: root (the node's
    daemon, whose socket systemd opens), the caller's own uid (a daemon they run), and the uid
    in ``$CKPTDRAIN_DAEMON_UID`` (a daemon run as a service user that opens its own socket).
    Found attacking: another user listening first at ``/tmp/ckptdrain-<uid>.sock`` (the
    default with no ``XDG_RUNTIME_DIR``; the sticky ``/tmp`` keeps the owner from removing
    it) read a put_file's source and overwrote a fetch's target. No rule about where the
    socket lies held in general: a directory of the attacker's own, a link to their home, or
    a socket swapped for a link between the connect and the look passed each one tried.

    In a user namespace (a rootless container) a uid says nothing: every uid it does not map,
    the node's root included, reads as the overflow uid; its own root and users may be
    another container's too (a shared remap range); and its map names uids of the namespace
    above, not the node's. There only the caller's own uid (the same kernel uid) and the
    node's socket at exactly ``SYSTEM_SOCKET_PATH`` are trusted, the socket with no link and
    no directory group or others may write on the way (found attacking: naming the overflow
    uid trusted every unmapped user; uid 0, and then a uid mapped to 0 from a nested
    namespace, trusted another container's root)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):  # not Linux: the kernel names no listener
        return
    uid = struct.unpack("3i", creds)[1]
    if not _in_a_user_namespace():
        if uid in (0, os.getuid()) or uid == _named_daemon_uid():
            return
        raise DaemonUnavailable(
            f"refusing the ckptdrain socket at {path}: it is served by uid {uid}, neither you "
            "nor root, so it may be another user's process (anyone may create a path in /tmp "
            "first). Point CKPTDRAIN_SOCKET at the node's daemon, or run your own with "
            f"`ckptdrain serve`; if uid {uid} runs the node's daemon, set "
            f"CKPTDRAIN_DAEMON_UID={uid}"
        )
    # The caller's own uid is the caller's kernel uid, unless it is the one every unmapped uid
    # reads as: a daemon the user runs in the same container (`make demo`). Under a remap
    # range shared by containers (docker's userns-remap) another container's process may have
    # that kernel uid too; it can already reach whatever files the two share.
    if (uid == os.getuid() and uid != _overflow_uid()) or _at_the_system_socket(path):
        return
    raise DaemonUnavailable(
        f"refusing the ckptdrain socket at {path}: in this user namespace (a container's) its "
        f"listener cannot be told from another user's process; use the node's daemon at "
        f"{SYSTEM_SOCKET_PATH} (bind-mount it into the container at that path)"
    )


def _in_a_user_namespace() -> bool:
    """Whether this process runs in a user namespace other than the node's (whose uid map is
    the whole range onto itself); unreadable (no /proc in a container) counts as one."""
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() != ["0", "0", "4294967295"]
    except OSError:
        return True


def _overflow_uid() -> int:
    """The uid every uid a user namespace does not map reads as (``nobody``, by default)."""
    try:
        with open("/proc/sys/kernel/overflowuid") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65534


def _at_the_system_socket(path: str) -> bool:
    """``path`` is the node's socket, named exactly (nothing for the kernel to resolve
    differently from the text), a socket itself, with no link and no directory that group or
    others may write from the root down to it."""
    if path != SYSTEM_SOCKET_PATH:
        return False
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
        directory = os.path.dirname(path)
        while True:
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return False
            parent = os.path.dirname(directory)
            if parent == directory:
                return True
            directory = parent
    except OSError:
        return False


def _named_daemon_uid() -> int | None:
    value = os.environ.get("CKPTDRAIN_DAEMON_UID", "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise DaemonUnavailable(f"CKPTDRAIN_DAEMON_UID={value!r} is not a uid number; set it "
                                "to the numeric uid the node's daemon runs as") from None
