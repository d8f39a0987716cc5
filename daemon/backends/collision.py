"""What a create-once shard write does when its key is already taken, for every backend.

Each backend creates a shard exclusively (``link()`` on POSIX, ``If-None-Match: *`` on S3, a
check in memory) and, when the key exists, asks :func:`settle_existing` what to do:

- the existing object is the same bytes (size and recorded checksum): the shard counts as
  drained and nothing is written (a retried drain, a re-drain after a restart);
- the generation is committed (its MANIFEST.json exists) and the bytes differ: a
  :class:`ShardConflict`, and the committed bytes are left alone;
- there is no manifest: the object is a leftover of an attempt that never committed, and the
  backend replaces it. The replacement always carries its checksum, so a publish of the old
  attempt that still names the old bytes fails its proof (``Committer.try_publish``) instead
  of committing someone else's bytes.

Only the destination's layout is known here (shard key -> generation -> manifest key), never
which backend is asking.
"""

from __future__ import annotations

import logging

from ckptdrain.client.keys import manifest_key, parse_generation_dir
from ckptdrain.client.manifest import Manifest
from ckptdrain.client.names import MANIFEST_NAME
from ckptdrain.client.recordfields import ManifestError
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.backends.base import Backend, ObjectInfo, ShardConflict
from ckptdrain.daemon.latest import parse_manifest
from ckptdrain.daemon.tombstone import is_tombstone

log = logging.getLogger(__name__)


def parse_shard_key(key: str) -> tuple[str, int, str] | None:
    """``(job, step, path)`` of a key under a generation directory, else None."""
    job, sep, rest = key.partition("/")
    dirname, sep2, path = rest.partition("/")
    if not (sep and sep2 and job and path) or path == MANIFEST_NAME:
        return None
    step = parse_generation_dir(dirname)
    if step is None:
        return None
    return job, step, path


async def settle_existing(
    backend: Backend, key: str, size: int, checksum: str, existing: ObjectInfo
) -> bool:
    """True when ``existing`` (the object at ``key``) is these bytes; False when it is a
    leftover the caller may replace. Raises ShardConflict when it must stay."""
    if existing.checksum is not None and (existing.size, existing.checksum) == (size, checksum):
        return True
    where = f"{backend.uri.rstrip('/')}/{key}"
    parsed = parse_shard_key(key)
    if parsed is None:
        return False  # not a shard of a generation: no commit can name it
    job, step, path = parsed
    data = await backend.get_bytes(manifest_key(job, step))
    if data is None:
        # An object without a recorded checksum (written by an older version) is replaced
        # too: no manifest vouches for it, and the replacement records its checksum.
        return False
    if is_tombstone(data):
        raise ShardConflict(
            f"step {step} of job {job!r} was abandoned and is being removed by retention "
            f"(found {where}); save a new step"
        )
    try:
        manifest = await parse_manifest(data)
    except ManifestError as exc:
        raise ShardConflict(
            f"step {step} of job {job!r} has a damaged MANIFEST.json ({exc}); nothing is "
            f"written over {where}: inspect it, and save a new step"
        ) from exc
    entry = _entry(manifest, path)
    if entry is None:
        raise ShardConflict(
            f"step {step} of job {job!r} is committed without {path!r} (found {where}); "
            "nothing is added to a committed generation: save a new step"
        )
    if existing.checksum is None and (entry.size, entry.checksum) == (size, checksum):
        # No checksum recorded with the object, but the manifest vouches for these bytes.
        return True
    raise ShardConflict(
        f"step {step} of job {job!r} is committed with different bytes at {where}; "
        "save a new step"
    )


async def check_replaced(backend: Backend, key: str, size: int, checksum: str) -> None:
    """After replacing a leftover: if a manifest listing other bytes at ``key`` appeared
    meanwhile, another attempt committed between our check and our write. The damage is done
    (there is no multi-key atomicity to prevent it); say so loudly rather than report a drain.
    """
    parsed = parse_shard_key(key)
    if parsed is None:
        return
    job, step, path = parsed
    data = await backend.get_bytes(manifest_key(job, step))
    if data is None or is_tombstone(data):
        return
    try:
        entry = _entry(await parse_manifest(data), path)
    except ManifestError:
        return  # damaged: nothing it promises can be checked; settle_existing reports it
    if entry is not None and (entry.size, entry.checksum) != (size, checksum):
        where = f"{backend.uri.rstrip('/')}/{key}"
        log.error("%s was replaced while another attempt committed step %d of %r", where, step,
                  job)
        raise ShardConflict(
            f"step {step} of job {job!r} was committed by another attempt while this one "
            f"replaced {where}; that generation may now fail `ckptdrain verify`: check it, "
            "and save a new step"
        )


def _entry(manifest: Manifest, path: str) -> ShardEntry | None:
    return next((s for s in manifest.shards if s.path == path), None)
