"""Format 1 (sha256) generations on S3 beside format 2: verify, verify --read and restore
check each shard by the algorithm its checksum names, against a real SeaweedFS."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client.keys import manifest_key, shard_key
from ckptdrain.client.manifest import Manifest
from ckptdrain.client.shardentries import ShardEntry
from ckptdrain.daemon import catalog
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.restore import restore
from tests.integration.seaweedfs import SeaweedFS
from tests.integration.test_s3_backend import dest_config

JOB = "llama"
MiB = 1 << 20
CLOCKS = {"handoff": 1.0, "staged": 2.0, "drained": 3.0, "committed": 4.0}
pytestmark = [
    pytest.mark.s3, pytest.mark.asyncio,
    # A 9 MiB object put from bytes in this process (as test_s3_backend).
    pytest.mark.filterwarnings(
        "ignore:Sending a large body directly with raw bytes:ResourceWarning"),
]


async def committed(backend: Any, step: int, files: dict[str, bytes], version: int) -> None:
    entries = []
    for path, data in files.items():
        await backend.put_bytes(shard_key(JOB, step, path), data)
        checksum = (f"sha256:{hashlib.sha256(data).hexdigest()}" if version == 1
                    else of_bytes(data))
        entries.append(ShardEntry(path, len(data), checksum, 0, "gpu1"))
    manifest = Manifest(JOB, step, 1, tuple(entries), ("gpu1",), CLOCKS, format_version=version)
    await backend.put_bytes(manifest_key(JOB, step), manifest.to_json())


async def test_format_1_and_2_on_s3_verify_and_restore(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, tmp_path: Path) -> None:
    backend = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
    rng = random.Random(7)
    v1 = {"a.bin": rng.randbytes(3000), "big.bin": rng.randbytes(9 * MiB + 3)}
    v2 = {"a.bin": rng.randbytes(4000)}
    await committed(backend, 1, v1, version=1)
    await committed(backend, 2, v2, version=2)
    assert await catalog.latest(backend, JOB) == 2
    assert [g.step for g in await catalog.list_generations(backend, JOB)] == [2, 1]
    for step in (1, 2):
        for read in (False, True):
            report = await catalog.verify(backend, JOB, step, read=read)
            assert report.ok, (step, read, report.bad)
    for step, files in ((1, v1), (2, v2)):
        to = tmp_path / f"r{step}"
        await restore(backend, JOB, step, to)
        assert {p: (to / p).read_bytes() for p in files} == files
    # A format 1 shard with other bytes: found by sha256, with or without --read.
    await backend.put_bytes(shard_key(JOB, 1, "a.bin"), rng.randbytes(3000), exclusive=False)
    for read in (False, True):
        report = await catalog.verify(backend, JOB, 1, read=read)
        assert [p for p, _ in report.bad] == ["a.bin"], (read, report.bad)
