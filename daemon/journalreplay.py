"""The ledger rebuilt from the journal at start-up: every row read back is checked first (the
types this version writes, valid names, a known ack), so a row this version cannot read is a
:class:`JournalError` that says so, never a traceback or a record nobody can move.
"""

from __future__ import annotations

from typing import Any

from ckptdrain.client import names, wire
from ckptdrain.client.errors import DrainError
from ckptdrain.client.shardentries import parents
from ckptdrain.daemon.journal import Journal
from ckptdrain.daemon.journalfaults import JournalError
from ckptdrain.daemon.records import GenerationRecord, GenKey, ShardRecord, cap_error
from ckptdrain.daemon.state import GenerationState, RankState, ShardState


class JournalReplay:
    """The ledger's replay of the journal (its base; :class:`~ckptdrain.daemon.ledger.Ledger`
    sets these)."""

    journal: Journal
    generations: dict[GenKey, GenerationRecord]
    jobs: dict[str, int]
    shard_index: dict[int, tuple[GenerationRecord, ShardRecord]]
    _next_shard_id: int

    async def load(self) -> dict[int, str]:
        """Rebuild from the journal; returns the upload ids it knows, by shard id. A row this
        version cannot read (a state it does not know: a newer version's journal; a wrong
        type: an edit) is a JournalError that says so, not a traceback (found attacking)."""
        try:
            return await self._load()
        except (ValueError, TypeError, KeyError, DrainError) as exc:
            raise JournalError(
                f"the journal {self.journal.path} holds a row this version cannot read ({exc}): "
                "it was written by a newer ckptdrain, or edited; start the version that wrote "
                "it, or move the journal aside to start empty (its staged shards are then set "
                "aside too)"
            ) from None

    async def _load(self) -> dict[int, str]:
        snap = await self.journal.load()
        for job, uid in snap.jobs.items():
            _typed("jobs", {"job": job, "uid": uid}, job=str, uid=int)
            names.validate_job(job)
        for g in snap.generations:
            _typed("generations", g, job=str, step=int, world_size=int, state=str, ack=str,
                   created_at=_NUMBER, handoff_at=_TIME, staged_at=_TIME, drained_at=_TIME,
                   committed_at=_TIME, error=str, attempt=str)
            names.validate_job(g["job"])
            if g["ack"] not in wire.ACK_MODES:
                raise ValueError(f"generations.ack = {g['ack']!r} is not one of {wire.ACK_MODES}")
        for r in snap.ranks:
            _typed("ranks", r, job=str, step=int, rank=int, state=str)
        for sh in snap.shards:
            _typed("shards", sh, id=int, job=str, step=int, rank=int, path=str, size=int,
                   staged_name=str, state=str, handed_at=_NUMBER, staged_at=_NUMBER,
                   checksum=str, drained_at=_TIME, error=str, deferred=int)
            names.validate_shard_path(sh["path"])
        self.jobs = dict(snap.jobs)
        for g in snap.generations:
            rec = GenerationRecord(
                job=g["job"], step=g["step"], world_size=g["world_size"], ack=g["ack"],
                created_at=g["created_at"], state=GenerationState(g["state"]),
                handoff_at=g["handoff_at"], staged_at=g["staged_at"],
                drained_at=g["drained_at"], committed_at=g["committed_at"],
                error=cap_error(g["error"]), attempt=g["attempt"],
            )
            self.generations[rec.key] = rec
        for r in snap.ranks:
            gen = self.generations.get((r["job"], r["step"]))
            if gen is not None:
                gen.ranks[r["rank"]] = RankState(r["state"])
        for s in snap.shards:
            gen = self.generations.get((s["job"], s["step"]))
            if gen is None:
                continue
            gen.shards[s["path"]] = ShardRecord(
                id=s["id"], job=s["job"], step=s["step"], rank=s["rank"], path=s["path"],
                size=s["size"], staged_name=s["staged_name"], state=ShardState(s["state"]),
                handed_at=s["handed_at"], staged_at=s["staged_at"], checksum=s["checksum"],
                drained_at=s["drained_at"], error=cap_error(s["error"]),
                deferred=bool(s["deferred"]),
            )
            gen.count(gen.shards[s["path"]], +1)
            self.shard_index[s["id"]] = (gen, gen.shards[s["path"]])
            gen.dirs.update(parents(s["path"]))
            self._next_shard_id = max(self._next_shard_id, s["id"] + 1)
        return dict(snap.uploads)


_NUMBER = (int, float)
_TIME = (int, float, type(None))


def _typed(table: str, row: Any, **columns: type | tuple[type, ...]) -> None:
    """Each of ``columns`` of a journal ``row`` holds the type this version writes there
    (SQLite keeps whatever an edit put in): TypeError naming the first that does not."""
    for name, kinds in columns.items():
        value = row[name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise TypeError(f"{table}.{name} = {value!r:.60} is not what this version writes")
