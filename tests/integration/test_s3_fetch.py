"""A daemon reads S3 shards for its clients (``fetch`` from the destination) on a loop of its
own, not on the event loop that serves every client.

Found by the `restore` benchmark's fetch row: 8 readers fetching a generation from S3
through the daemon cost its event loop 0.43 CPU s per GB (aiohttp parsing every answer
there), against 0.10 for the hand-off rows. The daemon runs in this test's process, on this
test's event loop (the main thread), so the test can tell which thread each read ran on:
reads are recorded by wrapping the S3 backend's ``copy_into``."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Client, DaemonUnavailable, DestinationError
from ckptdrain.client.keys import shard_key
from ckptdrain.daemon import checksums
from ckptdrain.daemon.backends.s3 import S3Backend
from ckptdrain.daemon.backends.s3reads import S3Reads
from ckptdrain.daemon.config import Config, DestinationConfig, MetricsConfig
from ckptdrain.daemon.server import Daemon
from tests.conftest import wait_for
from tests.integration.faultproxy import FaultProxy
from tests.integration.seaweedfs import SeaweedFS

pytestmark = pytest.mark.s3

JOB = "fetched"
MiB = 1 << 20


def daemon_config(tmp_path: Path, socket: Path, bucket: str, endpoint: str,
                  **destination: Any) -> Config:
    """A daemon of node-a on ``bucket`` at ``endpoint``, without a metrics listener."""
    return Config(node_id="node-a", socket=socket, staging_dir=tmp_path / "staging",
                  destination=DestinationConfig(uri=f"s3://{bucket}/ckpt", endpoint_url=endpoint,
                                                **destination),
                  metrics=MetricsConfig(listen=""))


def client_side(socket: Path, out: Path, shards: dict[str, bytes]) -> dict[str, Any]:
    """Save ``shards`` as step 1, wait for its commit, fetch each back from the destination.
    Blocking: runs in a thread while the daemon serves on the test's loop."""
    wait_for(lambda: _answers(socket), timeout_s=60)
    with Client(socket, timeout_s=120) as c:
        with c.generation(JOB, 1, rank=0, world_size=1) as g:
            for path, data in shards.items():
                g.put(path, data)
        c.wait(JOB, 1, timeout_s=120)
        fetched = {}
        for path in shards:
            fd = os.open(out / path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                fetched[path] = c.fetch_from_destination(JOB, 1, path, fd)
            finally:
                os.close(fd)
        return fetched


def _answers(socket: Path) -> bool:
    try:
        with Client(socket, timeout_s=5) as c:
            c.status()
        return True
    except (DaemonUnavailable, OSError):
        return False


async def serving(daemon: Daemon, blocking: Callable[[], Any]) -> Any:
    """Run ``blocking`` in a thread while ``daemon`` serves on this loop; stop it after."""
    served = asyncio.create_task(daemon.run())
    try:
        return await asyncio.to_thread(blocking)
    finally:
        daemon.request_stop()
        async with asyncio.timeout(60):
            await served


@pytest.mark.asyncio
async def test_a_fetch_from_s3_reads_on_the_fetch_thread_not_the_daemons_loop(
        seaweedfs: SeaweedFS, s3_bucket: str, tmp_path: Path, short_tmp: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    read_on: list[tuple[str, int | None]] = []
    original = S3Reads.copy_into

    async def recording(self: S3Reads, key: str, out_fd: int, **kw: Any) -> tuple[int, str]:
        read_on.append((threading.current_thread().name, kw.get("expected_size")))
        return await original(self, key, out_fd, **kw)

    monkeypatch.setattr(S3Reads, "copy_into", recording)
    config = daemon_config(tmp_path, short_tmp / "f.sock", s3_bucket, seaweedfs.endpoint_url)
    destination = config.destination
    rng = random.Random(5)
    # One shard read as parallel ranges (above the part size), one as a stream.
    shards = {"big.bin": rng.randbytes(int(destination.part_size_bytes) * 2 + 123),
              "small.bin": rng.randbytes(MiB)}
    out = tmp_path / "out"
    out.mkdir()
    fetched = await serving(Daemon(config), lambda: client_side(config.socket, out, shards))

    for path, data in shards.items():
        assert (out / path).read_bytes() == data
        assert fetched[path]["checksum"] == checksums.of_bytes(data)
    assert threading.current_thread() is threading.main_thread()  # the daemon's loop ran here
    # Each read knew the manifest's size (a shard of one part is read without a HEAD).
    assert read_on == [("ckptdrain-fetch", len(data)) for data in shards.values()]


@pytest.mark.asyncio
async def test_a_shard_gone_from_s3_gets_a_destination_error_and_the_daemon_serves_on(
        seaweedfs: SeaweedFS, s3_bucket: str, tmp_path: Path, short_tmp: Path) -> None:
    """A failure on the fetch loop comes back as the typed error it was, for that request
    alone: the next fetch, and the daemon, go on."""
    config = daemon_config(tmp_path, short_tmp / "g.sock", s3_bucket, seaweedfs.endpoint_url)
    destination = config.destination
    shards = {"kept.bin": b"k" * MiB, "gone.bin": b"g" * MiB}
    out = tmp_path / "out"
    out.mkdir()
    remover = S3Backend(destination, "test")

    def steps() -> tuple[str, dict[str, Any], dict[str, Any]]:
        client_side(config.socket, out, shards)
        asyncio.run(_delete(remover, shard_key(JOB, 1, "gone.bin")))
        with Client(config.socket, timeout_s=60) as c:
            fd = os.open(out / "again", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with pytest.raises(DestinationError) as raised:
                    c.fetch_from_destination(JOB, 1, "gone.bin", fd)
                kept = c.fetch_from_destination(JOB, 1, "kept.bin", fd)
            finally:
                os.close(fd)
            return str(raised.value), kept, c.status()

    message, kept, status = await serving(Daemon(config), steps)
    assert "does not exist" in message and "gone.bin" in message
    assert kept["checksum"] == checksums.of_bytes(shards["kept.bin"])
    assert (out / "again").read_bytes() == shards["kept.bin"]
    assert status["node_id"] == "node-a"


async def _delete(backend: S3Backend, key: str) -> None:
    try:
        await backend.delete(key)
    finally:
        await backend.aclose()


# A reader in a process of its own, killed while its fetch is under way.
_READER = """
import os, sys
from ckptdrain.client import Client
fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
with Client(sys.argv[1], timeout_s=600) as c:
    c.fetch_from_destination("fetched", 1, "stalled.bin", fd)
"""


@pytest.mark.asyncio
async def test_a_reader_killed_mid_fetch_stops_its_read_from_the_destination(
        seaweedfs: SeaweedFS, s3_bucket: str, tmp_path: Path, short_tmp: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Found attacking the fetch loop: a reader killed mid-fetch left its fetch running till
    the object had all been read into its file (or the read timed out), and only the reply
    failed. The GET here is held by a proxy for 120 s; the read must end at the hang-up, and
    the connection with it, no reply attempted (a review found the hang-up answered as a
    `bad_request` about the client's file)."""
    caplog.set_level(logging.INFO, logger="ckptdrain")
    ended: list[str] = []
    original = S3Reads.copy_into

    async def recording(self: S3Reads, key: str, out_fd: int, **kw: Any) -> tuple[int, str]:
        try:
            return await original(self, key, out_fd, **kw)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    monkeypatch.setattr(S3Reads, "copy_into", recording)
    async with FaultProxy("127.0.0.1", seaweedfs.ports["s3"], stall_s=120.0) as proxy:
        config = daemon_config(tmp_path, short_tmp / "h.sock", s3_bucket,
                               proxy.endpoint_url, read_timeout_s=300)
        out = tmp_path / "out"
        out.mkdir()

        def steps() -> dict[str, Any]:
            client_side(config.socket, out, {"stalled.bin": b"s" * MiB})
            proxy.inject("stall", match=lambda r: r.method == "GET" and "stalled.bin" in r.target)
            reader = subprocess.Popen([sys.executable, "-c", _READER, str(config.socket),
                                       str(out / "again")])
            try:
                wait_for(lambda: proxy.faults("stall"), timeout_s=60)  # its GET is held
            finally:
                reader.send_signal(signal.SIGKILL)
                reader.wait(timeout=30)
            wait_for(lambda: ended, timeout_s=30)  # long before the 120 s stall ends
            with Client(config.socket, timeout_s=30) as c:
                return c.status()

        status = await serving(Daemon(config), steps)
    assert ended == ["cancelled"]
    assert status["node_id"] == "node-a"
    events = [r.getMessage() for r in caplog.records]
    assert any("event=fetch_abandoned" in m and "stalled.bin" in m for m in events)
    dropped = [m for m in events if "event=client_dropped" in m]
    assert dropped and all("hung up during its fetch" in m for m in dropped), dropped
