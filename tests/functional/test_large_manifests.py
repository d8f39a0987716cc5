"""A large manifest is parsed off the event loop wherever the daemon reads one.

Parsing and validating a manifest costs about 8 us per shard (83 ms for 10,000 shards, 430 ms
for 50,000). Retention after every commit, a client's ``wait``, a local read and a drain that
finds its key taken all read the generation's manifest; on the loop, each would stall every
other client's hand-off for that long, and a client can ask for them as often as it likes.
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckptdrain.client.keys import manifest_key, part_key, shard_key
from ckptdrain.client.manifest import Manifest, PartRecord
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import catalog, partrecords
from ckptdrain.daemon.backends.collision import check_replaced
from ckptdrain.daemon.backends.memory import MemoryBackend
from ckptdrain.daemon.commit import Committer
from ckptdrain.daemon.latest import OFF_LOOP_BYTES
from ckptdrain.daemon.records import GenerationRecord, ShardRecord
from ckptdrain.daemon.retention import apply_retention
from ckptdrain.daemon.state import ShardState

JOB, STEP, SHARDS = "big", 7, 10_000
DAEMON = Path(__file__).resolve().parents[2] / "daemon"


def _entries() -> tuple[ShardEntry, ...]:
    return tuple(
        ShardEntry(path=f"model/rank-{i // 8:05d}/shard_{i:06d}.distcp", size=65536,
                   checksum=f"crc64nvme:{i:016x}", rank=i // 8, node="gpu1")
        for i in range(SHARDS))


def _manifest() -> Manifest:
    return Manifest(job=JOB, generation=STEP, world_size=SHARDS // 8, shards=_entries(),
                    nodes=("gpu1",), clocks={"handoff": 1.0, "staged": 2.0, "drained": 3.0,
                                             "committed": 4.0})


@pytest.fixture
def parsed_where(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The name of the thread each manifest parse ran in."""
    where: list[str] = []
    parse = Manifest.from_json.__func__  # type: ignore[attr-defined]

    def recording(cls: type[Manifest], data: bytes) -> Manifest:
        where.append(threading.current_thread().name)
        return parse(cls, data)  # type: ignore[no-any-return]

    monkeypatch.setattr(Manifest, "from_json", classmethod(recording))
    yield where


@pytest.mark.asyncio
async def test_every_daemon_read_of_a_large_manifest_parses_it_off_the_loop(
        parsed_where: list[str]) -> None:
    manifest = _manifest()
    data = manifest.to_json()
    assert len(data) > OFF_LOOP_BYTES
    backend = MemoryBackend("gpu1")
    await backend.put_bytes(manifest_key(JOB, STEP), data)
    loop_thread = threading.current_thread().name
    first = manifest.shards[0]

    assert await Committer(backend, "gpu1").committed(JOB, STEP) == manifest  # wait, reads
    assert await Committer(backend, "gpu1").is_committed(JOB, STEP)  # begin
    assert await catalog.read_manifest(backend, JOB, STEP) == manifest  # restart, restore
    report = await apply_retention(backend, JOB, keep_last=3, abandoned_grace_s=3600.0,
                                   dry_run=True)  # after every commit
    assert report.kept == [STEP]
    # A drain that replaced a leftover at a shard's key: does a manifest now list other bytes?
    await check_replaced(backend, shard_key(JOB, STEP, first.path), first.size, first.checksum)

    assert len(parsed_where) == 5
    assert loop_thread not in parsed_where, parsed_where


@pytest.mark.asyncio
async def test_a_large_part_record_is_encoded_off_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    where: list[str] = []
    encode = PartRecord.to_json

    def recording(self: PartRecord) -> bytes:
        where.append(threading.current_thread().name)
        return encode(self)

    monkeypatch.setattr(PartRecord, "to_json", recording)
    part = PartRecord(job=JOB, step=STEP, world_size=SHARDS // 8, node="gpu1",
                      ranks=tuple(range(SHARDS // 8)), shards=_entries(),
                      clocks={"handoff": 1.0, "staged": 2.0, "drained": 3.0})
    backend = MemoryBackend("gpu1")
    await Committer(backend, "gpu1").record_part(part)
    assert await backend.get_bytes(part_key(JOB, STEP, "gpu1")) is not None
    assert where and threading.current_thread().name not in where, where


@pytest.mark.asyncio
async def test_a_large_part_record_is_built_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each entry checks its names again as it is made: about 6 us a shard.
    where: list[str] = []

    class Recording(ShardEntry):
        def __post_init__(self) -> None:
            where.append(threading.current_thread().name)
            super().__post_init__()

    monkeypatch.setattr(partrecords, "ShardEntry", Recording)
    gen = GenerationRecord(job=JOB, step=STEP, world_size=SHARDS // 8, ack="local",
                           created_at=0.0)
    for e in _entries():
        gen.shards[e.path] = ShardRecord(
            id=len(gen.shards), job=JOB, step=STEP, rank=e.rank, path=e.path, size=e.size,
            staged_name=f"{len(gen.shards):032x}", state=ShardState.DRAINED, handed_at=1.0,
            staged_at=2.0, checksum=e.checksum, drained_at=3.0)
    part = await partrecords.part_record(SimpleNamespace(node_id="gpu1"),  # type: ignore[arg-type]
                                         SimpleNamespace(jobs={}),  # type: ignore[arg-type]
                                         gen, range(SHARDS // 8))
    assert len(part.shards) == SHARDS and part.shards[0].path == _entries()[0].path
    assert len(where) == SHARDS and threading.current_thread().name not in where


@pytest.mark.asyncio
async def test_a_committed_manifest_is_read_and_parsed_once_for_every_shard_fetched(
        parsed_where: list[str]) -> None:
    # A reader loading a checkpoint from the destination through the daemon fetches shard by
    # shard, and each fetch looked the shard up in a manifest read and parsed again.
    import asyncio

    manifest = _manifest()
    backend = MemoryBackend("gpu1")
    await backend.put_bytes(manifest_key(JOB, STEP), manifest.to_json())
    committer = Committer(backend, "gpu1")
    # Ranks asking at once, then one after another.
    await asyncio.gather(*(committer.committed(JOB, STEP) for _ in range(8)))
    for entry in manifest.shards[:50]:
        found = await committer.committed_shards(JOB, STEP)
        assert found is not None and found.by_path[entry.path] == entry
    assert len(parsed_where) == 1
    # Not committed: asked again each time, never kept.
    assert await committer.committed(JOB, STEP + 1) is None
    assert await committer.committed(JOB, STEP + 1) is None
    assert committer.manifests.reads == 3
    # Removed by retention: read again if asked.
    committer.manifests.forget(JOB, [STEP])
    assert await committer.committed(JOB, STEP) == manifest
    assert len(parsed_where) == 2


def _direct_parses(path: Path) -> Iterator[tuple[str, int]]:
    """(function, line) of each ``Manifest.from_json``/``PartRecord.from_json`` call."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_json"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("Manifest", "PartRecord")):
                yield func.name, node.lineno


def test_the_daemon_parses_manifests_and_part_records_only_through_the_off_loop_helpers() -> None:
    # latest.parse_manifest and latest.parse_part run large ones in a thread; commitreads'
    # _decode_parts is itself run through off_loop_if_large.
    allowed = {("latest.py", "parse_manifest"), ("latest.py", "parse_part"),
               ("commitreads.py", "_decode_parts")}
    found = [(path.relative_to(DAEMON).as_posix(), func, line)
             for path in sorted(DAEMON.rglob("*.py"))
             for func, line in _direct_parses(path)
             if (path.name, func) not in allowed]
    assert not found, (f"parse manifests with latest.parse_manifest / parse_part, which keep a "
                       f"large one off the event loop: {found}")
