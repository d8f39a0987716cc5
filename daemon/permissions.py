"""What the peer of a connection may do with a job: see it (its owner, or an operator), read
it when this node does not track it (its commits at the destination name no other owner), and
write it; and the destination asked, where the ledger's owner was recorded without its word.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ckptdrain.client import wire
from ckptdrain.client.manifest import ManifestError
from ckptdrain.daemon import owners
from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.errors import RequestError, destination_error

if TYPE_CHECKING:
    from ckptdrain.daemon.connection import ClientHandler


async def may_still_see(h: ClientHandler, job: str) -> None:
    """What a `wait` found is told only to a waiter who may see ``job`` now: checked when
    it began only, a wait on a name nobody used yet was told another user's commit of
    it, with its time and attempt (found attacking)."""
    await check_destination_owner(h, job)
    check_job_visible(h, job)


def check_job_visible(h: ClientHandler, job: str) -> None:
    """A user learns nothing of another user's job (root and the daemon's uid see all)."""
    if not h.peer.may_see(h.d.ledger.jobs.get(job)):
        raise RequestError(wire.PERMISSION_DENIED, f"job {job!r} belongs to another user; "
                           f"uid {h.uid} may not see it")


async def settle_owner(h: ClientHandler, job: str, *, reading: bool) -> None:
    """Before the ledger's owner of ``job`` is trusted: settled with the destination if
    it was recorded without its word (owners.settle). A write goes on when the
    destination cannot answer now (the commit checks); a read fails."""
    d = h.d
    if h.peer.operator or not d.config.access.check_destination_owner:
        return
    try:
        await owners.settle(d, job)
    except (BackendError, ManifestError, OSError, TimeoutError) as exc:
        if reading:
            raise destination_error(job, None, exc) from None


async def check_destination_owner(h: ClientHandler, job: str) -> None:
    """A job this node does not track (or tracks unverified) is read for a peer only when
    its commits at the destination name no other owner (owners.py): the daemon reads
    with its own rights."""
    d = h.d
    if h.peer.operator or not d.config.access.check_destination_owner:
        return
    await settle_owner(h, job, reading=True)
    if job in d.ledger.jobs:
        return
    try:
        async with asyncio.timeout(owners.LOOKUP_TIMEOUT_S):
            owner = await d.committer.owners.someone_else(job, h.uid)
    except (BackendError, ManifestError, OSError, TimeoutError) as exc:
        raise destination_error(job, None, exc) from None
    if owner is not None:
        raise RequestError(wire.PERMISSION_DENIED, owners.refusal(job, h.uid))


def check_job_owner(h: ClientHandler, job: str, doing: str = "write it") -> None:
    """Writes to a job, and reads of this node's copies of it: its owner's, or an
    operator's (root or the daemon's uid, who act for the owner). ``doing`` is what was
    refused: a restore's read was told "may not write it" (found as a new user)."""
    owner = h.d.ledger.jobs.get(job)
    if owner is not None and owner != h.uid and not h.peer.operator:
        raise RequestError(wire.PERMISSION_DENIED,
                           f"job {job!r} belongs to {_owner_name(h, owner)}; uid "
                           f"{h.uid} may not {doing}")


def _owner_name(h: ClientHandler, owner: int) -> str:
    # Operators are told which uid; other users only that it is not theirs.
    return f"uid {owner}" if h.peer.operator else "another user"
