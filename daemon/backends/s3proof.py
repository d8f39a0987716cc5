"""The commit's proof of many S3 shards from one listing instead of a HEAD each.

Before it writes a manifest, the committer proves every shard the manifest will name: there,
with the size and checksum its part record gives. A HEAD per shard is a request per shard:
for 256 shards of 1 MiB, about a fifth of the CPU the whole drain spends. Most of those
objects this backend created itself, and each PutObject was answered with the object's
ETag. A listing answers the size and ETag of 1,000 keys a page. A listed object with the
size and ETag of the one this backend created is taken to be that object, so the checksum
computed as it was sent holds for it, as a HEAD would have said. That rests on two things
true of AWS S3, SeaweedFS, MinIO and single-site Ceph: a single PutObject's ETag is the MD5
of its bytes (or an id the store gives each new object), and a listing shows every delete and
overwrite made before it. A store whose listings lag (OpenStack Swift's S3 API, Ceph
multi-site) would show an object already replaced or deleted as still there; there
``destination.prove_by_listing = false`` keeps a HEAD per shard.

Otherwise the listing only ever spares requests. A key that is not listed, or listed with
another size or ETag, a shard another node drained, one this backend settled or replaced
rather than created, or one created before this daemon started, is asked with a HEAD as
before.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from ckptdrain.daemon.backends.base import ObjectInfo
from ckptdrain.daemon.backends.s3parts import same_etag

# Objects remembered (the newest): 27 MB measured for 65,536 keys of 80 characters, so about
# 14 MB at most here. Generations committed long after their shards drained, or more small
# shards than this awaiting their commits at once, fall back to HEADs beyond it.
REMEMBERED = 32_768
# Fewer remembered keys than this in one proof: their HEADs, sent at once, answer sooner.
LISTING_MIN = 8
# Parsing a listed key costs about a sixteenth of a HEAD (in-process against SeaweedFS: a
# page of 1,000 keys 55 ms of CPU, a HEAD 0.85 ms). A proof lists only when the keys this
# backend created are at least that share of those asked about: a node that drained 8 of a
# generation's 100,000 shards asks for 8 HEADs, not 100 pages.
LISTED_PER_HEAD = 16
# A listing that finds this many more keys than the proof asks about (other objects under
# the same prefix) is given up: HEADs then, not an unbounded walk.
LISTING_SLACK = 1_000


@dataclass(frozen=True, slots=True)
class Listed:
    """One key as a listing shows it."""

    size: int
    etag: str
    modified: float | None


@dataclass(frozen=True, slots=True)
class _Made:
    size: int
    checksum: str
    etag: str


class CreatedObjects:
    """The objects this backend created with a single PutObject: key -> size, the checksum
    sent with it, and the ETag the server answered. Bounded, oldest forgotten first."""

    def __init__(self, limit: int = REMEMBERED) -> None:
        self._limit = limit
        self._made: collections.OrderedDict[str, _Made] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._made)

    def remember(self, key: str, size: int, checksum: str, etag: str) -> None:
        self._made.pop(key, None)
        if not etag:
            return  # nothing a listing could match: this key gets a HEAD
        self._made[key] = _Made(size, checksum, etag)
        while len(self._made) > self._limit:
            self._made.popitem(last=False)

    def known(self, keys: list[str]) -> list[int]:
        """Indexes of the ``keys`` this backend created and still remembers."""
        return [i for i, key in enumerate(keys) if key in self._made]

    def proved(self, key: str, listed: Listed | None) -> ObjectInfo | None:
        """What a HEAD of ``key`` would answer, when its listing shows the very object this
        backend created; None: not shown, so it needs its HEAD."""
        made = self._made.get(key)
        if made is None or listed is None:
            return None
        if listed.size != made.size or not same_etag(listed.etag, made.etag):
            return None
        return ObjectInfo(key=key, size=listed.size, modified=listed.modified,
                          checksum=made.checksum)


def worth_listing(known: int, asked: int) -> bool:
    """Whether ``known`` remembered keys among ``asked`` are worth one listing."""
    return known >= LISTING_MIN and known * LISTED_PER_HEAD >= asked


def listing_prefix(keys: list[str]) -> str | None:
    """The directory every key is under (up to and including its last ``/``): what the proof
    lists. None when they share none: a listing of the whole destination is never worth it."""
    if not keys:
        return None
    first, last = min(keys), max(keys)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    cut = first[:n].rfind("/")
    return first[:cut + 1] if cut >= 0 else None
