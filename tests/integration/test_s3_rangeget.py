"""Restore's ranged GETs read straight into a buffer of their own (s3rangeget.py), where the
range's bytes are written on the event loop's thread (``writes_on_loop``: the ``ckptdrain
restore`` command and its reader processes): against SeaweedFS, through a proxy that records
every request and breaks some. A presigned GET (``X-Amz-Signature`` in its target) is one read
here; one signed in its headers went through aiobotocore."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import uvloop

from ckptdrain.daemon.backends.base import BackendError
from ckptdrain.daemon.backends.s3 import S3Backend
from ckptdrain.daemon.backends.s3errors import S3Failure
from ckptdrain.daemon.backends.s3ranges import LoopWriter, Range, fetch_range
from tests.integration.faultproxy import FaultProxy, ProxiedRequest
from tests.integration.seaweedfs import ACCESS_KEY, SECRET_KEY, SeaweedFS
from tests.integration.test_s3_backend import NODE, PREFIX, dest_config

# Part bodies are pooled bytearrays on purpose (test_s3_backend.py says why).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Sending a large body directly with raw bytes:ResourceWarning"
)

MiB = 1 << 20
KEY = "job/00000000000000000001/big.bin"
SIZE = 37 * MiB + 5  # five ranges of 8 MiB, the last short


def _gets(proxy: FaultProxy) -> list[ProxiedRequest]:
    return [r for r in proxy.requests if r.method == "GET"]


def _presigned(r: ProxiedRequest) -> bool:
    return "X-Amz-Signature=" in r.target


@pytest.fixture
def stored(seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, staged: Any) -> Any:
    async def store(size: int = SIZE, seed: int = 95) -> Any:
        direct = backends(dest_config(s3_bucket, seaweedfs.endpoint_url))
        shard = staged(size, seed=seed)
        assert await direct.put_file(KEY, shard.fd, shard.size) == shard.checksum
        return shard
    return store


async def _copy(backend: Any, tmp_path: Path, name: str = "restored",
                progress: Any = None) -> tuple[int, str]:
    fd = os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        return await backend.copy_into(KEY, fd, progress=progress)  # type: ignore[no-any-return]
    finally:
        os.close(fd)


@pytest.mark.s3
@pytest.mark.asyncio
async def test_ranges_written_on_the_loop_are_read_into_a_buffer_of_their_own(
        s3_bucket: str, backends: Any, stored: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    shard = await stored()
    on_loop = backends(dest_config(s3_bucket, proxy.endpoint_url), writes_on_loop=True)
    moved: list[int] = []
    assert await _copy(on_loop, tmp_path, progress=moved.append) == (SIZE, shard.checksum)
    assert (tmp_path / "restored").read_bytes() == shard.data
    assert sum(moved) == SIZE and max(moved) <= 256 << 10, "written as it came, in batches"
    gets = _gets(proxy)
    assert len(gets) == 5 and all(_presigned(r) for r in gets)

    # Written in a worker thread (the daemon's reads for its clients), through aiobotocore.
    proxy.requests.clear()
    in_thread = backends(dest_config(s3_bucket, proxy.endpoint_url))
    assert await _copy(in_thread, tmp_path, "threaded") == (SIZE, shard.checksum)
    gets = _gets(proxy)
    assert len(gets) == 5 and not any(_presigned(r) for r in gets)


@pytest.mark.s3
@pytest.mark.asyncio
async def test_a_range_cut_mid_body_is_read_on_from_its_first_byte_not_written(
        s3_bucket: str, backends: Any, stored: Any, proxy: FaultProxy, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    shard = await stored()
    on_loop = backends(dest_config(s3_bucket, proxy.endpoint_url), writes_on_loop=True)
    proxy.inject("truncate", match=lambda r: r.method == "GET")
    caplog.set_level(logging.INFO, logger="ckptdrain")
    assert await _copy(on_loop, tmp_path) == (SIZE, shard.checksum)
    assert (tmp_path / "restored").read_bytes() == shard.data
    gets = _gets(proxy)
    assert [r.fault for r in gets].count("truncate") == 1
    assert len(gets) == 5 + 1 and all(_presigned(r) for r in gets)
    resumed = [r for r in caplog.records if "s3_read_resumed" in r.getMessage()]
    assert len(resumed) == 1, caplog.text
    offset = int(resumed[0].getMessage().split("offset=")[1].split()[0])
    assert offset % (8 * MiB) != 0, "read again from the range's start, not read on"


@pytest.mark.s3
@pytest.mark.asyncio
async def test_a_range_cut_every_time_fails_the_copy_as_transient(
        s3_bucket: str, backends: Any, stored: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    await stored()
    on_loop = backends(dest_config(s3_bucket, proxy.endpoint_url, max_attempts=2),
                       writes_on_loop=True)
    proxy.inject("truncate", times=100, match=lambda r: r.method == "GET")
    with pytest.raises(BackendError) as caught:
        await _copy(on_loop, tmp_path)
    assert (caught.value.kind, caught.value.transient) == ("io", True)
    assert "cut short" in str(caught.value)


@pytest.mark.s3
@pytest.mark.asyncio
async def test_an_answer_that_never_comes_is_asked_again_after_the_read_timeout(
        s3_bucket: str, backends: Any, stored: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    shard = await stored()
    on_loop = backends(dest_config(s3_bucket, proxy.endpoint_url, read_timeout_s=1.0),
                       writes_on_loop=True)
    proxy.inject("stall", match=lambda r: r.method == "GET")
    assert await _copy(on_loop, tmp_path) == (SIZE, shard.checksum)
    gets = _gets(proxy)
    assert [r.fault for r in gets].count("stall") == 1 and len(gets) == 5 + 1


@pytest.mark.s3
@pytest.mark.asyncio
async def test_a_trickling_answer_fails_in_bounded_time(
        s3_bucket: str, backends: Any, stored: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    await stored(6 * MiB)
    on_loop = backends(dest_config(s3_bucket, proxy.endpoint_url, max_attempts=1,
                                   connect_timeout_s=1.0, read_timeout_s=2.0,
                                   part_size_bytes=5 * MiB, multipart_threshold_bytes=5 * MiB),
                       writes_on_loop=True)
    proxy.inject("trickle", times=100, match=lambda r: r.method == "GET")
    with pytest.raises(BackendError) as slow:
        await _copy(on_loop, tmp_path)
    assert (slow.value.kind, slow.value.transient) == ("timeout", True)
    assert "did not come in" in str(slow.value)
    assert all(_presigned(r) for r in _gets(proxy))


@pytest.mark.s3
@pytest.mark.asyncio
async def test_an_answer_not_plain_is_asked_again_through_aiobotocore_and_says_what_it_was(
        s3_bucket: str, backends: Any, stored: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    shard = await stored()
    on_loop = backends(dest_config(s3_bucket, proxy.endpoint_url), writes_on_loop=True)
    full = f"{PREFIX}/{KEY}"
    fd = os.open(tmp_path / "replaced", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # The object's ETag is not the one the range is pinned to: 412 to the presigned
        # GET, and the same to aiobotocore's, which says the object was replaced.
        with pytest.raises(S3Failure) as replaced:
            await fetch_range(on_loop, Range(KEY, full, 0, 8 * MiB, '"not-its-etag"'),
                              LoopWriter(fd))
        assert (replaced.value.kind, replaced.value.transient) == ("conflict", True)
        assert "was replaced" in str(replaced.value)
        assert [_presigned(r) for r in _gets(proxy)] == [True, False]
        assert os.fstat(fd).st_size == 0

        # A web page in the server's place (200, HTML): aiobotocore's answer is the error.
        proxy.requests.clear()
        proxy.inject("web_page", times=100, match=lambda r: r.method == "GET")
        with pytest.raises(BackendError):
            await on_loop.copy_into(KEY, fd)
        assert any(_presigned(r) for r in _gets(proxy))
        assert any(not _presigned(r) for r in _gets(proxy))
    finally:
        os.close(fd)
    del shard


@pytest.mark.s3
@pytest.mark.asyncio
async def test_a_failing_write_ends_the_copy_with_its_error(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, stored: Any,
        tmp_path: Path) -> None:
    await stored()
    on_loop = backends(dest_config(s3_bucket, seaweedfs.endpoint_url), writes_on_loop=True)
    (tmp_path / "read-only").write_bytes(b"")
    fd = os.open(tmp_path / "read-only", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as caught:
            await on_loop.copy_into(KEY, fd)
    finally:
        os.close(fd)
    assert caught.value.errno == 9  # EBADF: not open for writing


@pytest.mark.s3
def test_on_uvloop_as_the_command_runs_it(seaweedfs: SeaweedFS, s3_bucket: str, staged: Any,
                                          tmp_path: Path) -> None:
    # ``ckptdrain restore`` runs on uvloop, whose transports are not asyncio's classes: a
    # check for asyncio.Transport in the protocol stopped every read there (found by the
    # command's own round trip, test_s3_daemon.py, which waited for good).
    shard = staged(SIZE, seed=96)

    async def scenario() -> list[ProxiedRequest]:
        direct = S3Backend(dest_config(s3_bucket, seaweedfs.endpoint_url), NODE)
        async with FaultProxy("127.0.0.1", seaweedfs.ports["s3"], seed=7) as proxy:
            on_loop = S3Backend(dest_config(s3_bucket, proxy.endpoint_url, read_timeout_s=5.0),
                                NODE, writes_on_loop=True)
            try:
                assert await direct.put_file(KEY, shard.fd, shard.size) == shard.checksum
                proxy.inject("truncate", match=lambda r: r.method == "GET")
                assert await _copy(on_loop, tmp_path) == (SIZE, shard.checksum)
            finally:
                await on_loop.aclose()
                await direct.aclose()
            return _gets(proxy)

    gets = uvloop.run(scenario())
    assert (tmp_path / "restored").read_bytes() == shard.data
    assert len(gets) == 5 + 1 and all(_presigned(r) for r in gets)
    assert [r.fault for r in gets].count("truncate") == 1


@pytest.mark.s3
@pytest.mark.asyncio
async def test_credentials_that_fail_to_renew_fail_the_range_with_a_typed_error(
        seaweedfs: SeaweedFS, s3_bucket: str, backends: Any, stored: Any, proxy: FaultProxy,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found attacking: the presigned URL is signed with the client's credentials, renewed
    # first where they are about to expire (a credential_process, a role's): a chain that
    # failed to renew them raised botocore's CredentialRetrievalError out of the restore,
    # where aiobotocore's GET says what to do (kind "auth").
    shard = await stored()
    answer = tmp_path / "credentials.json"
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 300))
    answer.write_text(json.dumps({"Version": 1, "AccessKeyId": ACCESS_KEY,
                                  "SecretAccessKey": SECRET_KEY, "Expiration": expires}))
    process = tmp_path / "credential-process"
    process.write_text(f"#!/bin/sh\nexec cat {answer}\n")
    process.chmod(0o755)
    (tmp_path / "aws-config").write_text(f"[default]\ncredential_process = {process}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    on_loop = backends(dest_config(s3_bucket, proxy.endpoint_url), writes_on_loop=True)
    fd = os.open(tmp_path / "restored", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        assert await _copy(on_loop, tmp_path, "first") == (SIZE, shard.checksum)
        answer.unlink()  # the process fails from now on; the credentials expire in 5 min
        with pytest.raises(S3Failure) as refused:
            await fetch_range(on_loop, Range(KEY, f"{PREFIX}/{KEY}", 0, 8 * MiB, '"e"'),
                              LoopWriter(fd))
    finally:
        os.close(fd)
    assert (refused.value.kind, refused.value.transient) == ("auth", False)
    assert "custom-process" in str(refused.value)


@pytest.mark.s3
@pytest.mark.asyncio
async def test_an_endpoint_written_with_capitals_is_read_here_as_botocore_signed_it(
        s3_bucket: str, backends: Any, stored: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    # Found attacking: botocore signs the Host of a presigned URL lower-cased and without a
    # default port (":443", ":80"); the GET sent the URL's netloc as it was written, which
    # the server refused (SignatureDoesNotMatch), and every range was asked twice: the
    # refused GET, then aiobotocore's.
    shard = await stored()
    on_loop = backends(dest_config(s3_bucket, f"http://LocalHost:{proxy.port}"),
                       writes_on_loop=True)
    assert await _copy(on_loop, tmp_path) == (SIZE, shard.checksum)
    gets = _gets(proxy)
    assert len(gets) == 5 and all(_presigned(r) for r in gets)


@pytest.mark.s3
@pytest.mark.asyncio
async def test_bytes_after_an_answers_body_are_not_the_range(
        s3_bucket: str, backends: Any, stored: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    # Found attacking: an answer whose body came with a few bytes more after it (its
    # Content-Length says where the body ends; aiohttp leaves the rest, and aiobotocore's
    # GET reads such an answer) failed as "more than the bytes of the range came back" on
    # every attempt, where they arrived with the body's last bytes (the last range here:
    # 5 MiB + 5 bytes, not a whole number of 256 KiB buffers), and the restore with it.
    shard = await stored()
    on_loop = backends(dest_config(s3_bucket, proxy.endpoint_url), writes_on_loop=True)
    proxy.inject("trailing", times=100, match=lambda r: r.method == "GET")
    assert await _copy(on_loop, tmp_path) == (SIZE, shard.checksum)
    assert (tmp_path / "restored").read_bytes() == shard.data
    gets = _gets(proxy)
    assert len(gets) == 5 and all(_presigned(r) and r.fault == "trailing" for r in gets)
