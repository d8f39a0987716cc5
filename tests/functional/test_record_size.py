"""No manifest or part record is written larger than a reader takes (MAX_RECORD_BYTES).

Found attacking from the training side: a reader refuses a manifest over 64 MiB as damaged or
planted, yet the commit wrote one of any size. Two nodes of 31,000 shards each published a
68 MB manifest: one node's ``wait`` said committed, the other's failed, and ``latest``, ``ls``
and ``restore`` ignored the generation. One node of 62,000 shards had every hand-off
acknowledged, then failed at its part record. A hand-off that would take this node's record
past the limit is refused now, and the commit never writes a record no reader takes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ckptdrain.client import wire
from ckptdrain.client.keys import manifest_key, part_key
from ckptdrain.client.manifest import (
    MAX_RECORD_BYTES,
    PartRecord,
    RecordTooLarge,
    _dumps,
    entry_bytes,
)
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.errors import RequestError
from ckptdrain.daemon.handoff import RECORD_HEADER_BYTES, Handoffs
from ckptdrain.daemon.records import GenerationRecord, ShardRecord
from ckptdrain.daemon.state import ShardState

JOB, STEP = "many", 3
# A path of 1,000 bytes (the longest component is 255): about 1,100 bytes a line.
LONG = "/".join(["d" * 249] * 4)[:990]


def _part(node: str, rank: int, shards: int) -> PartRecord:
    entries = tuple(ShardEntry(path=f"{LONG}/{node}-{i:06d}", size=0,
                               checksum="crc64nvme:0000000000000000", rank=rank, node=node)
                    for i in range(shards))
    return PartRecord(job=JOB, step=STEP, world_size=2, node=node, ranks=(rank,),
                      shards=entries, clocks={"handoff": 1.0, "staged": 2.0, "drained": 3.0})


@pytest.mark.asyncio
async def test_a_manifest_no_reader_takes_is_never_published() -> None:
    store = MemoryStore()
    a, b = MemoryBackend("a", store=store), MemoryBackend("b", store=store)
    # Each node's record is under the limit; together they list more than a manifest holds.
    for backend, node, rank in ((a, "a", 0), (b, "b", 1)):
        part = _part(node, rank, 31_000)
        assert len(part.to_json()) < MAX_RECORD_BYTES
        await Committer(backend, node).record_part(part)
    with pytest.raises(RecordTooLarge, match=r"manifest would be .* a reader takes; this "
                                             r"generation cannot commit: save fewer, larger"):
        await Committer(a, "a").try_publish(JOB, STEP, 2)
    assert await a.get_bytes(manifest_key(JOB, STEP)) is None
    assert await Committer(b, "b").committed(JOB, STEP) is None


@pytest.mark.asyncio
async def test_a_part_record_no_reader_takes_is_never_written() -> None:
    backend = MemoryBackend("a")
    with pytest.raises(RecordTooLarge, match="part record of node 'a' would be"):
        await Committer(backend, "a").record_part(_part("a", 0, 62_000))
    assert await backend.get_bytes(part_key(JOB, STEP, "a")) is None


def test_a_line_weighs_what_entry_bytes_says() -> None:
    for path, size, rank, node in (("a", 0, 0, "n"), ("model/rank3.pt", 123456789, 37, "gpu017"),
                                   (LONG, 2**63 - 1, 999_999, "n" * 128)):
        line = f"  {_dumps(ShardEntry(path, size, 'crc64nvme:' + '0' * 16, rank, node).to_dict())},\n"
        assert entry_bytes(path, size, rank, node) == len(line)


def _generation() -> GenerationRecord:
    return GenerationRecord(job=JOB, step=STEP, world_size=1, ack="local", created_at=1.0)


def test_the_generation_tallies_its_lines_as_shards_come_and_go() -> None:
    gen = _generation()
    shard = ShardRecord(id=1, job=JOB, step=STEP, rank=0, path="w/a.pt", size=4096,
                        staged_name="x", state=ShardState.STAGED, handed_at=1.0, staged_at=1.0)
    gen.count(shard, +1)
    assert gen.line_bytes == entry_bytes("w/a.pt", 4096, 0, "")
    gen.count(shard, -1)
    assert gen.line_bytes == 0


def test_a_hand_off_that_would_take_the_record_past_a_reader_is_refused() -> None:
    config = SimpleNamespace(node_id="gpu017", limits=SimpleNamespace(max_shard_bytes=1 << 40))
    handoffs = Handoffs(SimpleNamespace(config=config))  # type: ignore[arg-type]
    gen = _generation()
    room = MAX_RECORD_BYTES - RECORD_HEADER_BYTES
    gen.line_bytes = room - entry_bytes("b.pt", 10, 0, "gpu017")
    handoffs.check_new_shard(gen, "a.pt", 10, 0)  # fits exactly
    gen.line_bytes += 1
    with pytest.raises(RequestError) as refused:
        handoffs.check_new_shard(gen, "b.pt", 10, 0)
    assert refused.value.code == wire.BAD_REQUEST
    assert "lists too many shards for its manifest" in refused.value.message
    assert "save fewer, larger files" in refused.value.message
