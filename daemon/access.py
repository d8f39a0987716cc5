"""Who is on the other end of a connection, and what they may see and do.

The kernel says who connected (``SO_PEERCRED`` for uid and primary gid, ``SO_PEERGROUPS`` for
the supplementary groups an operator adds with ``usermod -aG``): read once at accept, before
a byte of the client's is read, so a uid that may not use the daemon never holds a connection
slot. Root and the daemon's own uid are operators and see every job; any other user sees and
touches only the jobs it owns.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptdrain.daemon.config import AccessConfig

# Not in Python's socket module on every version: Linux's value (asm-generic/socket.h).
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_GID = struct.Struct("=I")
_NGROUPS_MAX = 65536


def is_operator(uid: int) -> bool:
    """Root or the daemon's own uid: may see and act on every job."""
    return uid in (0, os.getuid())


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    @property
    def operator(self) -> bool:
        """Root or the daemon's own uid: may see and act on every job."""
        return is_operator(self.uid)

    def may_see(self, owner: int | None) -> bool:
        """Whether this peer may see a job owned by ``owner`` (None: not known here)."""
        return self.operator or owner is None or owner == self.uid


def peer_of(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid, frozenset({gid, *_peer_groups(sock)}))


def _peer_groups(sock: socket.socket) -> list[int]:
    count = 64
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, count * _GID.size)
        except OSError as exc:
            if exc.errno == errno.ERANGE and count < _NGROUPS_MAX:
                count = min(count * 16, _NGROUPS_MAX)
                continue
            if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
                return []  # a kernel without it (before 4.13): the primary gid only
            raise
        return [gid for (gid,) in _GID.iter_unpack(raw[: len(raw) - len(raw) % _GID.size])]


def allowed(peer: Peer, access: AccessConfig) -> bool:
    if peer.operator or peer.uid in access.allowed_uids:
        return True
    return not peer.groups.isdisjoint(access.allowed_gids)


def refusal(peer: Peer) -> str:
    return (f"uid {peer.uid} (groups {sorted(peer.groups)}) may not use this ckptdrain daemon; "
            "ask the operator to add it to [access] allowed_uids or allowed_gids")
