"""FileBody: a part's bytes go from the staged file into the request with sendfile (or, where
the connection cannot take it, as slices through a small buffer), byte for byte."""

from __future__ import annotations

import os
import random
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from ckptdrain.daemon.backends.s3bodies import FileBody, checksum_range
from ckptdrain.daemon.checksums import crc64nvme_int

MiB = 1 << 20


async def _post(tmp_path: Path, *, chunked: bool) -> tuple[bytes, bool]:
    data = random.Random(7).randbytes(9 * MiB + 123)
    path = tmp_path / "staged"
    path.write_bytes(data)
    received: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 * MiB)
    app.router.add_put("/part", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    fd = os.open(path, os.O_RDONLY)
    try:
        offset, length = 3 * MiB + 5, 5 * MiB + 77
        body = FileBody(fd, offset, length)
        async with aiohttp.ClientSession() as session:
            headers = {} if chunked else {"Content-Length": str(length)}
            async with session.put(f"http://127.0.0.1:{port}/part", data=body,
                                   headers=headers, chunked=chunked or None) as answer:
                assert answer.status == 200
        assert checksum_range(fd, offset, length) == crc64nvme_int(data[offset:offset + length])
    finally:
        os.close(fd)
        await runner.cleanup()
    assert received == [data[offset:offset + length]]
    return received[0], body.sendfile_used


@pytest.mark.asyncio
async def test_a_part_goes_out_by_sendfile_byte_for_byte(tmp_path: Path) -> None:
    _, used = await _post(tmp_path, chunked=False)
    assert used


@pytest.mark.asyncio
async def test_a_connection_that_cannot_take_sendfile_gets_the_same_bytes_as_slices(
        tmp_path: Path) -> None:
    _, used = await _post(tmp_path, chunked=True)
    assert not used


def test_a_truncated_staged_file_is_an_error_not_a_short_checksum(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="truncated"):
            checksum_range(fd, 0, 2000)
    finally:
        os.close(fd)
