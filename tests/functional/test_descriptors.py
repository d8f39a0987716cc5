"""The daemon short of file descriptors: a shortage that passes is waited out, and said to be
the daemon's, never a client's fault nor a generation's end."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
from collections.abc import Iterator
from typing import Any

from tests.conftest import DaemonProcess, wait_for

MiB = 1 << 20


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def descriptors_short(d: DaemonProcess, spare: int) -> Iterator[list[socket.socket]]:
    """The daemon's fd limit lowered to what it holds plus ``spare``, and idle connections
    (what any local user may open) taking what is left; both undone after."""
    assert d.proc is not None
    pid = d.proc.pid
    before = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held: list[socket.socket] = []
    try:
        limit = open_fds(pid) + spare
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, before[1]))
        for _ in range(spare + 16):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(str(d.socket_path))
            held.append(s)
        wait_for(lambda: open_fds(pid) >= limit)
        yield held
    finally:
        for s in held:
            s.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, before)


def test_a_drain_short_of_descriptors_waits_for_them(make_daemon: Any) -> None:
    # Found attacking: with the daemon's fds taken by idle connections for a while, opening a
    # staged copy to drain it failed with EMFILE, read as "staged copy unreadable: nothing a
    # retry can fix", and every acknowledged generation draining then failed for good.
    d: DaemonProcess = make_daemon(CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="4MiB",
                                   CKPTDRAIN_DESTINATION__MAX_CONCURRENCY="1")
    data = {f"s{i}.bin": os.urandom(2 * MiB) for i in range(6)}
    client = d.client(timeout_s=60)
    with client.generation("job", 1) as g:
        for name, blob in data.items():
            g.put(name, blob)
    with descriptors_short(d, spare=0):
        # Until the drain has met the shortage opening a staged copy (each try opens it, then
        # the destination's file), or failed the generation.
        wait_for(lambda: "could not open the staged copy" in d.log()
                 or "event=generation_failed" in d.log(), timeout_s=20)
    client.wait("job", 1, timeout_s=60)
    for name, blob in data.items():
        assert (d.dest / "job" / f"{1:020d}" / name).read_bytes() == blob
    assert "staged copy unreadable" not in d.log()
