"""The read side of the commit protocol: what a step's ``MANIFEST.json`` key holds (a
manifest, read and parsed once and cached; a tombstone; damage), whether a step is committed
(what a ``begin`` asks), and a generation's part records and the ranks they cover.

The base of :class:`~ckptdrain.daemon.commit.Committer`: every decision the commit makes
starts from these reads, and every read of a manifest key for a decision goes through
:meth:`CommitReads._read_key`. Apart from commit.py, which owns the writes (part records,
the exclusive create of the manifest, LATEST).
"""

from __future__ import annotations

from ckptdrain.client.keys import manifest_key, part_key, parts_prefix
from ckptdrain.client.manifest import Manifest, NewerFormat, PartRecord
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.daemon.assembly import missing_ranks, owners_disagree
from ckptdrain.daemon.backends.base import Backend
from ckptdrain.daemon.errors import DaemonError
from ckptdrain.daemon.fanout import for_each_bounded
from ckptdrain.daemon.latest import off_loop_if_large, parse_manifest
from ckptdrain.daemon.manifestcache import Committed, ManifestCache
from ckptdrain.daemon.tombstone import is_tombstone, was_committed

# Part records are read concurrently, but bounded: a 1,000-node job must not open 1,000
# requests at once against the destination.
PART_READ_CONCURRENCY = 16


class CommitError(DaemonError):
    """Root of the commit protocol's refusals: the message says what to do."""


class StepUnusable(CommitError):
    """A step whose MANIFEST.json key is taken by something other than a valid manifest of
    that step: a new attempt there could never commit. Refuse it; the job saves a new step."""

    def __init__(self, job: str, step: int, message: str) -> None:
        super().__init__(message)
        self.job = job
        self.step = step


class ManifestDamaged(StepUnusable):
    """The step's MANIFEST.json exists but is not a valid manifest of that step: committed
    (nothing may overwrite it), but not loadable. Keep it for inspection."""


class StepAbandoned(StepUnusable):
    """Retention is removing the step as abandoned (its tombstone holds the manifest key)."""


class CommitReads:
    """What a committer reads at one destination (``backend``), its manifests cached."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.manifests = ManifestCache()

    async def ranks_missing(
        self, job: str, step: int, world_size: int, attempt: str = ""
    ) -> list[int] | None:
        """Ranks with no part record yet; None when the records disagree (try_publish says why)."""
        parts, problem = await self.read_parts(job, step, world_size, attempt)
        return None if problem else missing_ranks(parts, world_size)

    async def committed(self, job: str, step: int) -> Manifest | None:
        """The generation's manifest, or None if it is not committed (also when retention
        has tombstoned it as abandoned); read and parsed once (:mod:`.manifestcache`).

        Raises ManifestError when a manifest exists but is malformed: that is damage to
        report, not an uncommitted generation to wait for.
        """
        found = await self.committed_shards(job, step)
        return None if found is None else found.manifest

    async def committed_shards(self, job: str, step: int) -> Committed | None:
        """:meth:`committed`, with its shards by path."""
        return await self.manifests.get(job, step, lambda: self._read_committed(job, step))

    async def committed_or_removed(self, job: str, step: int
                                   ) -> tuple[Manifest | None, bytes | None]:
        """:meth:`committed`, and, where retention removed the step after it committed, the
        tombstone its manifest key holds now (tombstone.py: it says so, and by which world
        size and nodes), from one read."""
        read: list[bytes] = []
        found = await self.manifests.get(job, step, lambda: self._read_committed(job, step, read))
        if found is not None:
            return found.manifest, None
        if read and is_tombstone(read[0]) and was_committed(read[0]):
            return None, read[0]
        return None, None

    async def _read_key(self, key: str) -> tuple[bytes | None, Manifest | None]:
        """What a MANIFEST.json key holds: (None, None) nothing, (bytes, None) a tombstone,
        (bytes, manifest) a manifest. Bytes that are neither are read once more before they
        count (ManifestError): one answer that held no object's bytes (a 200 whose body was
        an S3 <Error>, from a middlebox) refused a step nobody had saved, failed a late
        publish as a conflict, and cancelled a step another node had committed (found
        attacking the S3 drain, then multi-node commits). Twice unreadable, it is the key's.
        Every read of a manifest key for a decision goes through here."""
        # The raw key, not latest.manifest_bytes: for the step asked about, a link or an
        # oversized object there is an error to report (a wait on it must not just time out).
        for read in (1, 2):
            data = await self.backend.get_bytes(key)
            if data is None or is_tombstone(data):
                return data, None
            try:
                return data, await parse_manifest(data)
            except ManifestError:
                if read == 2:
                    raise
        raise AssertionError("unreachable")

    async def _read_committed(self, job: str, step: int,
                              read: list[bytes] | None = None) -> Manifest | None:
        """The manifest at the step's key, or None; ``read`` takes what the key held."""
        data, manifest = await self._read_key(manifest_key(job, step))
        if data is not None and read is not None:
            read.append(data)
        return manifest

    async def is_committed(self, job: str, step: int) -> bool:
        """Whether ``job`` step ``step`` is committed at the destination: what a ``begin``
        asks before accepting a generation (a committed step must be refused: "step 5 of job
        X is committed; save a new step").

        Raises :class:`ManifestDamaged` when the manifest key holds anything but a valid
        manifest of this step, and :class:`StepAbandoned` when retention has tombstoned it:
        either way a new attempt there could never commit, so the caller refuses it too.
        BackendError when the destination cannot answer (transient ones are worth a retry).
        """
        key = manifest_key(job, step)
        try:
            data, manifest = await self._read_key(key)
        except NewerFormat as exc:
            # Committed, by a newer ckptdrain: refused all the same, but no damage to inspect
            # (it was "damaged ... inspect it"; reported by the helper attacking upgrades).
            raise StepUnusable(
                job, step,
                f"step {step} of job {job!r} is committed by a newer ckptdrain ({exc}); "
                "nothing may overwrite it: save a new step, and upgrade ckptdrain on this "
                "node to read it",
            ) from exc
        except ManifestError as exc:
            raise ManifestDamaged(
                job, step,
                f"step {step} of job {job!r} has a damaged MANIFEST.json at {key} ({exc}); "
                "nothing may overwrite it: inspect it, and save a new step",
            ) from exc
        if data is None:
            return False
        if manifest is None:
            what = ("was committed, and retention has since removed it (older than the "
                    "newest retention.keep_last commits)" if was_committed(data) else
                    "was abandoned and is being removed by retention")
            raise StepAbandoned(
                job, step,
                f"step {step} of job {job!r} {what} ({key} holds its tombstone); save a "
                "new step",
            )
        if (manifest.job, manifest.generation) != (job, step):
            raise ManifestDamaged(
                job, step,
                f"step {step} of job {job!r} has a damaged MANIFEST.json at {key} (it "
                f"describes {manifest.job!r} generation {manifest.generation}); nothing may "
                "overwrite it: inspect it, and save a new step",
            )
        return True

    async def read_parts(
        self, job: str, step: int, world_size: int, attempt: str = "", *,
        others: list[PartRecord] | None = None,
    ) -> tuple[list[PartRecord], str]:
        """Every readable part record of ``attempt``, or a reason why they cannot be trusted.
        Records of another attempt at the same step are stale: not counted, not a conflict
        (appended to ``others`` when given: what a wait that never ends names).
        A destination error is raised as itself (BackendError), not inside an ExceptionGroup,
        so callers can retry it; records are parsed off the event loop."""
        prefix = parts_prefix(job, step)
        keys = [
            info.key
            for info in await self.backend.list(prefix)
            if info.key.endswith(".json") and "/" not in info.key[len(prefix) :]
        ]
        found: dict[str, bytes | None] = {}

        async def read(key: str) -> None:
            found[key] = await self.backend.get_bytes(key)

        await for_each_bounded(keys, read, PART_READ_CONCURRENCY)
        datas = [found[key] for key in keys]
        # 100,000 shards are megabytes of JSON: parsed in a worker thread, never on the loop.
        decoded = await off_loop_if_large(sum(len(d) for d in datas if d), _decode_parts, datas)
        parts: list[PartRecord] = []
        for key, part_or_error in zip(keys, decoded, strict=True):
            if part_or_error is None:
                continue  # removed since the listing; the coverage check decides
            if isinstance(part_or_error, ManifestError):
                return [], f"part record {key} is unreadable: {part_or_error}"
            part = part_or_error
            if key != part_key(job, step, part.node):
                return [], f"part record {key} names node {part.node!r}; it is misplaced"
            if (part.job, part.step) != (job, step):
                return [], f"part record {key} is for {part.job!r} step {part.step}"
            if part.attempt != attempt:
                if others is not None:
                    others.append(part)
                continue  # left by another attempt at this step; its node will rewrite it
            if part.world_size != world_size:
                return [], (
                    f"node {part.node!r} drained this generation with world_size "
                    f"{part.world_size}, this node with {world_size}; two runs wrote the same "
                    "job and step"
                )
            parts.append(part)
        mixed = owners_disagree(parts)
        if mixed:
            return [], mixed
        return parts, ""


def _decode_parts(datas: list[bytes | None]) -> list[PartRecord | ManifestError | None]:
    out: list[PartRecord | ManifestError | None] = []
    for data in datas:
        if data is None:
            out.append(None)
            continue
        try:
            out.append(PartRecord.from_json(data))
        except ManifestError as exc:
            out.append(exc)
    return out
