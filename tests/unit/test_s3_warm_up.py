"""A started S3 backend has built its botocore client already (a few hundred CPU ms of service
model and endpoint rules), so the first checkpoint's drain does not pay for it."""

from __future__ import annotations

import gc

import pytest

from ckptdrain.daemon.backends import s3client
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


@pytest.mark.asyncio
async def test_start_opens_the_http_session_so_the_first_request_builds_no_tls_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """aiobotocore opens its aiohttp session, with a TLS context read from the CA bundle
    (about 30 ms of CPU), at the first request: every upload worker paid it in its first
    drain, which made a second worker look 10-20% dearer per GB over a 1 GiB drain (the
    `s3` benchmark's scaling row). A started backend has it open already."""
    from aiobotocore.httpsession import AIOHTTPSession

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                  "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)  # the session's key is the proxy's URL
    built: list[object] = []
    real_build = AIOHTTPSession._build_ssl_contexts

    def counting_build(self: AIOHTTPSession, proxy_url: str | None) -> object:
        built.append(proxy_url)
        return real_build(self, proxy_url)

    monkeypatch.setattr(AIOHTTPSession, "_build_ssl_contexts", counting_build)
    # Nothing listens there, and one attempt: the request fails at once, after the session.
    config = DestinationConfig(uri="s3://bucket/prefix", endpoint_url="http://127.0.0.1:9",
                               region="us-east-1", addressing_style="path", max_attempts=1,
                               connect_timeout_s=2)
    backend = S3Backend(config, "node", workers=0)
    try:
        await backend.start()
        assert built == [None]
        with pytest.raises(s3client.S3Failure):
            await backend.stat("some/key")
        assert built == [None]
    finally:
        await backend.aclose()


@pytest.mark.asyncio
async def test_the_first_client_built_is_frozen_out_of_the_collectors_walks_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's model is built once and lives as long as the process: frozen, a full
    collection no longer walks it (4% of a restore's CPU went to the collector before). Only
    the first client freezes: freezing at every one kept each closed client's cycles for good
    (about 12 MB per client in a process opening backend after backend)."""
    config, freezes = _counting_freezes(monkeypatch)
    counts = []
    try:
        for _ in range(2):
            backend = S3Backend(config, "node", workers=0)
            try:
                await backend.start()
                assert backend._client is not None
                counts.append(gc.get_freeze_count())
            finally:
                await backend.aclose()
        # Everything alive once the first client was built; the second freezes nothing more.
        assert counts[0] > 10_000
        assert freezes == ["frozen"]
    finally:
        gc.unfreeze()
        s3client.freeze_long_lived.cache_clear()


@pytest.mark.asyncio
async def test_with_workers_the_daemon_freezes_at_start_and_never_mid_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found reviewing 887a950: with workers the daemon built no client at start, so the
    first freeze came with a client built mid-run (a shard read through the daemon) and
    pinned whatever was alive then (tasks, tracebacks) out of the collector's reach."""
    config, freezes = _counting_freezes(monkeypatch)
    backend = S3Backend(config, "node", workers=1)
    try:
        await backend.start()
        assert backend._client is None and freezes == ["frozen"]
        await backend._s3()  # what a read through the daemon does first
        assert backend._client is not None and freezes == ["frozen"]
    finally:
        await backend.aclose()
        gc.unfreeze()
        s3client.freeze_long_lived.cache_clear()


def _counting_freezes(monkeypatch: pytest.MonkeyPatch) -> tuple[DestinationConfig, list[str]]:
    """A configuration whose endpoint nothing listens on (building a client sends nothing),
    and the list of gc.freeze calls from now on, with this process unfrozen and the
    once-per-process freeze forgotten."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    config = DestinationConfig(uri="s3://bucket/prefix", endpoint_url="http://127.0.0.1:9",
                               region="us-east-1", addressing_style="path")
    gc.unfreeze()
    s3client.freeze_long_lived.cache_clear()
    freezes: list[str] = []
    real_freeze = gc.freeze

    def counting_freeze() -> None:
        freezes.append("frozen")
        real_freeze()

    monkeypatch.setattr(gc, "freeze", counting_freeze)
    return config, freezes
