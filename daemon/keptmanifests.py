"""The large manifests retention found valid, remembered so that its next run need not read
them again.

Retention runs after every commit and validates the newest ``keep_last`` manifests: it reads
each one and parses it. A 10,000-shard manifest is 1.0-1.4 MB to read and 65-83 ms to parse
(the lengths of its paths decide), so with ``keep_last = 3`` each commit read and parsed two
manifests it had already found valid. A committed manifest is created once and never
rewritten (only removed), so a later run that finds it by a stat (one HEAD, or one ``fstat``:
no checksum asked, so never a hash nor an xattr write) with the same size and write time
counts it valid without reading it. A stat that finds it gone, of another size or written at
another time, reads it again; so does a stat that fails, and any destination that reports no
write times.
"""

from __future__ import annotations

import collections
from collections.abc import Collection

# Only manifests at least this large are remembered (about 500 shards; 5 ms to parse): a
# smaller one costs about as much to read as the stat that would stand for it.
REMEMBER_BYTES = 64 << 10
# Jobs remembered (each with at most keep_last manifests), the least recently run ones
# forgotten first.
JOBS = 256


class KeptManifests:
    def __init__(self, *, min_bytes: int = REMEMBER_BYTES, jobs: int = JOBS) -> None:
        self.min_bytes = min_bytes
        self._jobs = jobs
        self._by_job: collections.OrderedDict[str, dict[int, tuple[int, float]]] = (
            collections.OrderedDict())

    def known(self, job: str, step: int) -> tuple[int, float] | None:
        """(size, write time) of the valid manifest of ``job`` step ``step``, if remembered."""
        return self._by_job.get(job, {}).get(step)

    def remember(self, job: str, step: int, size: int, modified: float) -> None:
        self._by_job.setdefault(job, {})[step] = (size, modified)
        self._by_job.move_to_end(job)
        while len(self._by_job) > self._jobs:
            self._by_job.popitem(last=False)

    def keep_only(self, job: str, steps: Collection[int]) -> None:
        """After a run: ``job``'s valid kept steps; the others are removed or no longer kept."""
        known = self._by_job.get(job)
        if known is None:
            return
        for step in [s for s in known if s not in steps]:
            del known[step]
        if not known:
            del self._by_job[job]
