"""Removing one generation at the destination, and what the removal comes to.

Removing an abandoned generation races a late publish of it (a slow node may still hold every
part record), and so does removing a committed one (another node of the job running its own
commit step of it). The two meet at the one key both must create, ``MANIFEST.json``:
retention first creates it exclusively, holding a tombstone (tombstone.py; a committed
generation's tombstone replaces its manifest in one write, so that key is never empty), and
deletes shards only if that create succeeded or found a tombstone; a publish whose create finds the tombstone does not commit
(it hears "committed" where the tombstone says the generation was). So whichever create
lands first wins, on S3 as on POSIX, and no manifest ever lists deleted shards. Two separate
keys (an ``ABANDONED`` marker beside the manifest) would not do: each side would write its key
and then read the other's, and on a store without multi-key transactions both reads can come
before both writes. The tombstone stays for one grace period (at least
retention.TOMBSTONE_MIN_S) after the shards are gone, so that a publisher which read the part
records just before they were deleted finds it too; a later run removes it.

Apart from retention.py, which decides which generations go (with retention_plan.py) and
reports the run: this module is how one goes.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

from ckptdrain.client.keys import manifest_key
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.latest import NOT_A_COMMIT, parse_manifest
from ckptdrain.daemon.retention_plan import GenerationKeys, deletion_order
from ckptdrain.daemon.tombstone import is_tombstone, placed_at, tombstone_json, was_committed

# Retention's logger, as before this module was split out of retention.py.
log = logging.getLogger("ckptdrain.daemon.retention")


class Abandoned(enum.Enum):
    """What removing an uncommitted (or tombstoned) generation came to."""

    REMOVED = "removed"  # shards and part records gone (the tombstone may stay a while)
    TOMBSTONE_KEPT = "kept"  # only a tombstone left, younger than the grace period
    COMMITTED = "committed"  # a manifest was created before the tombstone: nothing removed
    # The tombstone of a committed generation (its removal was reported when it began):
    RETIRED_REMOVED = "retired_removed"  # an interrupted removal finished now
    RETIRED = "retired"  # nothing left but the tombstone, or not even that now: say nothing


async def _committed_by(job: str, step: int,
                        data: bytes | None) -> tuple[int, tuple[str, ...]] | None:
    """The world size and nodes of the manifest ``data`` (None where it is no manifest of
    the step): what its tombstone says of it."""
    if data is None:
        return None
    try:
        manifest = await parse_manifest(data)
    except ManifestError:
        return None
    if (manifest.job, manifest.generation) != (job, step):
        return None
    return manifest.world_size, manifest.nodes


async def delete_committed(backend: Backend, job: str, gen: GenerationKeys,
                           now: float, held: bytes | None) -> bool:
    """Remove a committed generation beyond keep_last (``held``: what its manifest key held
    when read just before); False where the key held nothing then (or the manifest had to go
    first, for room) and a publish created its manifest before the tombstone below (then
    nothing else was removed)."""
    by = await _committed_by(job, gen.step, held)
    _, parts, rest = deletion_order(job, gen)
    # The manifest goes first and alone: one write puts the tombstone in its place, and only
    # then do the part records and shards go, so no shard is missing while the manifest can
    # still be read, and the key is never empty. Found attacking: deleted first and then
    # taken with an exclusive create, the key was empty for a moment; a second run that had
    # read the manifest before a first run replaced it deleted the first run's tombstone
    # there, after the first run had deleted the shards, and a late publish that had checked
    # them before created the manifest again over the missing shards. A late publish now
    # meets the manifest or the tombstone, both of which say it committed; a run that
    # replaces another's tombstone leaves a tombstone.
    # It names the manifest's world size and nodes: a node still waiting on the step tells
    # from them whether its own part was the one committed (found attacking: one whose
    # attempt had been replaced by another node's heard its step committed).
    # A key that held no manifest of the step (damaged, or gone since the listing) committed
    # nothing anyone can name: its tombstone says not "was committed" (found attacking: a
    # node waiting on the step then heard it committed, from a tombstone that said nothing
    # more, as older ones do).
    tombstone = tombstone_json(job, gen.step, backend.node_id, now,
                               was_committed=by is not None, committed_by=by)
    key = manifest_key(job, gen.step)
    if (held is None or not await _replaced(backend, key, tombstone)) and not (
            await backend.put_bytes(key, tombstone, exclusive=True)):
        # Nothing was there a moment ago (removed since the listing), or the manifest had to
        # go first for room: the key is taken only if still empty. A manifest created
        # meanwhile lists shards that are all still there.
        data = await read_manifest_key(backend, job, gen.step)
        if data is not None and not is_tombstone(data):
            return False
    # Part records before shards: once they are gone no node re-running the commit step for
    # this generation (a daemon restarted with it in its journal) can publish it again. The
    # tombstone stays one grace period (a later run removes it, as an abandoned one's).
    await _delete_all(backend, parts)
    await _delete_all(backend, rest)
    return True


async def _replaced(backend: Backend, key: str, tombstone: bytes) -> bool:
    """Put ``tombstone`` in the place of the manifest at ``key`` with one write; False where
    the destination is full, after deleting the manifest to make the room (the caller then
    takes the key with an exclusive create). Found attacking the one write: on a destination
    too full for a few hundred bytes beside the manifest, every `gc` failed "the destination
    is full" and could free nothing; deleting first frees the manifest's room. Only a full
    destination has the moment with no key (module docstring)."""
    try:
        await backend.put_bytes(key, tombstone)
    except BackendError as exc:
        if exc.kind != "full":
            raise
        log.warning("retention: no room for the tombstone of %s beside it (%s); deleting the "
                    "manifest first", key, exc)
        await backend.delete(key)
        return False
    return True


def _tombstone_written(gen: GenerationKeys, data: bytes | None, now: float,
                       grace_s: float) -> float | None:
    """When the tombstone at ``gen``'s manifest key was written: by its own word where that
    is later than the listing's time (found attacking: a run that listed a committed
    generation's old manifest just before another run replaced it by a tombstone took the
    manifest's age for the tombstone's and removed it at once, and a late publish then
    brought the manifest back). A time past ``now + grace_s`` is garbage: the listing's."""
    written = gen.manifest_written
    at = placed_at(data) if data is not None else None
    if at is not None and at <= now + grace_s:
        written = max(at, written or at)
    return written


def _settled(retired: bool, left: bool, tombstone_goes: bool) -> Abandoned:
    """What removing a tombstoned generation comes to: ``left``, whether part records or
    shards were still there; ``tombstone_goes``, whether the tombstone is old enough to go."""
    if retired:
        return Abandoned.RETIRED_REMOVED if left else Abandoned.RETIRED
    return Abandoned.REMOVED if left or tombstone_goes else Abandoned.TOMBSTONE_KEPT


def foreseen(job: str, gen: GenerationKeys, tomb: bytes | None, now: float,
             grace_s: float) -> Abandoned:
    """What :func:`delete_abandoned` would come to for ``gen`` (a dry run), its manifest key
    holding ``tomb`` (None: nothing yet, so this run's tombstone would go there)."""
    left = any(deletion_order(job, gen)[1:])
    if tomb is None:
        return _settled(False, left, False)
    written = _tombstone_written(gen, tomb, now, grace_s)
    return _settled(was_committed(tomb), left, written is not None and now - written >= grace_s)


async def delete_abandoned(
    backend: Backend, job: str, gen: GenerationKeys, now: float, grace_s: float
) -> Abandoned:
    """Remove an uncommitted generation, tombstone first (see the module docstring)."""
    key = manifest_key(job, gen.step)
    tombstone = tombstone_json(job, gen.step, backend.node_id, now)
    retired = False
    written: float | None = now  # this run's own tombstone
    if not await backend.put_bytes(key, tombstone, exclusive=True):
        data = await read_manifest_key(backend, job, gen.step)
        if data is not None and not is_tombstone(data):
            # A node published before our create: it is committed now, and its shards stay.
            # (A damaged manifest stays too: the rules keep those for inspection.)
            return Abandoned.COMMITTED
        # A tombstone (ours from an earlier run, or another node's running now), or gone
        # since (another run removed an old tombstone after the shards): finish the removal.
        retired = data is not None and was_committed(data)
        written = _tombstone_written(gen, data, now, grace_s)
    _, parts, rest = deletion_order(job, gen)
    await _delete_all(backend, parts)
    await _delete_all(backend, rest)
    goes = written is not None and now - written >= grace_s
    if goes:
        # A publisher that read the part records before they went has had a whole grace
        # period to reach its create and meet the tombstone: the key can go now.
        await backend.delete(key)
    return _settled(retired, bool(parts or rest), goes)


class NotUsable(DaemonError):
    """The manifest key of a generation to remove holds what no reader takes for a commit
    and retention may neither read nor replace (a link, an oversized object, a FIFO, a
    directory: anything but a regular file)."""


async def read_manifest_key(backend: Backend, job: str, step: int) -> bytes | None:
    """What the manifest key of ``step`` holds; :class:`NotUsable` when it is no object a
    reader would read, before anything of the generation is deleted."""
    try:
        return await backend.get_bytes(manifest_key(job, step))
    except BackendError as exc:
        if exc.kind not in NOT_A_COMMIT:
            raise
        raise NotUsable(str(exc)) from None


async def _delete_all(backend: Backend, keys: Sequence[str]) -> None:
    """Delete ``keys`` in bulk (Backend.delete_many: DeleteObjects on S3, a directory fsync
    per batch on POSIX); every delete is done and durable when this returns."""
    if keys:
        await backend.delete_many(keys)
