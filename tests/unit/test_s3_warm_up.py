"""A started S3 backend has built its botocore client already (a few hundred CPU ms of service
model and endpoint rules), so the first checkpoint's drain does not pay for it."""

from __future__ import annotations

import pytest

from ckptdrain.daemon.backends.s3 import S3Backend
from ckptdrain.daemon.config import DestinationConfig


@pytest.mark.asyncio
async def test_start_builds_the_client_before_any_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Nothing listens there: building the client sends no request.
    config = DestinationConfig(uri="s3://bucket/prefix", endpoint_url="http://127.0.0.1:9",
                               region="us-east-1", addressing_style="path")
    backend = S3Backend(config, "node", workers=0)
    try:
        assert backend._client is None
        await backend.start()
        assert backend._client is not None
    finally:
        await backend.aclose()
