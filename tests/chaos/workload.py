"""Training processes saving checkpoints while the daemon is being hurt.

A :class:`Plan` is drawn from a seed: generations of one job, several ranks each, each rank
handing off a few shards (``put`` of bytes or ``put_file`` of a file) with ``ack="local"``,
and now and then a rank that aborts instead of sealing. :meth:`Workload.run` plays it, one
thread per rank, and the :class:`Record` says what the daemon acknowledged. That is what the
invariants judge the destination by: only an acknowledgement is a promise.
"""

from __future__ import annotations

import functools
import hashlib
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from ckptdrain.client import Client, DaemonUnavailable, DrainError

KiB = 1 << 10
MiB = 1 << 20


@dataclass(frozen=True)
class ShardPlan:
    path: str
    size: int
    mode: str  # "put" (bytes over the socket) or "file" (put_file: the fd is passed)
    seed: int

    def data(self) -> bytes:
        return random.Random(self.seed).randbytes(self.size)

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data()).hexdigest()


@dataclass(frozen=True)
class RankPlan:
    rank: int
    shards: tuple[ShardPlan, ...]
    aborts: bool


@dataclass(frozen=True)
class GenPlan:
    step: int
    world_size: int
    ranks: tuple[RankPlan, ...]


@dataclass(frozen=True)
class Plan:
    job: str
    generations: tuple[GenPlan, ...]

    @property
    def total_shards(self) -> int:
        return sum(len(r.shards) for g in self.generations for r in g.ranks)

    @property
    def largest_shard(self) -> int:
        return max((s.size for g in self.generations for r in g.ranks for s in r.shards), default=0)

    def shard(self, step: int, path: str) -> ShardPlan | None:
        for g in self.generations:
            if g.step == step:
                for r in g.ranks:
                    for s in r.shards:
                        if s.path == path:
                            return s
        return None


def _size(rng: random.Random, big: bool) -> int:
    # Empty and one-byte shards are the edge cases; a few MiB makes drains take a while;
    # "big" (S3) crosses the multipart threshold so uploads are interrupted mid-way.
    kind = rng.random()
    if kind < 0.08:
        return 0
    if kind < 0.15:
        return 1
    if kind < 0.55:
        return rng.randint(2, 64 * KiB)
    if kind < 0.85 or not big:
        return rng.randint(64 * KiB, 2 * MiB)
    return rng.randint(9 * MiB, 20 * MiB)


def make_plan(rng: random.Random, job: str, *, big_shards: bool = False,
              max_generations: int = 5) -> Plan:
    gens = []
    step = rng.randint(1, 10**6)
    for i in range(rng.randint(2, max_generations)):
        world = rng.randint(1, 4)
        aborting = rng.randrange(world) if rng.random() < 0.25 else None
        ranks = []
        for r in range(world):
            shards = tuple(
                ShardPlan(path=f"r{r}/s{k}.bin", size=_size(rng, big_shards),
                          mode=rng.choice(("put", "file")), seed=rng.getrandbits(64))
                for k in range(rng.randint(1, 3))
            )
            ranks.append(RankPlan(rank=r, shards=shards, aborts=r == aborting))
        # Steps only rise, each one new: a plan must never save one step twice (it used to,
        # when first + i * gap repeated, and the checker then compared the wrong plan's bytes).
        gap = rng.randint(1, 100)
        step = step + gap if i else step
        gens.append(GenPlan(step=step, world_size=world, ranks=tuple(ranks)))
    return Plan(job=job, generations=tuple(gens))


class Expect(Enum):
    MUST_COMMIT = "must commit"  # every rank's seal was acknowledged
    MAY_COMMIT = "may commit"    # every rank sent its seal, some answers never came
    NEVER = "never commits"      # a rank never sealed (aborted, failed, never began)


@dataclass
class RankRecord:
    began: bool = False
    seal_sent: bool = False
    sealed: bool = False
    aborted: bool = False
    error: str = ""


@dataclass
class GenRecord:
    plan: GenPlan
    ranks: dict[int, RankRecord] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)  # shard paths the daemon acknowledged

    @property
    def expect(self) -> Expect:
        ranks = [self.ranks.get(r.rank, RankRecord()) for r in self.plan.ranks]
        if all(r.sealed for r in ranks):
            return Expect.MUST_COMMIT
        if all(r.seal_sent for r in ranks):
            return Expect.MAY_COMMIT
        return Expect.NEVER


class Record:
    """What happened, from the clients' side; updated from the rank threads."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.gens: dict[int, GenRecord] = {}
        self.acks = 0
        self.daemon_gone = threading.Event()
        self._lock = threading.Lock()

    def gen(self, plan: GenPlan) -> GenRecord:
        with self._lock:
            return self.gens.setdefault(plan.step, GenRecord(plan))

    def acked(self, rec: GenRecord, path: str) -> int:
        with self._lock:
            rec.acked.add(path)
            self.acks += 1
            return self.acks

    def summary(self) -> str:
        lines = []
        for step, g in sorted(self.gens.items()):
            ranks = ", ".join(
                f"r{r}:{'sealed' if st.sealed else 'seal?' if st.seal_sent else 'aborted' if st.aborted else 'open'}"
                + (f" ({st.error[:80]})" if st.error else "")
                for r, st in sorted(g.ranks.items()))
            lines.append(f"  step {step} w={g.plan.world_size} {g.expect.value}: {ranks}; "
                         f"acked {len(g.acked)}")
        return "\n".join(lines)


class Workload:
    """Plays a plan against a daemon's socket until it is done or the daemon is gone."""

    def __init__(self, plan: Plan, socket_path: Path, files_dir: Path, *,
                 on_ack: Callable[[int], None] | None = None, timeout_s: float = 30.0) -> None:
        self.plan = plan
        self.socket_path = socket_path
        self.files_dir = files_dir
        self.on_ack = on_ack or (lambda total: None)
        self.timeout_s = timeout_s
        self.record = Record(plan)

    def prepare(self) -> None:
        """Write the files put_file hands off (before the clock starts)."""
        self.files_dir.mkdir(parents=True, exist_ok=True)
        for g in self.plan.generations:
            for r in g.ranks:
                for s in r.shards:
                    if s.mode == "file":
                        self._file(g, s).write_bytes(s.data())

    def _file(self, g: GenPlan, s: ShardPlan) -> Path:
        return self.files_dir / f"{g.step}-{s.path.replace('/', '-')}"

    def run(self, stop: threading.Event | None = None) -> Record:
        for g in self.plan.generations:
            if self.record.daemon_gone.is_set() or (stop is not None and stop.is_set()):
                break
            threads = [threading.Thread(target=self._rank, args=(g, r), name=f"rank-{r.rank}")
                       for r in g.ranks]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return self.record

    def _rank(self, g: GenPlan, r: RankPlan) -> None:
        rec = self.record.gen(g)
        state = rec.ranks.setdefault(r.rank, RankRecord())
        client = Client(self.socket_path, timeout_s=self.timeout_s, connect_timeout_s=5)
        try:
            with client.generation(self.plan.job, g.step, rank=r.rank, world_size=g.world_size,
                                   ack="local") as gen:
                state.began = True
                for s in r.shards:
                    if s.mode == "file":
                        gen.put_file(s.path, self._file(g, s))
                    else:
                        gen.put(s.path, s.data())
                    self.on_ack(self.record.acked(rec, s.path))
                if r.aborts:
                    gen.abort("planned abort (chaos workload)")
                    state.aborted = True
                else:
                    state.seal_sent = True
                    gen.seal()
                    state.sealed = True
        except DaemonUnavailable as exc:
            state.error = f"{type(exc).__name__}: {exc}"
            self.record.daemon_gone.set()
        except DrainError as exc:
            # Backpressure, an injected I/O error refused the put, the generation failed...:
            # the rank gave up (the context manager aborted it), which the record shows.
            state.error = f"{type(exc).__name__}: {exc}"
        finally:
            client.close()
