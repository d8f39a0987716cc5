"""The write side of the commit protocol: part records, rank coverage, exclusive publish.

Every node runs the same steps, with no coordinator and no lock:

1. After all shards of the ranks it served have drained and been verified, the node writes its
   part record ``_parts/<node>.json`` (rewritten with the cumulative set as more ranks finish).
2. It lists every part record of the generation. If together they cover ranks
   ``0..world_size-1`` and agree with each other, and every shard they list is at the
   destination with the size and recorded checksum its record names (another attempt at the
   same step may have replaced an uncommitted shard: then this attempt cannot commit), it
   builds the manifest and publishes it with an exclusive create. Exactly one node's create
   succeeds (PUBLISHED); the others read the winner's manifest and accept it when it commits
   the same shards (ACCEPTED). A create that finds retention's tombstone (tombstone.py) fails:
   the generation was abandoned and its shards are being deleted.
3. After publishing or accepting, the node raises the ``LATEST`` hint if it is behind.

The manifest is the generation's last write; nothing the generation needs is written after it.
Only the :class:`Backend` interface is used, so the protocol is the same on POSIX and S3.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptdrain.client.keys import (
    generation_prefix,
    latest_key,
    manifest_key,
    part_key,
    validate_node_id,
)
from ckptdrain.client.manifest import Manifest, PartRecord, checked_size
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.assembly import (
    build_manifest,
    describe_ranks,
    missing_ranks,
    same_contents,
)
from ckptdrain.daemon.backends.base import Backend, BackendError
from ckptdrain.daemon.commitreads import (
    CommitError,
    CommitReads,
    ManifestDamaged,
    StepAbandoned,
    StepUnusable,
)
from ckptdrain.daemon.latest import (
    PART_ENTRY_BYTES,
    off_loop_if_large,
    parse_latest,
    raise_latest,
)
from ckptdrain.daemon.owners import DestinationOwners
from ckptdrain.daemon.tombstone import was_committed

# Re-exported: the LATEST helpers lived here first (latest.py now), the refusals until
# commitreads.py took the reads that raise them.
__all__ = [
    "CommitError", "CommitOutcome", "CommitResult", "Committer", "ManifestDamaged",
    "StepAbandoned", "StepUnusable", "parse_latest",
]

log = logging.getLogger(__name__)


# Shards checked at once before a publish: a 100,000-shard generation is 100,000 HEADs on S3
# (a few seconds at this width) and must not be 100,000 requests at once.
SHARD_CHECK_CONCURRENCY = 32
# Raising LATEST after a commit: tries for a transient failure, the first wait between them
# (then doubled). LATEST is a hint, so after them the commit stands without it.
LATEST_TRIES = 3
LATEST_RETRY_S = 0.2


class CommitOutcome(enum.Enum):
    PUBLISHED = "published"  # this node's exclusive create made the manifest
    ACCEPTED = "accepted"  # another node published first; its manifest matches
    INCOMPLETE = "incomplete"  # some ranks have no part record yet (or a shard is missing)
    CONFLICT = "conflict"  # the records or the existing manifest disagree: cannot commit


@dataclass(frozen=True)
class CommitResult:
    outcome: CommitOutcome
    manifest: Manifest | None
    missing_ranks: list[int] = field(default_factory=list)
    reason: str = ""
    # INCOMPLETE: shards the part records list that the destination does not hold.
    absent: tuple[ShardEntry, ...] = ()

    @property
    def committed(self) -> bool:
        return self.outcome in (CommitOutcome.PUBLISHED, CommitOutcome.ACCEPTED)


class Committer(CommitReads):
    """Writes this node's part records and publishes manifests at one destination (what it
    reads to decide: :class:`~ckptdrain.daemon.commitreads.CommitReads`)."""

    def __init__(
        self, backend: Backend, node_id: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(backend)
        self.node_id = validate_node_id(node_id)
        self._clock = clock
        # One per job this committer has raised LATEST for: a handful per daemon.
        self._latest_locks: dict[str, asyncio.Lock] = {}
        # Who owns each job at the destination (owners.py): asked before a begin or a commit.
        self.owners = DestinationOwners(self)

    async def record_part(self, part: PartRecord) -> None:
        """Write (or overwrite) this node's part record for the part's generation
        (RecordTooLarge, and nothing written, where no reader would take it)."""
        if part.node != self.node_id:
            raise ValueError(
                f"part record names node {part.node!r} but this committer is {self.node_id!r}"
            )
        body = await off_loop_if_large(len(part.shards) * PART_ENTRY_BYTES, part.to_json)
        checked_size(body, f"part record of node {part.node!r}", len(part.shards))
        await self.backend.put_bytes(part_key(part.job, part.step, part.node), body)

    async def try_publish(
        self, job: str, step: int, world_size: int, attempt: str = ""
    ) -> CommitResult:
        """Publish the generation's manifest if the part records cover every rank.

        Safe to call from every node, any number of times: at most one PUBLISHED ever, and a
        retry after a crash between the manifest and LATEST simply returns ACCEPTED.
        Raises BackendError when the destination fails (the caller retries), and
        RecordTooLarge when the manifest would be larger than a reader takes (never written).
        """
        parts, problem = await self.read_parts(job, step, world_size, attempt)
        if problem:
            return CommitResult(CommitOutcome.CONFLICT, None, reason=problem)
        missing = missing_ranks(parts, world_size)
        if missing:
            return CommitResult(
                CommitOutcome.INCOMPLETE,
                None,
                missing,
                f"ranks {describe_ranks(missing)} of {world_size} have no part record yet",
            )
        try:
            manifest = await off_loop_if_large(sum(len(p.shards) for p in parts)
                                               * PART_ENTRY_BYTES, build_manifest, parts,
                                               self._clock())
        except ManifestError as exc:
            return CommitResult(CommitOutcome.CONFLICT, None, reason=str(exc))
        body = await off_loop_if_large(len(manifest.shards) * PART_ENTRY_BYTES, manifest.to_json)
        # Published, a manifest no reader takes would be a commit nobody can load, answered
        # "committed" to this node's waiters (found attacking: 2 nodes x 31,000 shards).
        checked_size(body, "manifest", len(manifest.shards))

        absent, different = await self._unproven_shards(manifest)
        if different:
            return CommitResult(
                CommitOutcome.CONFLICT,
                None,
                reason=f"shards {_some(different)} at the destination are not the bytes their "
                "part records name (another attempt at this step wrote them); this attempt "
                "cannot commit: save a new step",
            )
        if absent:
            return CommitResult(
                CommitOutcome.INCOMPLETE,
                None,
                sorted({shard.rank for shard in absent}),
                f"shards {_some(absent)} are listed in part records but missing at the "
                "destination; their nodes must drain them again",
                tuple(absent),
            )

        key = manifest_key(job, step)
        if await self.backend.put_bytes(key, body, exclusive=True):
            log.info(
                "published %s (%d shards, %d bytes)",
                key,
                len(manifest.shards),
                manifest.total_bytes,
            )
            return await self._published(job, step, manifest)

        try:
            existing_bytes, existing_manifest = await self._read_key(key)
        except ManifestError as exc:
            return CommitResult(
                CommitOutcome.CONFLICT, None, reason=f"the existing {key} is unreadable: {exc}"
            )
        if existing_bytes is not None and existing_manifest is None:
            if was_committed(existing_bytes):
                # Committed by another node's create, from the same part records whose
                # shards this one just found (another attempt's would be other bytes), and
                # removed since beyond keep_last: this node's waiters hear "committed".
                return CommitResult(
                    CommitOutcome.ACCEPTED, None,
                    reason=f"step {step} of job {job!r} was committed, and retention has "
                    f"since removed it ({key} holds its tombstone)")
            return CommitResult(
                CommitOutcome.CONFLICT,
                None,
                reason=f"step {step} of job {job!r} was abandoned: retention took {key} for "
                "its tombstone before this publish and is removing the generation; it can no "
                "longer commit: save a new step",
            )
        if existing_bytes is None:
            return CommitResult(
                CommitOutcome.CONFLICT,
                None,
                reason=f"{key} existed at the exclusive create but cannot be read as a file "
                "now: something put a directory there, or is deleting this generation "
                "(retention?); look at it, then `ckptdrain retry` or save a new step",
            )
        existing = existing_manifest
        assert existing is not None  # bytes that are no tombstone parsed as a manifest
        if not same_contents(existing, manifest):
            return CommitResult(
                CommitOutcome.CONFLICT,
                existing,
                reason=f"{key} already exists and commits different shards than the part "
                "records now say; two runs wrote the same job and step",
            )
        await self._raise_latest_hint(job, step)
        return CommitResult(CommitOutcome.ACCEPTED, existing)

    # --- steps ------------------------------------------------------------------------------

    async def _unproven_shards(
        self, manifest: Manifest
    ) -> tuple[list[ShardEntry], list[ShardEntry]]:
        """(absent, different): the shards the manifest would commit that are not at the
        destination, and those that are there with other bytes than their part record says.

        Part records are written only after their shards drained, so this normally finds
        nothing; it guards the one promise a manifest makes, also against another attempt at
        the same step that replaced an uncommitted shard. One ``stat`` per shard, asked of
        the backend all at once (``stat_many``): the size and the checksum recorded when the
        object was created (S3 metadata, a POSIX xattr), no read of the bytes. An object with
        no recorded checksum (written by an older version, or a new multipart S3 object, which
        only its writer's record can name: see s3.py) is proved by its size alone, as before.
        """
        prefix = generation_prefix(manifest.job, manifest.generation)
        absent: list[ShardEntry] = []
        different: list[ShardEntry] = []

        shards = manifest.shards
        infos = await self.backend.stat_many([prefix + shard.path for shard in shards],
                                             concurrency=SHARD_CHECK_CONCURRENCY)
        for shard, found in zip(shards, infos, strict=True):
            if found is None:
                absent.append(shard)
            elif found.size != shard.size or not _same_or_unknown(found.checksum, shard):
                different.append(shard)
        return sorted(absent, key=_by_rank), sorted(different, key=_by_rank)

    async def _published(self, job: str, step: int, manifest: Manifest) -> CommitResult:
        """This node's create made the manifest: the commit happened, whatever LATEST does.
        LATEST is a hint (readers check it against the listing), so a failure to raise it is
        logged, not raised: a retry of the whole publish would find the manifest and answer
        ACCEPTED, and no node would know it published (nor run retention)."""
        await self._raise_latest_hint(job, step)
        return CommitResult(CommitOutcome.PUBLISHED, manifest)

    async def _raise_latest_hint(self, job: str, step: int) -> None:
        """Raise LATEST to ``step`` after a commit, a few tries for a transient failure; then
        log and go on. The manifest is the commit; a LATEST that cannot be written (a
        throttled store, a refused key) must not turn a committed generation into a failed
        one on any node, and readers find the generation by listing meanwhile."""
        for attempt in range(LATEST_TRIES):
            try:
                await self._raise_latest(job, step)
                return
            except BackendError as exc:
                if not exc.transient or attempt + 1 == LATEST_TRIES:
                    log.warning("%s is committed but %s could not be raised to it: %s; "
                                "readers find it by listing until a later commit raises it",
                                manifest_key(job, step), latest_key(job), exc)
                    return
                await asyncio.sleep(LATEST_RETRY_S * 2 ** attempt)
            except Exception:
                # The commit's boundary: past the manifest nothing may fail the generation
                # (a hostile manifest above it once made the newest-commit scan raise, and the
                # committed step was reported failed).
                log.exception("%s is committed but %s could not be raised to it; readers "
                              "find it by listing until a later commit raises it",
                              manifest_key(job, step), latest_key(job))
                return

    async def _raise_latest(self, job: str, step: int) -> None:
        """Point LATEST at ``step`` unless it already names a newer generation.

        Raises are serialised per job in this process: two generations of one job published
        at once by this daemon would otherwise both read the old hint and the slower one
        would write its older step last. Across nodes, :func:`raise_latest` repairs it.
        """
        async with self._latest_locks.setdefault(job, asyncio.Lock()):
            await raise_latest(self.backend, job, step)


def _same_or_unknown(recorded: str | None, shard: ShardEntry) -> bool:
    """Whether the checksum the destination recorded for an object (None: none) does not
    contradict ``shard``'s. One of another algorithm proves nothing either way: a shard a
    format 1 version promised in sha256 (a deferred one, drained after an upgrade) is recorded
    in CRC64NVME at the destination, and comparing the two as one failed its step as a
    conflict, "another attempt wrote them" (found attacking upgrades). Its size still counts."""
    if recorded is None:
        return True
    if recorded.partition(":")[0] != shard.algo:
        return True
    return recorded == shard.checksum


def _by_rank(shard: ShardEntry) -> tuple[int, str]:
    return shard.rank, shard.path


def _some(shards: Sequence[ShardEntry], shown: int = 5) -> str:
    """``'a', 'b' and 3 more``: bounded, so 100,000 bad shards make a readable reason."""
    names = ", ".join(repr(shard.path) for shard in shards[:shown])
    return names + (f" and {len(shards) - shown} more" if len(shards) > shown else "")
