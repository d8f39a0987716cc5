"""The committed manifests this daemon has read back, each parsed once.

A reader that loads a checkpoint from the destination through the daemon asks for it shard by
shard, and each fetch needs the generation's manifest (the shard's size and checksum); a
``wait`` on a committed step needs it too. A 10,000-shard manifest is 1.4 MB to GET and 83 ms to
parse, so reading it once per shard cost a restore from the destination more than its shards.
A committed manifest never changes (it is created once and nothing overwrites it), so the
parsed manifest is kept, with an index of its shards by path, for the few generations read
most recently. Only a manifest that parsed is kept (an absent or damaged one is asked again
next time), and retention drops a generation's entry when it removes the generation.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ckptdrain.client.manifest import Manifest
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.locks import KeyedLocks

# Generations kept: a node loads one checkpoint at a time; a few cover a job restarting from
# the newest while an operator's `wait` looks at another. Their shards together are bounded
# too (an entry is a few hundred bytes), but the newest is kept whatever its size.
CACHED_GENERATIONS = 4
CACHED_SHARDS = 200_000


@dataclass(frozen=True)
class Committed:
    manifest: Manifest
    by_path: dict[str, ShardEntry]


class ManifestCache:
    def __init__(self, size: int = CACHED_GENERATIONS, shards: int = CACHED_SHARDS) -> None:
        self._size = size
        self._shards = shards
        self._kept: collections.OrderedDict[tuple[str, int], Committed] = (
            collections.OrderedDict())
        # One read at a time per generation: ranks asking at once wait for the first one's
        # read instead of each reading and parsing the same manifest.
        self._reading = KeyedLocks()
        self.reads = 0  # manifests read from the destination (counted for tests)

    async def get(self, job: str, step: int,
                  read: Callable[[], Awaitable[Manifest | None]]) -> Committed | None:
        """The committed manifest of ``job`` step ``step``: kept, or ``read()`` (None: not
        committed, and not kept)."""
        key = (job, step)
        async with self._reading.hold(key):
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found
            self.reads += 1
            manifest = await read()
            if manifest is None:
                return None
            found = Committed(manifest, {s.path: s for s in manifest.shards})
            self._kept[key] = found
            while len(self._kept) > 1 and (
                    len(self._kept) > self._size
                    or sum(len(c.by_path) for c in self._kept.values()) > self._shards):
                self._kept.popitem(last=False)
            return found

    def forget(self, job: str, steps: collections.abc.Iterable[int]) -> None:
        """``job``'s generations ``steps`` were removed from the destination."""
        for step in steps:
            self._kept.pop((job, step), None)
