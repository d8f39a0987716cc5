"""The in-memory fake: same semantics as the real destinations, plus recording and faults."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.daemon.backends.base import BackendError, ObjectInfo, open_backend
from ckptdrain.daemon.backends.memory import MemoryBackend, MemoryStore
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.config import DestinationConfig

DATA = os.urandom(3 * (1 << 20) + 7)


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    path = tmp_path / "staged.bin"
    path.write_bytes(DATA)
    handle = os.open(path, os.O_RDONLY)
    yield handle
    os.close(handle)


@pytest.fixture(autouse=True)
def _isolated_named_stores() -> Iterator[None]:
    MemoryBackend.forget()
    yield
    MemoryBackend.forget()


@pytest.mark.asyncio
async def test_put_file_stores_the_bytes_and_returns_its_checksum(fd: int) -> None:
    backend = MemoryBackend("gpu1")
    checksum = await backend.put_file("j/a", fd, len(DATA))
    assert checksum == of_bytes(DATA)
    assert backend.objects["j/a"] == DATA
    assert backend.calls == [("put_file", "j/a")]


@pytest.mark.asyncio
async def test_short_source_stores_nothing(fd: int) -> None:
    backend = MemoryBackend()
    with pytest.raises(BackendError, match="ended at byte") as info:
        await backend.put_file("j/a", fd, len(DATA) + 1)
    assert info.value.kind == "integrity"
    assert backend.objects == {}


@pytest.mark.asyncio
async def test_exclusive_put_bytes_and_reads() -> None:
    backend = MemoryBackend()
    assert await backend.put_bytes("j/M", b"one", exclusive=True)
    assert not await backend.put_bytes("j/M", b"two", exclusive=True)
    assert await backend.get_bytes("j/M") == b"one"
    assert await backend.put_bytes("j/M", b"three")
    assert await backend.get_bytes("j/M") == b"three"
    assert await backend.get_bytes("j/none") is None
    with pytest.raises(BackendError, match="limit"):
        await backend.get_bytes("j/M", max_bytes=2)


@pytest.mark.asyncio
async def test_list_read_delete() -> None:
    backend = MemoryBackend()
    for key in ("j/2", "j/1/x", "k/1", "j10"):
        await backend.put_bytes(key, key.encode())
    assert await backend.list("j/") == [ObjectInfo("j/1/x", 5), ObjectInfo("j/2", 3)]
    assert [i.key for i in await backend.list("")] == ["j/1/x", "j/2", "j10", "k/1"]
    await backend.put_bytes("big", b"abcdefghij")
    assert [c async for c in backend.read_chunks("big", chunk_bytes=4)] == [b"abcd", b"efgh", b"ij"]
    await backend.delete("big")
    await backend.delete("big")
    with pytest.raises(BackendError, match="does not exist"):
        async for _ in backend.read_chunks("big"):
            pass


@pytest.mark.asyncio
async def test_named_backends_share_a_store_per_uri() -> None:
    a = MemoryBackend.named("memory://bucket", "gpu1")
    b = MemoryBackend.named("memory://bucket", "gpu2")
    other = MemoryBackend.named("memory://other", "gpu1")
    await a.put_bytes("k", b"v")
    assert await b.get_bytes("k") == b"v"
    assert await other.get_bytes("k") is None
    # Each backend records its own calls; the store records everyone's, with the node.
    assert a.calls == [("put_bytes", "k")]
    assert b.calls == [("get_bytes", "k")]
    assert a.store.calls == [("gpu1", "put_bytes", "k"), ("gpu2", "get_bytes", "k")]


@pytest.mark.asyncio
async def test_open_backend_selects_the_named_memory_store() -> None:
    config = DestinationConfig(uri="memory://shared")
    a = open_backend(config, "gpu1")
    b = open_backend(config, "gpu2")
    assert isinstance(a, MemoryBackend) and isinstance(b, MemoryBackend)
    assert a.store is b.store
    assert (a.node_id, b.node_id) == ("gpu1", "gpu2")


@pytest.mark.asyncio
async def test_injected_faults_fire_the_given_number_of_times_on_matching_keys(fd: int) -> None:
    backend = MemoryBackend()
    backend.inject("put_file", BackendError("boom", transient=True), times=2, key_contains="rank3")
    await backend.put_file("j/rank1.pt", fd, 10)  # not matching: unaffected
    for _ in range(2):
        with pytest.raises(BackendError, match="boom"):
            await backend.put_file("j/rank3.pt", fd, 10)
    assert "j/rank3.pt" not in backend.objects
    await backend.put_file("j/rank3.pt", fd, 10)  # the fault is used up
    assert backend.objects["j/rank3.pt"] == DATA[:10]
    assert backend.count("put_file", "rank3") == 3


@pytest.mark.asyncio
async def test_faults_on_reads_and_exclusive_creates() -> None:
    backend = MemoryBackend()
    backend.inject("put_bytes", OSError("disk gone"))
    with pytest.raises(OSError, match="disk gone"):
        await backend.put_bytes("M", b"x", exclusive=True)
    assert await backend.put_bytes("M", b"x", exclusive=True)
    backend.inject("read_chunks", BackendError("reset", kind="io"))
    with pytest.raises(BackendError, match="reset"):
        async for _ in backend.read_chunks("M"):
            pass
    with pytest.raises(ValueError, match="unknown op"):
        backend.inject("upload", RuntimeError())


@pytest.mark.asyncio
async def test_pause_holds_put_file_until_resume(fd: int) -> None:
    backend = MemoryBackend()
    backend.pause()
    task = asyncio.create_task(backend.put_file("j/held", fd, 100))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()
    assert backend.calls == [("put_file", "j/held")]  # it began and is waiting at the gate
    assert "j/held" not in backend.objects
    backend.resume()
    await task
    assert backend.objects["j/held"] == DATA[:100]


@pytest.mark.asyncio
async def test_a_forgotten_pause_times_out_instead_of_hanging(fd: int) -> None:
    backend = MemoryBackend(gate_timeout_s=0.01)
    backend.pause()
    with pytest.raises(BackendError, match="resume") as info:
        await backend.put_file("j/held", fd, 100)
    assert info.value.kind == "timeout"


@pytest.mark.asyncio
async def test_bandwidth_throttle_keeps_a_put_in_flight_and_cancel_stores_nothing(fd: int) -> None:
    backend = MemoryBackend(bandwidth_bytes_per_s=1.0)
    task = asyncio.create_task(backend.put_file("j/slow", fd, 1000))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done()  # 1000 bytes at 1 B/s
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.objects == {}


@pytest.mark.asyncio
async def test_explicit_store_and_close() -> None:
    store = MemoryStore()
    backend = MemoryBackend("n", store=store)
    await backend.put_bytes("k", b"v")
    assert store.objects == {"k": b"v"}
    assert await backend.sweep_orphans(set(), 0) == 0
    await backend.prepare_prefix("j/1/")
    await backend.aclose()
    assert backend.closed
    assert [op for op, _ in backend.calls] == ["put_bytes", "sweep_orphans", "prepare_prefix"]
