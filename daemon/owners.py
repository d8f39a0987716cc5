"""Who owns a job at the destination: the uid its newest committed generation names.

A node knows a job's owner (the uid that began it there) only while it tracks the job: the
owner is forgotten with the job (``limits.max_jobs``, ``forget_after_s``), a node that never
ran the job never knew it, and a user on another node may pick the same name. Without more, a
second uid could begin such a job, read its checkpoints through the daemon, commit steps above
the owner's (a restart would load them) and have retention delete the owner's generations.

The destination outlives all of that: each part record names its owner (``owner_uid``), and
all the records of one commit agree. So before a uid begins or reads a job this node does not
track, and before any node commits a generation, the owner of the job's newest committed
generation is read there (one lookup per job, remembered); a job that names another uid is
refused. Root and the daemon's own uid act for any owner.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from ckptdrain.client import wire
from ckptdrain.client.keys import part_key
from ckptdrain.client.manifest import Manifest
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.daemon.access import is_operator as operator
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.latest import LATEST_SCANS, newest_commit, parse_part
from ckptdrain.daemon.logs import log_event

if TYPE_CHECKING:
    from ckptdrain.daemon.commit import Committer
    from ckptdrain.daemon.ledger import Ledger
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger("ckptdrain.owners")

# Jobs whose owner is remembered: each lookup costs a few destination reads.
MAX_REMEMBERED = 4096


def refusal(job: str, uid: int) -> str:
    return (f"job {job!r} belongs to another user (its newest committed generation at the "
            f"destination says so); uid {uid} may not use it: choose another job name")


class DestinationOwners:
    def __init__(self, committer: Committer) -> None:
        self._committer = committer
        self._known: OrderedDict[str, int] = OrderedDict()
        # Jobs this node tracks whose owner it recorded without the destination's word (a
        # begin whose lookup failed goes on): every use asks again until one answers
        # (settle). At most the jobs the node tracks (limits.max_jobs).
        self.unverified: set[str] = set()

    def remember(self, job: str, uid: int | None) -> None:
        """``uid`` committed ``job``: it owns it at the destination now."""
        if uid is None:
            return
        self._known[job] = uid
        self._known.move_to_end(job)
        while len(self._known) > MAX_REMEMBERED:
            self._known.popitem(last=False)

    async def owner(self, job: str) -> int | None:
        """The uid the newest committed generation of ``job`` names; None when the job has
        none, or its records predate owners. Raises BackendError when the destination fails.
        Only a found owner is remembered: a job with no commit yet may get one any time."""
        known = self._known.get(job)
        if known is not None:
            self._known.move_to_end(job)
            return known
        backend = self._committer.backend
        for _ in range(LATEST_SCANS):
            # The newest commit as `latest` finds it (the scan again when retention removed a
            # commit above the answer meanwhile: without it, an older generation's owner was
            # answered, or none), with the hint's manifest read through the committer's cache
            # and the one found returned with the step: a large one is parsed once, not once
            # to find the step and again for its nodes.
            found = await newest_commit(backend, job, functools.partial(self._committed, job))
            if found is None:
                return None  # no commit: nobody to ask
            step, manifest = found
            owner, records = await self._named(backend, job, step, manifest)
            if owner is not None:
                self.remember(job, owner)
                return owner
            if records:
                return None  # its records predate owners
            # Not one of its part records is there: retention removed the generation after
            # its manifest was read (it deletes them after the tombstone), once a newer one
            # committed. Ask again; "no owner" let another user's begin of the job through.
        return None

    @staticmethod
    async def _named(backend: Backend, job: str, step: int,
                     manifest: Manifest) -> tuple[int | None, bool]:
        """The owner the part records of ``job`` step ``step`` name (None: none does), and
        whether any record was there at all."""
        records = False
        for node in sorted(manifest.nodes):
            data = await backend.get_bytes(part_key(job, step, node))
            if data is None:
                continue
            records = True
            try:
                part = await parse_part(data)
            except ManifestError:
                continue
            if part.owner_uid is not None:
                return part.owner_uid, True
        return None, records

    async def _committed(self, job: str, step: int) -> Manifest | None:
        """The manifest of a commit, None for a damaged one (catalog.latest skips it too)."""
        try:
            return await self._committer.committed(job, step)
        except ManifestError:
            return None

    async def someone_else(self, job: str, uid: int) -> int | None:
        """The owner of ``job`` at the destination when it is neither ``uid`` nor one that
        ``uid`` may act for; None when ``uid`` may write it."""
        if operator(uid):
            return None
        owner = await self.owner(job)
        return owner if owner is not None and owner != uid else None


# -- the daemon's checks ----------------------------------------------------------------------
# How long a begin waits for the destination to name a job's owner before it goes on.
LOOKUP_TIMEOUT_S = 5.0


def check_now(d: Daemon, job: str, uid: int) -> None:
    """Right before a generation of ``job`` is joined, replaced or opened for ``uid``, with no
    await between: the job is ``uid``'s here, or untracked, or ``uid`` acts for any owner. The
    connection checked before the begin's awaits, and another user's begin may have claimed
    the job since (found racing begins: the second uid's generations opened under the first
    one's ownership and committed as theirs)."""
    recorded = d.ledger.jobs.get(job)
    if recorded is not None and recorded != uid and not operator(uid):
        raise RequestError(wire.PERMISSION_DENIED, f"job {job!r} belongs to another user; "
                           f"uid {uid} may not write it")


async def for_operator(d: Daemon, job: str, uid: int) -> tuple[int, bool]:
    """Whom root's save of a job the node does not track is for, and whether the destination
    said: the owner it names (the part records name them, and they keep the job), else root
    itself. When it cannot answer now, root for now, unverified: :func:`adopt` asks again
    before the first write."""
    if not d.config.access.check_destination_owner:
        return uid, True
    try:
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            found = await d.committer.owners.owner(job)
    except (BackendError, ManifestError, OSError, TimeoutError):
        return uid, False
    return (uid if found is None else found), True


async def adopt(ledger: Ledger, owners: DestinationOwners, job: str) -> None:
    """Before root's first write to a job it began unverified: if the destination names a
    user as the owner, the job is theirs (found reviewing the fix: root's save while the
    lookup failed named root in its part record and took the job from its owner). Raises
    what the destination raises."""
    recorded = ledger.jobs.get(job)
    if recorded is None or not operator(recorded) or job not in owners.unverified:
        return
    found = await owners.owner(job)
    if found is not None and not operator(found):
        await ledger.give_job(job, found)
    owners.unverified.discard(job)


async def refuse_if_elsewhere(d: Daemon, job: str, uid: int) -> bool:
    """Refuse a job the node does not track whose commits at the destination name another
    owner. When the destination cannot answer now, the begin goes on unverified (False):
    every later use of the job asks again (:func:`settle`), and every write checks too."""
    if not d.config.access.check_destination_owner:
        return True
    try:
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            owner = await d.committer.owners.someone_else(job, uid)
    except (BackendError, ManifestError, OSError, TimeoutError) as exc:
        log_event(log, logging.WARNING, "owner_check_failed", job=job, uid=uid,
                  error=str(exc) or type(exc).__name__)
        return False
    if owner is not None:
        raise RequestError(wire.PERMISSION_DENIED, refusal(job, uid))
    return True


async def settle(d: Daemon, job: str) -> None:
    """For a job whose owner here is unverified: ask the destination. When it names nobody or
    the recorded owner, the record stands. When it names another uid, the record was a squat
    made while the destination could not answer: the recorded owner's generations of the job
    end (conflict) and the node forgets the job, so its owner begins it afresh. Raises what
    the destination raises."""
    found = d.committer.owners
    if job not in found.unverified:
        return
    recorded = d.ledger.jobs.get(job)
    if recorded is not None and operator(recorded):
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            await adopt(d.ledger, found, job)
        return
    async with asyncio.timeout(LOOKUP_TIMEOUT_S):
        owner = await found.owner(job)
    if owner is not None and recorded is not None and owner != recorded:
        for gen in [g for g in d.ledger.generations.values() if g.job == job and not g.terminal]:
            await d.fail(gen, f"job {job!r} belongs to another user at the destination; save "
                         "under another job name", kind="conflict")
        await d.expiry.forget_jobs([job])
        if job in d.ledger.jobs:
            return  # something of it is still held (a begin waiting for a slot): ask again
    found.unverified.discard(job)
