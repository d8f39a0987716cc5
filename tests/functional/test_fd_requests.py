"""File descriptors a client passes are checked before use, never block the event loop, and
each refusal is typed; an fd belongs to the frame it came with, never to a later one; shard
paths that cannot both exist are refused at put time. Findings of the hostile-client
campaign (typed errors, and a loop frozen by a write-locked memfd)."""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import signal
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Client, InvalidName, NotFound, RejectedInput, SizeMismatch, wire
from tests.conftest import CKPTDRAIN, DaemonProcess
from tests.functional.test_bad_input import RawClient
from tests.functional.test_failure_boundary import memfd_with, still_serves

SHARD = {"job": "bad", "step": 1, "rank": 0}


def send_fds(raw: RawClient, data: bytes, fds: list[int]) -> None:
    raw.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def put_with(raw: RawClient, kind: str, fds: list[int], path: str, size: int) -> Any:
    send_fds(raw, wire.encode_message(kind, {**SHARD, "path": path, "size": size}), fds)
    return raw.reply()


def is_error(reply: Any, code: str, fragment: str) -> bool:
    return (isinstance(reply, wire.Message) and reply.kind == "error"
            and reply.fields["code"] == code and fragment in reply.fields["message"])


@contextlib.contextmanager
def not_a_memfd(kind: str, tmp_path: Path) -> Iterator[tuple[int, int]]:
    """(fd, size) of something that is not a memfd."""
    opened: list[int] = []
    if kind == "directory":
        opened.append(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY))
    elif kind == "socket":
        a, b = socket.socketpair()
        opened += [os.dup(a.fileno()), os.dup(b.fileno())]
        a.close()
        b.close()
    elif kind == "pipe":
        opened += list(os.pipe())
    else:
        path = tmp_path / "file.bin"
        path.write_bytes(b"z" * 100)
        opened.append(os.open(path, os.O_RDONLY))
    try:
        yield opened[0], 100
    finally:
        for fd in opened:
            os.close(fd)


@pytest.mark.parametrize("kind", ["regular file", "directory", "socket", "pipe"])
def test_put_memfd_with_something_else_is_a_typed_refusal(make_daemon, tmp_path: Path, kind: str) -> None:  # type: ignore[no-untyped-def]
    # A lock taken on a "memfd" that is a file of a network filesystem could wait on its
    # server: only memfds are locked, and anything else is refused first.
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory")
    with not_a_memfd(kind, tmp_path) as (fd, size), RawClient(d.socket_path) as raw:
        raw.hello_begin()
        reply = put_with(raw, "put_memfd", [fd], "m", size)
        assert is_error(reply, wire.BAD_REQUEST, "not a memfd"), reply
        assert raw.call("status").kind == "ok"  # the connection goes on
    still_serves(d)


@pytest.mark.parametrize(("kind", "fragment"), [
    ("directory", "not a regular file"), ("socket", "not a regular file"),
    ("pipe", "not a regular file"), ("write-only", "not open for reading"),
    ("O_PATH", "not open for reading"),
])
def test_put_fd_checks_access_mode_and_type(daemon: DaemonProcess, tmp_path: Path, kind: str, fragment: str) -> None:
    path = tmp_path / "file.bin"
    path.write_bytes(b"z" * 100)
    with contextlib.ExitStack() as stack:
        if kind == "write-only":
            fd = os.open(path, os.O_WRONLY)
            stack.callback(os.close, fd)
        elif kind == "O_PATH":
            fd = os.open(path, os.O_PATH)
            stack.callback(os.close, fd)
        else:
            fd, _ = stack.enter_context(not_a_memfd(kind, tmp_path))
        raw = stack.enter_context(RawClient(daemon.socket_path))
        raw.hello_begin()
        assert is_error(put_with(raw, "put_fd", [fd], "f", 100), wire.BAD_REQUEST, fragment)
        assert raw.call("status").kind == "ok"
    still_serves(daemon)


def test_a_write_locked_memfd_does_not_keep_other_clients_waiting(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACK="memory")
    fd = memfd_with(b"y" * 100)
    fcntl.lockf(fd, fcntl.LOCK_EX)  # the daemon's shared lock cannot be granted while held
    served = threading.Event()
    failures: list[BaseException] = []

    def bystander() -> None:
        try:
            still_serves(d)
            served.set()
        except BaseException as exc:
            failures.append(exc)

    with RawClient(d.socket_path) as raw:
        raw.hello_begin()
        send_fds(raw, wire.encode_message("put_memfd", {**SHARD, "path": "l", "size": 100}), [fd])
        other = threading.Thread(target=bystander)
        other.start()
        # Served while the lock is still held: the loop never waits on it.
        assert served.wait(60), failures or "another client was not served"
        assert is_error(raw.reply(), wire.BAD_REQUEST, "locked")
        other.join(10)
    os.close(fd)


def test_a_stale_fd_sent_with_status_is_not_taken_by_a_later_put_fd(daemon: DaemonProcess, tmp_path: Path) -> None:
    path = tmp_path / "secret.bin"
    path.write_bytes(b"s" * 10)
    fd = os.open(path, os.O_RDONLY)
    with RawClient(daemon.socket_path) as raw:
        raw.hello_begin()
        # One sendmsg: the fd rides with status; the put_fd right behind it carries none.
        put = wire.encode_message("put_fd", {**SHARD, "path": "stolen", "size": 10})
        send_fds(raw, wire.encode_message("status", {}) + put, [fd])
        assert raw.reply().kind == "ok"
        assert is_error(raw.reply(), wire.BAD_REQUEST, "without a file descriptor")
        assert raw.call("seal", **SHARD).kind == "ok"
    os.close(fd)
    daemon.client().wait("bad", 1, timeout_s=30)
    assert not (daemon.dest / "bad" / f"{1:020d}" / "stolen").exists()


def test_two_fds_on_one_put_fd_are_refused(daemon: DaemonProcess, tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"f" * 10)
    fds = [os.open(path, os.O_RDONLY) for _ in range(2)]
    with RawClient(daemon.socket_path) as raw:
        raw.hello_begin()
        assert is_error(put_with(raw, "put_fd", fds, "two", 10), wire.BAD_REQUEST,
                        "with 2 file descriptors")
        assert put_with(raw, "put_fd", fds[:1], "one", 10).kind == "ok"
    for fd in fds:
        os.close(fd)


@pytest.mark.parametrize("count", [5, 200])
def test_more_fds_than_one_message_may_carry_get_a_typed_error(daemon: DaemonProcess, count: int) -> None:
    # 5 fds were `internal`, 200 a silent close.
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(count)]
    with RawClient(daemon.socket_path) as raw:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        send_fds(raw, wire.encode_message("status", {}), fds)
        reply = raw.reply()
        assert is_error(reply, wire.BAD_REQUEST, "more than 4 file descriptors"), reply
    for fd in fds:
        os.close(fd)
    still_serves(daemon)


def test_a_shard_and_a_directory_of_the_same_name_are_refused_at_put(daemon: DaemonProcess) -> None:
    # Both were accepted and the generation then failed at drain.
    c = daemon.client()
    with c.generation("names", 1) as gen:
        gen.put("x", b"file")
        with pytest.raises(InvalidName, match="directory of the other"):
            gen.put("x/y", b"under it")
        gen.put("a/b/c", b"deep")
        with pytest.raises(InvalidName, match="directory of the other"):
            gen.put("a/b", b"over it")
        with pytest.raises(InvalidName, match="directory of the other"):
            gen.put("a", b"over it")
        gen.put("a/b2", b"beside it")
    c.wait("names", 1, timeout_s=30)
    root = daemon.dest / "names" / f"{1:020d}"
    assert (root / "x").read_bytes() == b"file"
    assert (root / "a" / "b" / "c").read_bytes() == b"deep"


@contextlib.contextmanager
def lingering_socket(linger_s: int) -> Iterator[socket.socket]:
    """A TCP socket whose close() blocks for ``linger_s``: SO_LINGER set, its send buffer full
    and its peer never reading. A hostile client passes one and closes its own copy, so the
    daemon's close is the last."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.connect(listener.getsockname())
        peer, _ = listener.accept()
        with peer:
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    sock.send(b"x" * 65536)
            sock.setblocking(True)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger_s))
            yield sock


def test_closing_a_passed_fd_does_not_freeze_the_loop(daemon: DaemonProcess) -> None:
    served = threading.Event()
    failures: list[BaseException] = []

    def bystander() -> None:
        try:
            still_serves(daemon)
            served.set()
        except BaseException as exc:
            failures.append(exc)

    with lingering_socket(60) as hostile, RawClient(daemon.socket_path) as raw:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        # Stopped meanwhile, so that this close comes first and the daemon's is the last,
        # the one that lingers (else this one lingered, 60 s: seen in CI).
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            send_fds(raw, wire.encode_message("status", {}), [hostile.fileno()])
            hostile.close()
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        other = threading.Thread(target=bystander)
        other.start()
        assert served.wait(30), failures or "another client was not served while a close lingered"
        assert raw.reply().kind == "ok"
        other.join(10)


@pytest.mark.parametrize("kind", ["pipe", "socket"])
def test_fetch_from_the_destination_into_something_else_than_a_file_is_refused(
    daemon: DaemonProcess, kind: str
) -> None:
    # The destination's threads wrote into whatever fd came: the reply was a `destination`
    # error ("Illegal seek"), blaming the destination for the client's fd.
    c = daemon.client()
    with c.generation("readers", 1) as gen:
        gen.put("big.bin", os.urandom(1 << 20))
    c.wait("readers", 1, timeout_s=30)
    if kind == "pipe":
        keep, target = os.pipe()
    else:
        a, b = socket.socketpair()
        keep, target = a.detach(), b.detach()
    try:
        with RawClient(daemon.socket_path) as raw:
            assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
            fields = {"job": "readers", "step": 1, "path": "big.bin", "source": "destination"}
            send_fds(raw, wire.encode_message("fetch", fields), [target])
            assert is_error(raw.reply(), wire.BAD_REQUEST, "regular file"), "no typed refusal"
    finally:
        os.close(keep)
        os.close(target)
    still_serves(daemon)


def test_the_directory_rule_holds_across_a_restart(daemon: DaemonProcess) -> None:
    # The directories a generation's shards imply are rebuilt from the journal.
    c = daemon.client()
    with c.generation("names", 2, rank=0, world_size=2) as gen:
        gen.put("x/y", b"file")
    daemon.stop()
    daemon.start()
    c = daemon.client()
    with c.generation("names", 2, rank=1, world_size=2) as gen:
        with pytest.raises(InvalidName, match="directory of the other"):
            gen.put("x", b"over it")
        gen.put("y", b"beside it")
    c.wait("names", 2, timeout_s=30)


@pytest.mark.parametrize("source", ["local", "destination"])
def test_a_fetch_makes_the_file_exactly_the_shard_whatever_it_held(
    daemon: DaemonProcess, tmp_path: Path, source: str
) -> None:
    # Found by attacking the readers' fetch: the copy wrote the shard at offsets 0..size and
    # left whatever the file held past that (a reader retrying into the same file, or reusing
    # a bigger one, got a file longer than the shard); the answer's checksum, of the bytes
    # written, still matched the manifest. Now the daemon empties the file first.
    c = daemon.client()
    data = os.urandom(3 << 20)
    with c.generation("readers", 1) as gen:
        gen.put("big.bin", data)
    c.wait("readers", 1, timeout_s=30)
    target = tmp_path / "into.bin"
    target.write_bytes(b"stale" * (1 << 20))  # longer than the shard
    fd = os.open(target, os.O_RDWR)
    try:
        os.lseek(fd, 0, os.SEEK_END)  # as after an earlier, cut-off attempt
        fetch = c.fetch_local if source == "local" else c.fetch_from_destination
        got = fetch("readers", 1, "big.bin", fd)
    finally:
        os.close(fd)
    assert got["size"] == len(data)
    assert target.read_bytes() == data


def test_a_fetch_of_a_generation_removed_meanwhile_says_so(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Found attacking retention: once this daemon had read a generation's manifest (a
    reader's first fetch), `gc` (or another node's retention) removing the generation left
    every further fetch of it saying "could not read ... check the destination and retry",
    a retry that never mends it. It now says the step was removed and to load a newer one."""
    c = daemon.client()
    for step in (1, 2):
        with c.generation("gone", step) as gen:
            gen.put("a.bin", b"a" * 1000)
            gen.put("b.bin", b"b" * 1000)
        c.wait("gone", step, timeout_s=30)
    fd = os.open(tmp_path / "a.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert c.fetch_from_destination("gone", 1, "a.bin", fd)["size"] == 1000
    finally:
        os.close(fd)
    gc = subprocess.run([CKPTDRAIN, "gc", daemon.dest_uri, "--job", "gone", "--keep-last",
                         "1"], capture_output=True, text=True, timeout=60)
    assert gc.returncode == 0 and "deleted 1" in gc.stdout, gc
    # And then, not "committed" from what the daemon read before.
    for said in (r"was removed from the destination while it was read.*load a newer step",
                 r"step 1 of job 'gone' is not committed"):
        fd = os.open(tmp_path / "b.bin", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with pytest.raises(NotFound, match=said):
                c.fetch_from_destination("gone", 1, "b.bin", fd)
        finally:
            os.close(fd)
    still_serves(daemon)


def test_a_fetch_of_a_shard_a_committed_step_lacks_says_so_in_a_field(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """DrainReader tells "not saved through DCP" (no .metadata in a committed step) from a
    step that is not committed by ``details.missing``, not by the message's wording."""
    c = daemon.client()
    with c.generation("nodcp", 1) as gen:
        gen.put("a.bin", b"a" * 1000)
    c.wait("nodcp", 1, timeout_s=30)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(NotFound) as lacking:
            c.fetch_from_destination("nodcp", 1, ".metadata", fd)
        assert lacking.value.details.get("missing") == "shard", lacking.value.details
        with pytest.raises(NotFound) as uncommitted:
            c.fetch_from_destination("nodcp", 2, "a.bin", fd)
        assert "missing" not in uncommitted.value.details, uncommitted.value.details
    finally:
        os.close(fd)


@pytest.mark.parametrize("source", ["local", "destination"])
def test_a_fetch_into_a_file_opened_to_append_is_refused(
    daemon: DaemonProcess, tmp_path: Path, source: str
) -> None:
    # With O_APPEND every write lands at the end, so the ranges of a shard written at their
    # offsets came out in arrival order: a scrambled file, and an answer of success (the
    # checksum is of the bytes received, which were right).
    c = daemon.client()
    with c.generation("readers", 1) as gen:
        gen.put("big.bin", os.urandom(1 << 20))
    c.wait("readers", 1, timeout_s=30)
    target = tmp_path / "into.bin"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        fetch = c.fetch_local if source == "local" else c.fetch_from_destination
        with pytest.raises(RejectedInput, match="O_APPEND"):
            fetch("readers", 1, "big.bin", fd)
    finally:
        os.close(fd)
    assert target.read_bytes() == b""
    still_serves(daemon)


@pytest.mark.parametrize("source", ["local", "destination"])
def test_a_fetch_into_a_sealed_memfd_is_the_callers_error(
    daemon: DaemonProcess, source: str
) -> None:
    # Found attacking: from the destination, a reader's memfd sealed against writes failed
    # as "permission denied ... let the daemon's user write there; check the destination",
    # sending the operator after a destination that was fine.
    c = daemon.client()
    with c.generation("sealed", 1) as gen:
        gen.put("w.bin", os.urandom(1 << 20))
    c.wait("sealed", 1, timeout_s=30)
    fd = os.memfd_create("sealed", os.MFD_ALLOW_SEALING)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        fetch = c.fetch_local if source == "local" else c.fetch_from_destination
        with pytest.raises(RejectedInput, match="file passed"):
            fetch("sealed", 1, "w.bin", fd)
    finally:
        os.close(fd)
    still_serves(daemon)


def test_a_proc_file_is_refused_not_committed_empty(daemon: DaemonProcess) -> None:
    # Found attacking from the training side: /proc files say 0 bytes and hold more; handed
    # off with put_file they were acknowledged and committed as empty shards.
    c = daemon.client()
    with c.generation("procfs", 1, rank=0, world_size=1) as gen:
        with pytest.raises(RejectedInput, match="0 bytes but has bytes"):
            gen.put_file("status", "/proc/self/status")
        gen.put_file("empty", _empty_file(daemon))  # an empty file is still a shard
    c.wait("procfs", 1, timeout_s=60)
    assert (daemon.dest / "procfs" / f"{1:020d}" / "empty").read_bytes() == b""


def test_a_file_shorter_than_its_size_is_a_size_mismatch_not_internal(daemon: DaemonProcess) -> None:
    # Found attacking from the training side: a /sys file (4096 bytes by stat, a few read),
    # or a file truncated while handed off, failed the hand-off as "internal" (a daemon bug).
    source = Path("/sys/devices/system/cpu/online")
    if not source.exists() or source.stat().st_size <= len(source.read_bytes()):
        pytest.skip("no /sys file here whose size says more than it holds")
    c = daemon.client()
    with pytest.raises(SizeMismatch, match="size is not what stat says"), \
            c.generation("sysfs", 1, rank=0, world_size=1) as gen:
        gen.put_file("online", source)
    still_serves(daemon)


def _empty_file(daemon: DaemonProcess) -> Path:
    empty = daemon.root / "empty.bin"
    empty.write_bytes(b"")
    return empty


def test_wrong_arguments_are_typed_refusals_not_raw_exceptions(daemon: DaemonProcess, tmp_path: Path) -> None:
    # Found attacking from the training side: these raised TypeError, ValueError,
    # OverflowError, or a lost connection (DaemonUnavailable), and the fetch calls skipped
    # the name checks the other calls make.
    c = daemon.client()
    source = tmp_path / "f.bin"
    source.write_bytes(b"abc")
    out = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with c.generation("args", 1, rank=0, world_size=1) as gen, open(source, "rb") as f:
            for bad in (f, 3.5, 2**40, -1, "/tmp/a\x00b"):
                with pytest.raises(RejectedInput):
                    gen.put_file("a", bad)  # type: ignore[arg-type]
            gen.put_file("a", f.fileno())  # what the refusal says to do
        for fd in (-1, 2**40, "3"):
            with pytest.raises(RejectedInput, match="file descriptor"):
                c.fetch_local("args", 1, "a", fd)  # type: ignore[arg-type]
        # A closed fd (found as a job author): the kernel refused to pass it, which read as
        # a lost connection, DaemonUnavailable "start it with `ckptdrain serve`".
        closed = os.open(tmp_path / "closed.bin", os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(closed)
        for fetch in (c.fetch_local, c.fetch_from_destination):
            with pytest.raises(RejectedInput, match="not an open file descriptor"):
                fetch("args", 1, "a", closed)
        with pytest.raises(InvalidName):
            c.fetch_local("../x", 1, "a", out)
        with pytest.raises(RejectedInput):
            c.fetch_from_destination("args", "1", "a", out)  # type: ignore[arg-type]
        with pytest.raises(RejectedInput, match="socket_path"):
            Client(5)  # type: ignore[arg-type]
        # Found as a job author: an empty path was tried as one ("Invalid argument; start it
        # with `ckptdrain serve`", DaemonUnavailable) at the first call.
        with pytest.raises(RejectedInput, match="socket_path is empty"):
            Client("")
    finally:
        os.close(out)
    still_serves(daemon)


@pytest.mark.parametrize("size", [1000, (1 << 20) + 3, 4096])
def test_a_file_opened_with_o_direct_is_handed_off(daemon: DaemonProcess, tmp_path: Path,
                                                    size: int) -> None:
    # Found attacking: an fd opened O_DIRECT whose size is not a multiple of the block size
    # failed both kernel copies (EINVAL) and the put was answered `internal`. The copy now
    # falls back to reading through an aligned buffer, which O_DIRECT takes.
    data = os.urandom(size)
    src = tmp_path / "direct.bin"
    src.write_bytes(data)
    try:
        fd = os.open(src, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        pytest.skip(f"this filesystem refuses O_DIRECT ({exc})")
    try:
        with daemon.client().generation("direct", size) as gen:
            gen.put_file("d.bin", fd)
    finally:
        os.close(fd)
    daemon.client().wait("direct", size, timeout_s=60)
    assert (daemon.dest / "direct" / f"{size:020d}" / "d.bin").read_bytes() == data


def _memfd_secret() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.syscall(447, 0))  # memfd_secret(2)
    if fd < 0:
        pytest.skip(f"memfd_secret is not available here: {os.strerror(ctypes.get_errno())}")
    return fd


@pytest.mark.parametrize("ack", ["local", "memory"])
def test_a_file_no_read_can_read_is_refused_as_the_callers(daemon: DaemonProcess,
                                                          ack: str) -> None:
    # Found attacking: a memfd_secret(2) file (regular by fstat; its bytes only mappable)
    # failed every copy with ESPIPE, answered `internal`, which says the daemon is at fault.
    fd = _memfd_secret()
    try:
        os.ftruncate(fd, 8192)
        with pytest.raises(RejectedInput, match="cannot be read") as refused, \
                daemon.client().generation("secret", 1 if ack == "local" else 2, ack=ack) as gen:
            gen.put_file("s.bin", fd)
        assert refused.value.code == wire.BAD_REQUEST
    finally:
        os.close(fd)
    still_serves(daemon)
