"""Fixtures for tests against real servers.

``seaweedfs`` (session, in tests/conftest.py so the chaos suites share the same server).
``s3_bucket`` (function): a fresh, uniquely named bucket on it, deleted afterwards (each bucket
holds its own volumes, and the server has room for only a few at once).
``staged`` (a staged shard: a file of seeded random bytes, open), ``backends`` (S3Backends,
closed after the test) and ``proxy`` (a FaultProxy in front of the server), for the tests of
the S3 backend and its engines.

If `weed` is missing the tests fail rather than skip: the S3 tests run in CI.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ckptdrain.daemon.backends.s3 import S3Backend
from ckptdrain.daemon.checksums import of_bytes
from ckptdrain.daemon.config import DestinationConfig
from tests.integration.faultproxy import FaultProxy
from tests.integration.seaweedfs import SeaweedFS

NODE = "node-a"


@pytest.fixture
def s3_bucket(seaweedfs: SeaweedFS) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:16]}"
    seaweedfs.create_bucket(name)
    yield name
    seaweedfs.delete_bucket(name)


class Staged:
    """A staged shard: a file of seeded random bytes, open for reading."""

    def __init__(self, directory: Path, size: int, seed: int = 0) -> None:
        self.data = random.Random(seed).randbytes(size)
        self.path = directory / f"shard-{seed}-{size}"
        self.path.write_bytes(self.data)
        self.size = size
        self.fd = os.open(self.path, os.O_RDONLY)
        self.checksum = of_bytes(self.data)

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def staged(tmp_path: Path) -> Iterator[Any]:
    made: list[Staged] = []

    def make(size: int, seed: int = 0) -> Staged:
        s = Staged(tmp_path, size, seed)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest_asyncio.fixture
async def backends() -> AsyncIterator[Any]:
    """Factory for S3Backends, closed after the test."""
    made: list[S3Backend] = []

    def make(config: DestinationConfig, node_id: str = NODE, **options: Any) -> S3Backend:
        b = S3Backend(config, node_id, **options)
        made.append(b)
        return b

    yield make
    for b in made:
        await b.aclose()


@pytest_asyncio.fixture
async def proxy(seaweedfs: SeaweedFS) -> AsyncIterator[FaultProxy]:
    async with FaultProxy("127.0.0.1", seaweedfs.ports["s3"], seed=7) as p:
        yield p
