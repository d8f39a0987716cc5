"""The commit's proof of many S3 shards from one listing instead of a HEAD each.

Before it writes a manifest, the committer proves every shard the manifest will name: there,
with the size and checksum its part record gives. A HEAD per shard is a request per shard:
for 256 shards of 1 MiB, about a fifth of the CPU the whole drain spends. Most of those
objects this backend created itself, and each PutObject was answered with the object's
ETag. A listing answers the size and ETag of 1,000 keys a page. A listed object with the
size and ETag of the one this backend created is that object (a single PutObject's ETag is
the MD5 of its bytes, or an id the store gives each new object), so the checksum computed as
it was sent holds for it, as a HEAD would have said.

The listing only ever spares requests; it never decides against a shard. A key that is not
listed, or listed with another size or ETag, a shard another node drained, or one created
before this daemon started, is asked with a HEAD as before. So an object replaced by another
attempt, or a store whose listing lags or spells ETags its own way, costs a HEAD, never a
wrong answer.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from ckptdrain.daemon.backends.base import ObjectInfo
from ckptdrain.daemon.backends.s3parts import same_etag

# Objects remembered (the newest): about 200 bytes each, so at most ~13 MB. Generations
# committed long after their shards drained fall back to HEADs beyond this.
REMEMBERED = 65_536
# Fewer remembered keys than this in one proof: their HEADs cost less than a listing page.
LISTING_MIN = 8
# A listing that finds this many more keys than the proof asks about (other objects under
# the same prefix) is given up: HEADs then, not an unbounded walk.
LISTING_SLACK = 1_000


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

    def proved(self, key: str, listed: tuple[int, str] | None) -> ObjectInfo | None:
        """What a HEAD of ``key`` would answer, when its listing (size, ETag) shows the very
        object this backend created; None: not shown, so it needs its HEAD."""
        made = self._made.get(key)
        if made is None or listed is None:
            return None
        size, etag = listed
        if size != made.size or not same_etag(etag, made.etag):
            return None
        return ObjectInfo(key=key, size=size, checksum=made.checksum)


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
