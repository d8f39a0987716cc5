"""Fixtures for tests against real servers.

``seaweedfs`` (session, in tests/conftest.py so the chaos suites share the same server).
``s3_bucket`` (function): a fresh, uniquely named bucket on it, deleted afterwards (each bucket
holds its own volumes, and the server has room for only a few at once).

If `weed` is missing the tests fail rather than skip: the S3 tests run in CI.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.integration.seaweedfs import SeaweedFS


@pytest.fixture
def s3_bucket(seaweedfs: SeaweedFS) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:16]}"
    seaweedfs.create_bucket(name)
    yield name
    seaweedfs.delete_bucket(name)
