"""Shard copies lent to readers: what bounds ``open``, and dropped copies readers still hold.

``open`` lends a reader an fd of a staged copy. A copy dropped while a reader may hold it open
stays on the disk (an unlinked file a reader holds keeps its blocks), so it is not unlinked but
pinned: kept, counted in ``max_staged_bytes`` and charged to its job's owner, and removed once
no reader holds it. What a uid's readers may hold open at once is bounded by
``limits.max_reserved_bytes_per_uid`` (:meth:`LentCopies.may_lend`).

Apart from copies.py, which builds :class:`~ckptdrain.daemon.copies.LocalCopies` on this class,
because lending is its own bookkeeping (its own counts, its own background removal) that the
rest of the copies' room only reaches through :meth:`LentCopies._pin` and
:meth:`LentCopies._unlend`. Its log events keep the ``ckptdrain.copies`` logger.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ckptdrain.daemon.logs import log_event

if TYPE_CHECKING:
    from ckptdrain.daemon.admission import Admission
    from ckptdrain.daemon.budget import Reservation
    from ckptdrain.daemon.dataplane import DataPlane
    from ckptdrain.daemon.ledger import Ledger, ShardRecord
    from ckptdrain.daemon.staging import Staging
    from ckptdrain.daemon.supervisor import Supervisor

__all__ = ["PINNED_FIRST_RECHECK_S", "PINNED_RECHECK_S", "LentCopies"]

# The logger copies.py logs under: these events were always the local copies'.
log = logging.getLogger("ckptdrain.copies")

# How often a dropped copy that a reader still holds open (lent by ``open``) is looked at
# again: soon at first (a reader loading a checkpoint closes it within moments), then every
# PINNED_RECHECK_S (a reader that keeps it costs a lease check per file that often).
PINNED_FIRST_RECHECK_S = 0.25
PINNED_RECHECK_S = 5.0


class LentCopies:
    """The copies a reader was lent, and the dropped ones readers still hold open (pinned)."""

    def __init__(self, staging: Staging, admission: Admission, ledger: Ledger,
                 dataplane: DataPlane, supervisor: Supervisor) -> None:
        self.staging = staging
        self.admission = admission
        self.ledger = ledger
        self.dataplane = dataplane
        self.supervisor = supervisor
        # Staged names whose fd ``open`` lent a reader, and dropped copies a reader still holds
        # open, each with its room: held (and charged to the job's owner) until the file is
        # gone, since an unlinked file a reader holds keeps its blocks.
        self._lent: set[str] = set()
        self._pinned: dict[str, Reservation] = {}
        self._rechecking = False
        # What bounds `open` (may_lend): copies lent that a reader may hold open now, by
        # staged name (the job's owner, the bytes, which lending: a serial), their bytes by
        # owner, and the owner of each pinned copy. A name leaves the first when its copy is
        # dropped (pinned: counted there) or a look finds no reader holds it.
        self._lending: dict[str, tuple[int, int, int]] = {}
        self._lending_bytes: dict[int, int] = {}
        self._lendings = 0
        self._pinned_by: dict[str, int] = {}

    def lent(self, shard: ShardRecord) -> None:
        """``open`` gave a reader an fd of the shard's file: when the copy is dropped, it is
        removed only once no reader holds it (see :meth:`Staging.discard_unless_open`)."""
        name = shard.staged_name
        self._lent.add(name)
        owner = self.ledger.jobs.get(shard.job)
        if owner is None:
            return
        self._unlend(name)  # lent again: a look begun before this lending does not end it
        self._lendings += 1
        self._lending[name] = (owner, shard.size, self._lendings)
        self._lending_bytes[owner] = self._lending_bytes.get(owner, 0) + shard.size

    def _unlend(self, name: str) -> None:
        entry = self._lending.pop(name, None)
        if entry is not None:
            owner, size, _ = entry
            left = self._lending_bytes.get(owner, 0) - size
            if left > 0:
                self._lending_bytes[owner] = left
            else:
                self._lending_bytes.pop(owner, None)

    def _held_open(self, owner: int, shard: ShardRecord) -> int:
        """Bytes ``owner``'s readers may hold open with ``shard``'s copy lent too: copies
        lent and not seen closed since, and dropped ones still held (pinned)."""
        pinned = sum(room.amount for name, room in self._pinned.items()
                     if self._pinned_by.get(name) == owner)
        more = 0 if shard.staged_name in self._lending else shard.size
        return self._lending_bytes.get(owner, 0) + pinned + more

    async def may_lend(self, shard: ShardRecord) -> None:
        """Refuse (backpressure) to lend ``shard``'s copy when what its job's owner holds open
        through ``open`` would pass limits.max_reserved_bytes_per_uid; the caller lends it
        (:meth:`lent`) with nothing awaited in between. A copy a reader holds stays on the
        disk, and in max_staged_bytes, whatever evicts it: a user who saved one job after
        another within its share and held every kept copy open filled the node, and another
        user's hand-off was refused (found attacking). Counted from what was lent, the
        kernel is asked which copies are still held (:meth:`Staging.held_open`) only when
        the count passes the share, and copies seen closed leave it: a restore that reads
        and closes more than the share is never refused, and asks about each copy about
        once."""
        owner = self.ledger.jobs.get(shard.job)
        cap = self.admission.config.limits.max_reserved_bytes_per_uid
        if owner is None or not cap or self._held_open(owner, shard) <= cap:
            return
        names = {name: serial for name, (uid, _, serial) in self._lending.items()
                 if uid == owner and name != shard.staged_name}
        held = await self.dataplane.call(self.staging.held_open, list(names)) if names else set()
        for name, serial in names.items():
            entry = self._lending.get(name)
            if name not in held and entry is not None and entry[2] == serial:
                self._unlend(name)
        total = self._held_open(owner, shard)
        if total > cap:
            raise self.admission.lending_refused(owner, shard.size, total - shard.size)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of dropped copies readers still hold open: on the disk, in max_staged_bytes."""
        return sum(room.amount for room in self._pinned.values())

    def _pin(self, shard: ShardRecord, room: Reservation | None) -> None:
        """Drop a lent copy, or one whose unlink failed: its room (taken again if it was given
        back) stays held, and charged to the job's owner, until no reader holds the file and
        it is removed. A reader holding every copy it was lent takes no more of the disk than
        its share, and a file the kernel would not unlink (EIO) is counted until it goes."""
        name = shard.staged_name
        self._lent.discard(name)
        self._unlend(name)  # counted as pinned from now on
        if room is None:
            room = self.admission.staged.adopt(shard.size)
        owner = self.ledger.jobs.get(shard.job)
        if owner is not None:
            self._pinned_by[name] = owner
            if room.then is None:
                self.admission.charge(room, owner)
        self._pinned[name] = room
        self._remove_pinned_soon()

    def held_from_before(self, name: str, size: int, owner: int | None) -> None:
        """Recovery found ``name``, a copy the journal no longer knows, held open by a reader
        (lent before the restart): counted in max_staged_bytes, and charged to ``owner`` (the
        job's, which its staged name begins with), until it can go."""
        room = self._pinned[name] = self.admission.staged.adopt(size)
        if owner is not None:
            self._pinned_by[name] = owner
            self.admission.charge(room, owner)
        self._remove_pinned_soon()

    def _remove_pinned_soon(self) -> None:
        if not self._rechecking:
            self._rechecking = True
            self.supervisor.spawn(self._remove_pinned, what="remove dropped copies readers held")

    async def _remove_pinned(self) -> None:
        """Remove the dropped copies no reader holds any longer, now and then again, backing
        off to every :data:`PINNED_RECHECK_S` while some remain; each one's room goes back
        with its file."""
        try:
            told = False
            pause = PINNED_FIRST_RECHECK_S
            while self._pinned:
                names = list(self._pinned)
                try:
                    removed = await self.dataplane.call(self.staging.discard_unless_open, names)
                except Exception as exc:  # a staging error: looked at again, not spun on
                    log_event(log, logging.WARNING, "local_copies_remove_failed",
                              files=len(names), error=str(exc) or type(exc).__name__)
                    removed = []
                for name in removed:
                    self._pinned_by.pop(name, None)
                    room = self._pinned.pop(name, None)
                    if room is not None:
                        room.release()
                if not self._pinned:
                    break
                if not told:
                    told = True
                    log_event(log, logging.INFO, "local_copies_held_open",
                              files=len(self._pinned), bytes=self.pinned_bytes,
                              action="kept, and counted against their jobs' owners, until "
                                     "their readers close them")
                await asyncio.sleep(pause)
                pause = min(pause * 2, PINNED_RECHECK_S)
        finally:
            self._rechecking = False
