"""The fault proxy itself: closing it never leaves a connection open behind it.

Found in make chaos (seed 17002) and in CI (seed 5): a chaos trial failed on a
ResourceWarning for a loopback connection nobody in that trial had made. It was the proxy's,
from an earlier S3 test: on Python 3.11 a Server closed while one of its accepts is under way
in the loop makes that connection's transport after close() and never closes it; the garbage
collector found it later, during whichever test was running."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.integration.faultproxy import FaultProxy


@pytest.mark.asyncio
@pytest.mark.parametrize("turns", range(5))
async def test_closing_while_a_connection_is_being_accepted_leaves_none_open(turns: int) -> None:
    """A client connects and the proxy closes ``turns`` loop turns later: at 2 the accept
    was under way in asyncio's own task. Nothing listens upstream (port 1): the proxy never
    gets as far as forwarding. Once aclose() returns, the client's connection has been ended
    by the proxy (or refused, if it was never accepted): a read finds it closed at once. A
    leaked connection stays open until the garbage collector happens to find it, so the read
    waits (bounded) instead."""
    proxy = await FaultProxy("127.0.0.1", 1).start()
    client = socket.create_connection(("127.0.0.1", proxy.port))
    try:
        for _ in range(turns):
            await asyncio.sleep(0)
        await proxy.aclose()
        client.settimeout(5.0)
        try:
            got = client.recv(1)
        except ConnectionResetError:
            got = b""
        except TimeoutError:
            pytest.fail("the proxy left the connection open after aclose()")
        assert got == b""
    finally:
        client.close()
