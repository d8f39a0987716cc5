"""Fixtures for tests against real servers.

``seaweedfs`` (session): one SeaweedFS S3 server on free loopback ports, with the standard AWS
credential chain pointed at its test keys (env vars; no profile, no instance metadata).
``s3_bucket`` (function): a fresh, uniquely named bucket on it, deleted afterwards (each bucket
holds its own volumes, and the server has room for only a few at once).

If `weed` is missing the tests fail rather than skip: the S3 tests run in CI.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.integration.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, SeaweedFS, find_weed


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    weed = find_weed()  # raises WeedNotFound: a failure with the fix in its message
    aws_home = tmp_path_factory.mktemp("aws")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        env.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        env.delenv("AWS_SESSION_TOKEN", raising=False)
        env.delenv("AWS_PROFILE", raising=False)
        env.setenv("AWS_DEFAULT_REGION", REGION)
        # Hermetic: a developer's ~/.aws and the instance metadata service play no part.
        env.setenv("AWS_CONFIG_FILE", str(aws_home / "config"))
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(aws_home / "credentials"))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        server = SeaweedFS(weed=weed)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(seaweedfs: SeaweedFS) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:16]}"
    seaweedfs.create_bucket(name)
    yield name
    seaweedfs.delete_bucket(name)
