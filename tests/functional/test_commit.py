"""The commit protocol, on a real directory (POSIX) and on the in-memory fake.

Each "node" is its own backend instance and Committer over one shared destination, as the
daemons of separate GPU nodes are over one Lustre tree or bucket.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from ckptdrain.client.keys import latest_key, manifest_key, part_key, shard_key
from ckptdrain.client.manifest import Manifest, PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.assembly import same_contents
from ckptdrain.daemon.backends.base import Backend, BackendError, ShardConflict
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.backends.posix import PosixBackend
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.commit import (
    CommitOutcome,
    Committer,
    ManifestDamaged,
    StepAbandoned,
    StepUnusable,
)
from ckptdrain.daemon.config import DestinationConfig
from ckptdrain.daemon.tombstone import tombstone_json

JOB = "llama"
STEP = 1200

NodeFactory = Callable[[str], Backend]


@pytest_asyncio.fixture(params=["posix", "memory"])
async def node_backend(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[NodeFactory]:
    """Makes one backend per node over a single shared destination."""
    config = DestinationConfig(uri=f"file://{tmp_path / 'dest'}")
    store = MemoryStore()
    opened: list[Backend] = []

    def make(node: str) -> Backend:
        backend: Backend
        if request.param == "posix":
            backend = PosixBackend(config, node)
        else:
            backend = MemoryBackend(node, store=store)
        opened.append(backend)
        return backend

    yield make
    for backend in opened:
        await backend.aclose()


async def drain(
    backend: Backend,
    tmp_path: Path,
    node: str,
    ranks: tuple[int, ...],
    *,
    world_size: int = 4,
    step: int = STEP,
    payload: bytes = b"",
    directory: str = "model",
) -> PartRecord:
    """Drain one shard per rank through ``backend`` as a node's daemon would, and return the
    node's part record."""
    entries = []
    for rank in ranks:
        data = payload or f"{node} rank {rank} step {step} ".encode() * (rank + 1)
        path = f"{directory}/rank{rank}.pt"
        staged = tmp_path / f"staged-{node}-{rank}-{step}"
        staged.write_bytes(data)
        fd = os.open(staged, os.O_RDONLY)
        try:
            checksum = await backend.put_file(shard_key(JOB, step, path), fd, len(data))
        finally:
            os.close(fd)
        assert checksum == of_bytes(data)
        entries.append(
            ShardEntry(path=path, size=len(data), checksum=checksum, rank=rank, node=node)
        )
    return PartRecord(
        job=JOB,
        step=step,
        world_size=world_size,
        node=node,
        ranks=ranks,
        shards=tuple(entries),
        clocks={"handoff": 10.0, "staged": 11.0, "drained": 12.0},
    )


async def drain_and_record(
    node_backend: NodeFactory,
    tmp_path: Path,
    node: str,
    ranks: tuple[int, ...],
    *,
    world_size: int = 4,
    payload: bytes = b"",
    directory: str = "model",
) -> Committer:
    backend = node_backend(node)
    await backend.prepare_prefix(f"{JOB}/{STEP:020d}/")
    committer = Committer(backend, node, clock=lambda: 99.0)
    record = await drain(
        backend, tmp_path, node, ranks, world_size=world_size, payload=payload,
        directory=directory,
    )
    await committer.record_part(record)
    return committer


@pytest.mark.asyncio
async def test_one_node_covering_every_rank_publishes(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    committer = await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1, 2, 3))
    assert await committer.committed(JOB, STEP) is None

    result = await committer.try_publish(JOB, STEP, 4)

    assert result.outcome is CommitOutcome.PUBLISHED
    assert result.committed
    assert result.manifest is not None
    assert [s.rank for s in result.manifest.shards] == [0, 1, 2, 3]
    assert result.manifest.clocks["committed"] == 99.0
    assert await committer.committed(JOB, STEP) == result.manifest
    assert await committer.backend.get_bytes(latest_key(JOB)) == b"1200\n"


@pytest.mark.asyncio
async def test_publish_race_between_nodes_has_exactly_one_winner(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    nodes = [
        await drain_and_record(node_backend, tmp_path, f"gpu{i}", (2 * i, 2 * i + 1), world_size=8)
        for i in range(4)
    ]
    # Every node tries several times at once, as retries and late part records would.
    results = await asyncio.gather(*(c.try_publish(JOB, STEP, 8) for c in nodes for _ in range(3)))

    outcomes = [r.outcome for r in results]
    assert outcomes.count(CommitOutcome.PUBLISHED) == 1
    assert outcomes.count(CommitOutcome.ACCEPTED) == len(results) - 1
    published = next(r.manifest for r in results if r.outcome is CommitOutcome.PUBLISHED)
    assert published is not None
    assert all(r.manifest is not None and same_contents(r.manifest, published) for r in results)
    stored = await nodes[0].committed(JOB, STEP)
    assert stored is not None and same_contents(stored, published)
    assert stored.nodes == ("gpu0", "gpu1", "gpu2", "gpu3")


@pytest.mark.asyncio
async def test_missing_rank_is_incomplete_and_writes_no_manifest(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    first = await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1))
    result = await first.try_publish(JOB, STEP, 4)
    assert result.outcome is CommitOutcome.INCOMPLETE
    assert result.missing_ranks == [2, 3]
    assert "ranks 2-3 of 4" in result.reason
    assert await first.backend.get_bytes(manifest_key(JOB, STEP)) is None
    assert await first.backend.get_bytes(latest_key(JOB)) is None

    # The last node's record completes the set; the first node's retry then accepts.
    last = await drain_and_record(node_backend, tmp_path, "gpu2", (2, 3))
    assert (await last.try_publish(JOB, STEP, 4)).outcome is CommitOutcome.PUBLISHED
    assert (await first.try_publish(JOB, STEP, 4)).outcome is CommitOutcome.ACCEPTED


@pytest.mark.asyncio
async def test_part_records_are_rewritten_cumulatively(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    backend = node_backend("gpu1")
    committer = Committer(backend, "gpu1")
    await committer.record_part(await drain(backend, tmp_path, "gpu1", (0,), world_size=2))
    assert (await committer.try_publish(JOB, STEP, 2)).missing_ranks == [1]
    await committer.record_part(await drain(backend, tmp_path, "gpu1", (0, 1), world_size=2))
    assert (await committer.try_publish(JOB, STEP, 2)).outcome is CommitOutcome.PUBLISHED
    parts = [i.key for i in await backend.list(f"{JOB}/{STEP:020d}/_parts/")]
    assert parts == [part_key(JOB, STEP, "gpu1")]


@pytest.mark.asyncio
async def test_an_existing_manifest_with_other_contents_is_a_conflict(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    committer = await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1, 2, 3))
    published = await committer.try_publish(JOB, STEP, 4)
    assert published.manifest is not None
    # A second run of the same job and step cannot drain other bytes under the same names
    # (shard writes are create-once) ...
    with pytest.raises(ShardConflict, match="is committed with different bytes"):
        await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1, 2, 3), payload=b"new")
    # ... and when its part record names other shards, the publish changes nothing.
    rerun = await drain_and_record(
        node_backend, tmp_path, "gpu1", (0, 1, 2, 3), payload=b"new", directory="rerun"
    )

    result = await rerun.try_publish(JOB, STEP, 4)

    assert result.outcome is CommitOutcome.CONFLICT
    assert "already exists and commits different shards" in result.reason
    assert result.manifest == published.manifest  # the committed one, untouched
    assert await rerun.committed(JOB, STEP) == published.manifest


@pytest.mark.asyncio
async def test_parts_disagreeing_on_world_size_are_a_conflict(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1), world_size=4)
    other = await drain_and_record(node_backend, tmp_path, "gpu2", (2, 3), world_size=8)
    result = await other.try_publish(JOB, STEP, 8)
    assert result.outcome is CommitOutcome.CONFLICT
    assert "node 'gpu1' drained this generation with world_size 4" in result.reason
    assert await other.committed(JOB, STEP) is None


@pytest.mark.asyncio
async def test_a_rank_claimed_by_two_nodes_is_a_conflict(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1))
    backend = node_backend("gpu2")
    committer = Committer(backend, "gpu2")
    record = await drain(backend, tmp_path, "gpu2", (1, 2, 3))
    # Keep shard names distinct so only the rank overlaps.
    record = PartRecord(
        job=record.job,
        step=record.step,
        world_size=4,
        node="gpu2",
        ranks=record.ranks,
        shards=tuple(
            ShardEntry(s.path.replace("model/", "other/"), s.size, s.checksum, s.rank, s.node)
            for s in record.shards
        ),
        clocks=record.clocks,
    )
    await committer.record_part(record)
    result = await committer.try_publish(JOB, STEP, 4)
    assert result.outcome is CommitOutcome.CONFLICT
    assert "rank 1 is claimed by nodes" in result.reason
    assert await committer.committed(JOB, STEP) is None


@pytest.mark.asyncio
async def test_an_unreadable_part_record_is_a_conflict_naming_it(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    committer = await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1, 2, 3))
    await committer.backend.put_bytes(part_key(JOB, STEP, "gpu9"), b"{not json")
    result = await committer.try_publish(JOB, STEP, 4)
    assert result.outcome is CommitOutcome.CONFLICT
    assert "_parts/gpu9.json is unreadable" in result.reason


@pytest.mark.asyncio
async def test_a_shard_missing_at_the_destination_blocks_the_commit(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    committer = await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1, 2, 3))
    await committer.backend.delete(shard_key(JOB, STEP, "model/rank2.pt"))
    result = await committer.try_publish(JOB, STEP, 4)
    assert result.outcome is CommitOutcome.INCOMPLETE
    assert result.missing_ranks == [2]
    assert "'model/rank2.pt'" in result.reason
    assert await committer.committed(JOB, STEP) is None


@pytest.mark.asyncio
async def test_latest_only_moves_forward(node_backend: NodeFactory, tmp_path: Path) -> None:
    backend = node_backend("gpu1")
    committer = Committer(backend, "gpu1")
    for step in (200, 100):
        await committer.record_part(
            await drain(backend, tmp_path, "gpu1", (0,), world_size=1, step=step)
        )
        assert (await committer.try_publish(JOB, step, 1)).outcome is CommitOutcome.PUBLISHED
    assert await backend.get_bytes(latest_key(JOB)) == b"200\n"


@pytest.mark.asyncio
async def test_a_retry_after_publish_is_accepted_and_repairs_latest(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    committer = await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1, 2, 3))
    assert (await committer.try_publish(JOB, STEP, 4)).outcome is CommitOutcome.PUBLISHED
    # As if the daemon died between the manifest and LATEST.
    await committer.backend.delete(latest_key(JOB))
    assert (await committer.try_publish(JOB, STEP, 4)).outcome is CommitOutcome.ACCEPTED
    assert await committer.backend.get_bytes(latest_key(JOB)) == b"1200\n"


@pytest.mark.asyncio
async def test_record_part_refuses_another_nodes_record(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    backend = node_backend("gpu1")
    record = await drain(backend, tmp_path, "gpu2", (0,), world_size=1)
    with pytest.raises(ValueError, match="names node 'gpu2'"):
        await Committer(backend, "gpu1").record_part(record)


@pytest.mark.asyncio
async def test_the_manifest_is_the_last_write_of_the_generation(tmp_path: Path) -> None:
    store = MemoryStore()
    nodes = {n: MemoryBackend(n, store=store) for n in ("gpu1", "gpu2")}
    committers = []
    for i, (node, backend) in enumerate(nodes.items()):
        committer = Committer(backend, node)
        await committer.record_part(await drain(backend, tmp_path, node, (2 * i, 2 * i + 1)))
        committers.append(committer)
    await asyncio.gather(*(c.try_publish(JOB, STEP, 4) for c in committers))

    prefix = f"{JOB}/{STEP:020d}/"
    writes = [
        key
        for _, op, key in store.calls
        if op in ("put_file", "put_bytes") and key.startswith(prefix)
    ]
    # The losing node's exclusive create is a refused write; nothing else follows the manifest.
    first_manifest = writes.index(manifest_key(JOB, STEP))
    assert set(writes[first_manifest:]) == {manifest_key(JOB, STEP)}
    assert writes[:first_manifest].count(manifest_key(JOB, STEP)) == 0


@pytest.mark.asyncio
async def test_a_destination_failure_propagates_for_the_caller_to_retry(tmp_path: Path) -> None:
    backend = MemoryBackend("gpu1")
    committer = Committer(backend, "gpu1")
    await committer.record_part(await drain(backend, tmp_path, "gpu1", (0,), world_size=1))
    backend.inject(
        "put_bytes", BackendError("503 slow down", transient=True), key_contains="MANIFEST"
    )
    with pytest.raises(BackendError, match="503"):
        await committer.try_publish(JOB, STEP, 1)
    assert await committer.committed(JOB, STEP) is None
    assert (await committer.try_publish(JOB, STEP, 1)).outcome is CommitOutcome.PUBLISHED


@pytest.mark.asyncio
async def test_is_committed_says_whether_a_begin_must_be_refused(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    committer = await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1, 2, 3))
    assert await committer.is_committed(JOB, STEP) is False
    assert (await committer.try_publish(JOB, STEP, 4)).outcome is CommitOutcome.PUBLISHED
    assert await committer.is_committed(JOB, STEP) is True
    assert await committer.is_committed(JOB, STEP + 1) is False


@pytest.mark.asyncio
async def test_is_committed_refuses_a_step_whose_manifest_is_damaged_or_abandoned(
    node_backend: NodeFactory,
) -> None:
    backend = node_backend("gpu1")
    committer = Committer(backend, "gpu1")
    await backend.put_bytes(manifest_key(JOB, STEP), b'{"truncated": ')
    with pytest.raises(StepUnusable, match=r"damaged MANIFEST\.json") as damaged:
        await committer.is_committed(JOB, STEP)
    assert isinstance(damaged.value, ManifestDamaged)
    assert "save a new step" in str(damaged.value)
    assert (damaged.value.job, damaged.value.step) == (JOB, STEP)

    # A manifest of another generation at this key is damage too (a copy gone wrong).
    entry = ShardEntry("a", 1, "sha256:" + "0" * 64, 0, "gpu1")
    misplaced = Manifest(JOB, STEP + 1, 1, (entry,), ("gpu1",),
                         {"handoff": 1.0, "staged": 2.0, "drained": 3.0, "committed": 4.0})
    await backend.put_bytes(manifest_key(JOB, STEP), misplaced.to_json())
    with pytest.raises(ManifestDamaged, match="describes 'llama' generation 1201"):
        await committer.is_committed(JOB, STEP)

    await backend.put_bytes(manifest_key(JOB, STEP), tombstone_json(JOB, STEP, "gpu9", 1.0))
    with pytest.raises(StepAbandoned, match="abandoned") as abandoned:
        await committer.is_committed(JOB, STEP)
    assert "save a new step" in str(abandoned.value)
    # committed() is for readers: an abandoned step is simply not committed.
    assert await committer.committed(JOB, STEP) is None


@pytest.mark.asyncio
async def test_large_part_records_are_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """100,000-shard generations are megabytes of part-record JSON: reading them (on every
    commit poll) must not stall the event loop that serves hand-offs."""
    import threading

    from ckptdrain.daemon import commitreads as commit_module

    backend = MemoryBackend("n0", store=MemoryStore())
    shards = []
    for i in range(8000):
        path = f"model/layer{i:05d}/weights-and-optimizer-state.pt"
        await backend.put_bytes(shard_key(JOB, STEP, path), b"x")
        shards.append(ShardEntry(path=path, size=1, checksum=of_bytes(b"x"),
                                 rank=0, node="n0"))
    part = PartRecord(job=JOB, step=STEP, world_size=1, node="n0", ranks=(0,), shards=tuple(shards),
                      clocks={"handoff": 1.0, "staged": 2.0, "drained": 3.0})
    assert len(part.to_json()) > 1 << 20
    committer = Committer(backend, "n0")
    await committer.record_part(part)
    seen: list[str] = []
    real = commit_module._decode_parts

    def spy(datas: list[bytes | None]) -> list[object]:
        seen.append(threading.current_thread().name)
        return real(datas)  # type: ignore[return-value]

    monkeypatch.setattr(commit_module, "_decode_parts", spy)
    result = await committer.try_publish(JOB, STEP, 1)
    assert result.outcome is CommitOutcome.PUBLISHED
    assert seen and threading.main_thread().name not in seen, seen
    await backend.aclose()


@pytest.mark.asyncio
async def test_a_latest_that_cannot_be_written_never_fails_a_commit_on_any_node(
    tmp_path: Path,
) -> None:
    """The publisher's LATEST write refused for good (a permission, a planted link): the
    publisher answered PUBLISHED, but every other node's try_publish raised the same refusal
    and ended the committed generation there as "commit failed". LATEST is a hint: both
    nodes now see the commit, and LATEST is left as it was."""
    store = MemoryStore()
    gpu1, gpu2 = MemoryBackend("gpu1", store=store), MemoryBackend("gpu2", store=store)
    committers = []
    for i, backend in enumerate((gpu1, gpu2)):
        committer = Committer(backend, backend.node_id)
        await committer.record_part(await drain(backend, tmp_path, backend.node_id,
                                                (2 * i, 2 * i + 1)))
        committers.append(committer)
    for backend in (gpu1, gpu2):
        backend.inject("put_bytes", BackendError("403 AccessDenied", kind="auth"), times=5,
                       key_contains="LATEST")

    first = await committers[0].try_publish(JOB, STEP, 4)
    second = await committers[1].try_publish(JOB, STEP, 4)

    assert (first.outcome, second.outcome) == (CommitOutcome.PUBLISHED, CommitOutcome.ACCEPTED)
    assert await gpu1.get_bytes(latest_key(JOB)) is None
    await gpu1.aclose()
    await gpu2.aclose()


@pytest.mark.asyncio
async def test_a_hostile_manifest_above_does_not_fail_a_commit(
    node_backend: NodeFactory, tmp_path: Path
) -> None:
    # Found attacking the read side: a MANIFEST.json of arrays nested 100,000 deep in a newer
    # generation made the newest-commit scan after the publish raise RecursionError; the
    # committed step was reported failed, and later served as the newest checkpoint.
    committer = await drain_and_record(node_backend, tmp_path, "gpu1", (0, 1, 2, 3))
    await committer.backend.put_bytes(manifest_key(JOB, STEP + 5), b"[" * 100_000 + b"]" * 100_000)
    assert (await committer.try_publish(JOB, STEP, 4)).outcome is CommitOutcome.PUBLISHED
    assert await committer.backend.get_bytes(latest_key(JOB)) == f"{STEP}\n".encode()


@pytest.mark.asyncio
async def test_nothing_after_the_manifest_fails_a_commit(tmp_path: Path) -> None:
    # The boundary past the commit point: an unexpected error raising LATEST is logged, and
    # the generation stays published.
    backend = MemoryBackend("gpu1")
    committer = Committer(backend, "gpu1")
    await committer.record_part(await drain(backend, tmp_path, "gpu1", (0,), world_size=1))
    backend.inject("get_bytes", RuntimeError("unexpected"), key_contains="LATEST")
    result = await committer.try_publish(JOB, STEP, 1)
    assert result.outcome is CommitOutcome.PUBLISHED
    assert await backend.get_bytes(manifest_key(JOB, STEP)) is not None


@pytest.mark.asyncio
async def test_a_file_and_a_directory_of_one_name_from_two_nodes_do_not_commit(
    tmp_path: Path,
) -> None:
    # Found attacking the read side: rank 0 on one node wrote "model/rank0.pt", rank 1 on
    # another "model/rank0.pt/rank1.pt". Each node refuses such a pair among its own shards
    # only, so the generation committed on S3 (keys, not directories) and no restore could
    # ever write it.
    store = MemoryStore()
    committers = []
    for node, rank, directory in (("gpu1", 0, "model"), ("gpu2", 1, "model/rank0.pt")):
        backend = MemoryBackend(node, store=store)
        committer = Committer(backend, node)
        await committer.record_part(await drain(backend, tmp_path, node, (rank,),
                                                world_size=2, directory=directory))
        committers.append(committer)
    result = await committers[1].try_publish(JOB, STEP, 2)
    assert result.outcome is CommitOutcome.CONFLICT
    assert "cannot both exist" in result.reason
    assert manifest_key(JOB, STEP) not in store.objects
