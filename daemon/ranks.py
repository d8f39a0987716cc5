"""A rank's requests on its connection: ``begin`` (the generation it joins, checked against
what the rank says of it), its puts, ``seal`` and ``abort``; and the checks that a request
names the connection's own rank and that the rank is still open.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptdrain.client import wire
from ckptdrain.daemon import permissions
from ckptdrain.daemon.channel import is_memfd
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.records import SAVE_AGAIN
from ckptdrain.daemon.state import GenerationEvent, GenerationState, RankEvent, RankState

if TYPE_CHECKING:
    from ckptdrain.daemon.connection import ClientHandler
    from ckptdrain.daemon.ledger import GenerationRecord

ACK_STRENGTH = {"memory": 0, "local": 1}


def own_rank(h: ClientHandler, f: dict[str, Any]) -> tuple[GenerationRecord, int]:
    gen, rank = h.gen, h.rank
    if gen is None or rank is None:
        raise RequestError(wire.BAD_REQUEST, "send begin before handing off shards")
    if (f["job"], f["step"], f["rank"]) != (gen.job, gen.step, rank):
        raise RequestError(wire.BAD_REQUEST, f"this connection began job {gen.job!r} step "
                           f"{gen.step} rank {rank}, not job {f['job']!r} step {f['step']} "
                           f"rank {f['rank']}")
    if gen.terminal:
        raise RequestError(wire.GENERATION_FAILED, f"step {gen.step} of job {gen.job!r} is "
                           f"{gen.state}: {gen.error}")
    if gen.ranks.get(rank) is not RankState.OPEN:
        raise RequestError(wire.GENERATION_FAILED, f"rank {rank} is {gen.ranks.get(rank)}: "
                           f"{gen.error or 'no more shards accepted'}")
    return gen, rank


def still_open(gen: GenerationRecord, rank: int) -> None:
    if gen.terminal or gen.ranks.get(rank) is not RankState.OPEN:
        raise RequestError(wire.GENERATION_FAILED, f"step {gen.step} of job {gen.job!r} "
                           f"ended while this shard was handed off ({gen.state}: {gen.error})")


async def put(h: ClientHandler, kind: str, job: str, step: int, rank: int, path: str,
              size: int, deferred: bool) -> dict[str, Any]:
    fd = h.channel.take_frame_fd(kind) if wire.needs_fd(kind) else None
    try:
        gen, rank = own_rank(h, {"job": job, "step": step, "rank": rank})
        if kind == "put_memfd" and fd is not None and not is_memfd(fd):
            # Checked before any lock is taken on it: a lock on a file of a network
            # filesystem can wait on a server, and nothing here may wait on the loop.
            raise RequestError(wire.BAD_REQUEST, f"the fd passed with put_memfd for {path!r} "
                               "is not a memfd; pass a memfd_create() fd, or use put_fd")
    except BaseException:
        if fd is not None:
            h.d.dataplane.close_client_fd(fd, h.uid)
        raise
    # From here the hand-off owns the fd (closes it, or leaves it to a stuck thread).
    if kind == "put_memfd" and h.ack == "memory" and fd is not None:
        return await h.d.held.hold(h, gen, rank, path, size, fd, deferred)
    return await h.d.handoffs.stage(h, gen, rank, path, size, fd, deferred)


async def begin(h: ClientHandler, job: str, step: int, rank: int, world_size: int,
                ack: str | None, attempt: str) -> dict[str, Any]:
    if h.gen is not None:
        raise RequestError(wire.BAD_REQUEST, "this connection already began a rank; "
                           "use one connection per generation and rank")
    if rank >= world_size:
        raise RequestError(wire.BAD_REQUEST, f"rank {rank} is outside world_size {world_size}")
    max_world_size = h.d.config.limits.max_world_size
    if world_size > max_world_size:
        raise RequestError(wire.BAD_REQUEST, f"world_size {world_size} is over this daemon's "
                           f"limits.max_world_size ({max_world_size}); ask the operator to "
                           "raise it")
    await permissions.settle_owner(h, job, reading=False)
    permissions.check_job_owner(h, job)
    effective: str = h.d.config.ack
    if ack is not None and ACK_STRENGTH[ack] > ACK_STRENGTH[effective]:
        effective = ack
    gen = await h.d.generations.begin_generation(
        job, step, world_size, effective, h.uid, attempt,
        connected=h.channel.unless_hung_up)
    if gen.world_size != world_size:
        raise RequestError(wire.BAD_REQUEST, f"step {step} of job {job!r} began with world_size "
                           f"{gen.world_size}, not {world_size}; every rank of a step passes the "
                           "same world_size (a job restarted at another size saves a new step, "
                           "or this one under a new attempt)")
    if gen.state is GenerationState.COMMITTED:
        raise RequestError(wire.COMMITTED, f"step {step} of job {job!r} is committed; save a "
                           "new step")
    if gen.terminal:
        # Said once: a generation a restart ended carries it in its error already.
        then = "" if (gen.error or "").endswith(SAVE_AGAIN) else f"; {SAVE_AGAIN}"
        raise RequestError(wire.GENERATION_FAILED, f"step {step} of job {job!r} is "
                           f"{gen.state} for this attempt: {gen.error}{then}")
    if rank in gen.ranks:
        raise RequestError(wire.DUPLICATE, f"rank {rank} of step {step} of job {job!r} already "
                           f"began on this node ({gen.ranks[rank]})")
    if gen.state is GenerationState.RECORDED:
        await h.d.ledger.apply(gen, GenerationEvent.REOPENED)
    await h.d.ledger.open_rank(gen, rank)
    h.gen, h.rank, h.ack = gen, rank, effective
    # inline_bytes: this daemon takes a shard that small as one put_bytes frame.
    return {"job": job, "step": step, "rank": rank, "ack": effective, "node_id": h.d.node_id,
            "inline_bytes": wire.INLINE_MAX_BYTES}


async def seal(h: ClientHandler, owned: tuple[GenerationRecord, int]) -> dict[str, Any]:
    gen, rank = owned
    await h.d.ledger.apply((gen, rank), RankEvent.SEALED)
    shards = [s for s in gen.shards.values() if s.rank == rank]
    h.d.spawn_advance(gen)  # the commit outlives this request: the supervisor owns it
    return {"job": gen.job, "step": gen.step, "rank": rank, "shards": len(shards),
            "bytes": sum(s.size for s in shards)}


async def abort_rank(h: ClientHandler, gen: GenerationRecord, rank: int, reason: str) -> None:
    await h.d.generations.give_up(gen, f"rank {rank}: {reason}", ranks=(rank,))
