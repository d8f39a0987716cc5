"""The fault proxy itself: closing it never leaves a connection open behind it.

Found in make chaos (seed 17002) and in CI (seed 5): a chaos trial failed on a
ResourceWarning for a loopback connection nobody in that trial had made. It was the proxy's,
from an earlier S3 test: on Python 3.11 a Server closed while one of its accepts is under way
in the loop makes that connection's transport after close() and never closes it; the garbage
collector found it later, during whichever test was running."""

from __future__ import annotations

import asyncio
import gc
import socket

import pytest

from tests.integration.faultproxy import FaultProxy


@pytest.mark.asyncio
@pytest.mark.parametrize("turns", range(5))
async def test_closing_while_a_connection_is_being_accepted_leaves_none_open(turns: int) -> None:
    """A client connects and the proxy closes ``turns`` loop turns later: at 2 the accept
    was under way in asyncio's own task. Nothing listens upstream (port 1): the proxy never
    gets as far as forwarding."""
    proxy = await FaultProxy("127.0.0.1", 1).start()
    client = socket.create_connection(("127.0.0.1", proxy.port))
    try:
        for _ in range(turns):
            await asyncio.sleep(0)
        await proxy.aclose()
    finally:
        client.close()
    gc.collect()
    left = [o for o in gc.get_objects()
            if isinstance(o, asyncio.Transport) and not o.is_closing()
            and (sock := o.get_extra_info("socket")) is not None
            and sock.getsockname()[1:2] == (proxy.port,)]
    assert left == []
