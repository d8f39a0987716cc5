"""The daemon short of file descriptors: a shortage that passes is waited out, and said to be
the daemon's, never a client's fault nor a generation's end. A client short of them gets a
typed error, never a bare OSError."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Backpressure
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
                 or "event=generation_failed" in d.log(), timeout_s=60)
    client.wait("job", 1, timeout_s=60)
    for name, blob in data.items():
        assert (d.dest / "job" / f"{1:020d}" / name).read_bytes() == blob
    assert "staged copy unreadable" not in d.log()


def test_a_passed_fd_the_daemon_cannot_take_is_its_shortage(make_daemon: Any,
                                                            tmp_path: Path) -> None:
    # Found attacking: with the daemon at its fd limit, the kernel could not give it the fd a
    # put_file passed (MSG_CTRUNC), which the daemon read as the client passing too many:
    # RejectedInput ("fix your code", not retryable), charged to the client's uid. It is the
    # daemon's shortage: a retryable backpressure naming it.
    d: DaemonProcess = make_daemon()
    source = tmp_path / "shard.bin"
    source.write_bytes(os.urandom(4096))
    client = d.client(timeout_s=30)
    with pytest.raises(Backpressure) as refused, client.generation("job", 1) as g:
        g.put("a.bin", b"a" * 10)  # the connection is open before the shortage
        with descriptors_short(d, spare=0):
            g.put_file("b.bin", source)
    assert refused.value.details["limit"] == "file_descriptors", refused.value
    assert "short of file descriptors" in str(refused.value)
    assert "client_protocol_error" not in d.log()
    # Staging a put's bytes meets the same shortage creating its file: it was "internal".
    with (pytest.raises(Backpressure, match="short of file descriptors"),
          client.generation("job", 2) as g):
        g.put("a.bin", b"a" * 10)
        with descriptors_short(d, spare=0):
            g.put("c.bin", b"c" * 10)
    with client.generation("job", 3) as g:  # the shortage passed: hand-offs go on
        g.put_file("b.bin", source)
    client.wait("job", 3, timeout_s=30)


def test_the_daemon_raises_its_soft_fd_limit(make_daemon: Any) -> None:
    # Found attacking: started by hand, from a container or a batch system, the daemon kept
    # the usual soft limit of 1024 fds, and 1,020 idle connections (under limits.max_clients
    # and the per-uid share) locked every user out, root's `status` included. It raises its
    # soft limit to the hard one at start.
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert before[1] == resource.RLIM_INFINITY or before[1] > 256
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, before[1]))
    try:
        d: DaemonProcess = make_daemon()  # inherits the soft 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
    assert d.proc is not None
    soft, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)
    assert soft == hard or (hard == resource.RLIM_INFINITY and soft >= 1 << 20), (soft, hard)


CLIENT_OUT_OF_FDS = textwrap.dedent("""
    import contextlib, sys
    from ckptdrain.client import Client, DrainError
    from tests.fdtable import fd_table_full
    client = Client(sys.argv[1])
    full = contextlib.ExitStack()
    full.enter_context(fd_table_full())  # this process's fd table full (EMFILE)
    calls = {
        "latest": lambda: client.latest("fdjob"),
        "begin": lambda: client.generation("fdjob", 1, rank=0, world_size=1).__enter__(),
        "wait": lambda: client.wait("fdjob", 1, timeout_s=5),
    }
    for name, call in calls.items():
        try:
            call()
            print(name, "answered", flush=True)
        except DrainError as exc:
            print(name, type(exc).__name__, flush=True)
        except BaseException as exc:
            print(name, "untyped", type(exc).__name__, exc, flush=True)
    full.close()
    with client.generation("fdjob", 1, rank=0, world_size=1) as gen:  # fds back: it works
        gen.put("a", b"x" * 100)
    print("committed", client.wait("fdjob", 1, timeout_s=60)["committed"], flush=True)
""")


def test_a_client_out_of_descriptors_gets_a_typed_error(make_daemon: Any) -> None:
    # Found attacking a DCP rank at a low RLIMIT_NOFILE: with the process's fd table full,
    # every call that opens a connection (begin, latest, wait; DrainWriter's save) raised the
    # bare OSError of socket() (EMFILE), outside DrainError, the root of every error the
    # client raises. It is DaemonUnavailable now, and the client works once fds are free.
    d: DaemonProcess = make_daemon()
    out = subprocess.run([sys.executable, "-c", CLIENT_OUT_OF_FDS, str(d.socket_path)],
                         capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2],
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    assert out.stdout.split("\n")[:4] == [
        "latest DaemonUnavailable", "begin DaemonUnavailable", "wait DaemonUnavailable",
        "committed True"], out.stdout + out.stderr
