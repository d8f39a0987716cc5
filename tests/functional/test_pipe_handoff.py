"""A put's bytes through a pipe (``data_pipe``): the client vmsplice()s its buffer and the
daemon splices it into the staged file, one copy instead of two. What a well-behaved client
gets (byte-equal commits, whatever the buffer), when it falls back to the socket, and what a
hostile one gets (a typed refusal or a cut-off; the daemon and everyone else carry on)."""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import platform
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Backpressure, DrainError, SizeMismatch, pipes, wire
from ckptdrain.daemon.fdcloser import MAX_FDS_HELD_PER_UID, MAX_PIPE_CLOSES_PER_UID
from tests.conftest import DaemonProcess, wait_for
from tests.functional.test_bad_input import RawClient
from tests.functional.test_failure_boundary import still_serves
from tests.functional.test_fd_requests import is_error, send_fds

MiB = 1 << 20


@pytest.fixture
def spliced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """(bytes vmspliced, shard size) of every put that went through a pipe."""
    seen: list[tuple[int, int]] = []
    finish = pipes.PipeHandOff.finish

    def recorded(self: pipes.PipeHandOff, deadline: float, reply_fd: int) -> None:
        finish(self, deadline, reply_fd)
        seen.append((self.sent, self._view.nbytes))

    monkeypatch.setattr(pipes.PipeHandOff, "finish", recorded)
    yield seen


def committed_bytes(d: DaemonProcess, job: str, step: int, path: str) -> bytes:
    return (d.dest / job / f"{step:020d}" / path).read_bytes()


def saved_over_the_socket(d: DaemonProcess, job: str, spliced: list[tuple[int, int]]) -> None:
    """A 2 MiB put commits byte-equal, and not through a pipe."""
    blob = os.urandom(2 * MiB)
    c = d.client()
    with c.generation(job, 1) as gen:
        gen.put("a.bin", blob)
    c.wait(job, 1, timeout_s=60)
    assert committed_bytes(d, job, 1, "a.bin") == blob
    assert spliced == []


def test_large_puts_of_every_kind_of_buffer_go_through_the_pipe_byte_equal(
        daemon: DaemonProcess, spliced: list[tuple[int, int]]) -> None:
    blob = os.urandom(9 * MiB + 5)
    buffers: dict[str, Any] = {
        "bytes.bin": blob,
        "bytearray.bin": bytearray(blob[: 3 * MiB]),
        "slice.bin": memoryview(blob)[7: 2 * MiB + 7],  # read-only, starting mid-page
        "ints.bin": memoryview(bytearray(blob[: 4 * MiB])).cast("I"),  # not bytes-shaped
    }
    c = daemon.client()
    with c.generation("piped", 1) as gen:
        for path, buf in buffers.items():
            assert gen.put(path, buf)["size"] == memoryview(buf).nbytes
    c.wait("piped", 1, timeout_s=60)
    for path, buf in buffers.items():
        assert committed_bytes(daemon, "piped", 1, path) == bytes(memoryview(buf).cast("B"))
    assert sorted(spliced) == sorted((memoryview(b).nbytes,) * 2 for b in buffers.values())


def test_with_sigpipe_not_ignored_the_put_goes_over_the_socket(
        daemon: DaemonProcess, spliced: list[tuple[int, int]]) -> None:
    # A reader that went away would raise SIGPIPE in the writer: a process that lets
    # SIGPIPE end it must never write into a pipe.
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        saved_over_the_socket(daemon, "socketed", spliced)
    finally:
        signal.signal(signal.SIGPIPE, previous)


def admitted(raw: RawClient, path: str, size: int) -> None:
    reply = raw.call("put", job="bad", step=1, rank=0, path=path, size=size)
    assert reply.kind == "ok" and reply.fields == {"ready": True, "pipe": True}, reply


def data_pipe(raw: RawClient, fd: int) -> Any:
    send_fds(raw, wire.encode_message("data_pipe", {}), [fd])
    return raw.reply()


def pipe_not_offered(raw: RawClient, path: str) -> None:
    """The put's ok offers no pipe, and a data_pipe sent anyway is refused."""
    reply = raw.call("put", job="bad", step=1, rank=0, path=path, size=4096)
    assert reply.kind == "ok" and reply.fields == {"ready": True, "pipe": False}, reply
    r, w = os.pipe()
    os.write(w, b"x" * 4096)
    reply = data_pipe(raw, r)
    os.close(r)
    os.close(w)
    assert is_error(reply, wire.BAD_REQUEST, "no pipe was offered"), reply


def test_a_pipe_that_ends_short_or_runs_over_is_a_size_error_and_the_conversation_goes_on(
        daemon: DaemonProcess) -> None:
    with RawClient(daemon.socket_path) as raw:
        raw.hello_begin()
        for path, written in (("short.bin", 1000), ("long.bin", 5000)):
            admitted(raw, path, 4096)
            r, w = os.pipe()
            os.write(w, b"s" * written)
            if written < 4096:
                os.close(w)
            reply = data_pipe(raw, r)
            os.close(r)
            if written > 4096:
                os.close(w)
            assert is_error(reply, wire.SIZE_MISMATCH, "pipe"), reply
        # Refused shards are not kept: the same paths go through in full.
        for path in ("short.bin", "long.bin"):
            admitted(raw, path, 4096)
            r, w = os.pipe()
            os.write(w, b"k" * 4096)
            reply = data_pipe(raw, r)
            os.close(r)
            os.close(w)
            assert reply.kind == "ok" and reply.fields["size"] == 4096, reply
        assert raw.call("seal", job="bad", step=1, rank=0).kind == "ok"
    daemon.client().wait("bad", 1, timeout_s=60)
    assert committed_bytes(daemon, "bad", 1, "long.bin") == b"k" * 4096
    still_serves(daemon)


@pytest.mark.parametrize("what", ["regular file", "socket", "write end", "none", "O_PATH"])
def test_data_pipe_with_something_else_is_a_typed_refusal(
        daemon: DaemonProcess, tmp_path: Path, what: str) -> None:
    with RawClient(daemon.socket_path) as raw:
        raw.hello_begin()
        admitted(raw, "x.bin", 100)
        if what == "none":
            raw.sock.sendall(wire.encode_message("data_pipe", {}))
            reply, fragment = raw.reply(), "without a file descriptor"
        elif what == "socket":
            a, b = socket.socketpair()
            with a, b:
                reply, fragment = data_pipe(raw, a.fileno()), "not the read end of a pipe"
        elif what == "write end":
            # Found by attack: splicing from it failed EBADF, reported as `internal`.
            r, w = os.pipe()
            os.write(w, b"w" * 100)
            reply, fragment = data_pipe(raw, w), "not the read end of a pipe"
            os.close(r)
            os.close(w)
        elif what == "O_PATH":
            # Found attacking: an O_PATH fd of a FIFO (its access mode reads O_RDONLY) was
            # taken for a pipe, and answered `internal` (EBADF), a daemon bug, logged nowhere.
            os.mkfifo(tmp_path / "fifo")
            fd = os.open(tmp_path / "fifo", os.O_PATH)
            reply, fragment = data_pipe(raw, fd), "not the read end of a pipe"
            os.close(fd)
        else:
            (tmp_path / "f").write_bytes(b"f" * 100)
            fd = os.open(tmp_path / "f", os.O_RDONLY)
            reply, fragment = data_pipe(raw, fd), "not the read end of a pipe"
            os.close(fd)
        assert is_error(reply, wire.BAD_REQUEST, fragment), reply
        assert raw.call("status").kind == "ok"  # the connection goes on
    still_serves(daemon)


def test_a_pipe_held_open_and_silent_frees_its_room_and_the_daemon_serves_others(
        make_daemon: Any) -> None:
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__CLIENT_MIN_BYTES_PER_S="65536",
                                   CKPTDRAIN_LIMITS__CLIENT_RATE_GRACE_S="1.0",
                                   CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="64MiB",
                                   CKPTDRAIN_LIMITS__ON_FULL="reject")
    r, w = os.pipe()  # blocking: the daemon's thread must not wait on it
    try:
        with RawClient(d.socket_path) as raw:
            raw.hello_begin()
            admitted(raw, "big.bin", 60 * MiB)  # nearly all of the staging budget
            send_fds(raw, wire.encode_message("data_pipe", {}), [r])
            answer = raw.raw(b"")  # cut off within grace + size / rate: ~1 s
        assert b"timeout" in answer and b"client_min_bytes_per_s" in answer
    finally:
        os.close(r)
        os.close(w)
    # The room is back: a shard needing most of it is taken.
    c = d.client()
    with c.generation("after", 1) as gen:
        gen.put("big.bin", os.urandom(60 * MiB))
    c.wait("after", 1, timeout_s=60)
    still_serves(d)


def test_the_client_raises_size_mismatch_when_the_daemon_refuses_its_pipe(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    # A client whose pipe ends early (here: one that stops splicing half way) hears why,
    # as a typed error, and its connection stays usable.
    finish = pipes.PipeHandOff.finish

    def half(self: pipes.PipeHandOff, deadline: float, reply_fd: int) -> None:
        self._view = self._view[: self._view.nbytes // 2]
        finish(self, deadline, reply_fd)

    monkeypatch.setattr(pipes.PipeHandOff, "finish", half)
    c = daemon.client()
    with c.generation("halved", 1) as gen:
        with pytest.raises(SizeMismatch, match="pipe ended after"):
            gen.put("a.bin", os.urandom(4 * MiB))
        monkeypatch.setattr(pipes.PipeHandOff, "finish", finish)
        gen.put("a.bin", b"whole" * MiB)
    c.wait("halved", 1, timeout_s=60)
    assert committed_bytes(daemon, "halved", 1, "a.bin") == b"whole" * MiB


def test_where_the_kernel_refuses_a_full_size_pipe_the_put_goes_over_the_socket(
        daemon: DaemonProcess, spliced: list[tuple[int, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the user's pipe quota (pipe-user-pages-soft, which a test cannot set) the
    # kernel refuses F_SETPIPE_SZ: a pipe of a few pages would cost a syscall per few
    # pages, so the socket takes the shard. The refusal is injected into this process.
    real = fcntl.fcntl
    refused: list[int] = []

    def quota(fd: int, cmd: int, arg: int = 0) -> Any:
        if cmd == fcntl.F_SETPIPE_SZ:
            refused.append(arg)
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real(fd, cmd, arg)

    monkeypatch.setattr(pipes.fcntl, "fcntl", quota)
    saved_over_the_socket(daemon, "quota", spliced)
    assert refused == [1 << 20]


_SPLICE_SYSCALL = {"x86_64": 275, "aarch64": 76}[platform.machine()]


def in_splice(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside splice(2) now (its first field in /proc/.../syscall)."""
    syscall = Path(f"/proc/self/task/{thread.native_id}/syscall").read_text().split()
    return bool(syscall) and syscall[0] == str(_SPLICE_SYSCALL)


@contextlib.contextmanager
def pipe_lock_held(end: str) -> Iterator[int]:
    """One end of a pipe whose kernel lock this process holds: a thread's blocking splice
    from an empty socket into another file opened on the same pipe keeps the lock until a
    byte comes. Every read and the last close of the pipe wait for it, uninterruptibly.
    Yields the end to pass; the lock is let go on leaving."""
    r, w = os.pipe()
    other = os.open(f"/proc/self/fd/{w}", os.O_WRONLY)
    a, b = socket.socketpair()
    hog = threading.Thread(target=lambda: os.splice(a.fileno(), other, 1))
    hog.start()
    try:
        wait_for(lambda: in_splice(hog), timeout_s=10)
        yield r if end == "read" else w
    finally:
        b.send(b"z")
        hog.join(10)
        for fd in (r, w, other):
            with contextlib.suppress(OSError):
                os.close(fd)
        a.close()
        b.close()


def pipe_locked_daemon(make_daemon: Any) -> DaemonProcess:
    return make_daemon(  # type: ignore[no-any-return]
        CKPTDRAIN_LIMITS__CLIENT_IDLE_TIMEOUT_S="2", CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="64MiB",
        CKPTDRAIN_LIMITS__ON_FULL="reject")


def test_a_write_end_whose_lock_its_client_holds_never_blocks_the_event_loop(
        make_daemon: Any) -> None:
    """Found by attack: the refused pipe was closed on the event loop, and the last close
    of a pipe waits for its lock: the daemon stopped answering everyone."""
    d = pipe_locked_daemon(make_daemon)
    with pipe_lock_held("write") as fd, RawClient(d.socket_path) as raw:
        raw.hello_begin()
        admitted(raw, "w.bin", 4096)
        send_fds(raw, wire.encode_message("data_pipe", {}), [fd])
        os.close(fd)  # the daemon's copy is now the last reference
        assert is_error(raw.reply(), wire.BAD_REQUEST, "not the read end"), d.log()
        with d.client(timeout_s=10) as c:
            assert c.status()["node_id"] == "node-a"
        assert raw.call("status").kind == "ok"
    still_serves(d)


def test_a_read_end_whose_lock_its_client_holds_is_given_up_on_and_frees_its_room(
        make_daemon: Any) -> None:
    """Found by attack: the pump's thread waited in the kernel for the lock, past the idle
    timeout and the rate floor, holding the shard's staging room until the client let go."""
    d = pipe_locked_daemon(make_daemon)
    with pipe_lock_held("read") as fd, RawClient(d.socket_path) as raw:
        raw.hello_begin()
        admitted(raw, "big.bin", 60 * MiB)  # nearly all of the staging budget
        send_fds(raw, wire.encode_message("data_pipe", {}), [fd])
        os.close(fd)
        reply = raw.reply()
        assert is_error(reply, wire.TIMEOUT, "stopped moving"), reply
        with d.client(timeout_s=10) as c:
            assert c.status()["io_threads"]["stuck"] == 1
            with c.generation("after", 1) as gen:  # the room is back
                gen.put("big.bin", os.urandom(60 * MiB))
            c.wait("after", 1, timeout_s=60)
        assert raw.call("status").kind == "ok"  # this client's conversation goes on
        # Found by the second attack: one connection wedged the whole pump pool, a put at a
        # time. A uid with a wedged pump is offered no pipe (its puts go over the socket),
        # and a pipe sent anyway is refused.
        pipe_not_offered(raw, "next.bin")
        assert raw.call("status").kind == "ok"
    # Let go: the thread comes back, closes the pipe, and is no longer counted; the uid is
    # offered pipes again.
    with d.client(timeout_s=10) as c:
        wait_for(lambda: c.status()["io_threads"]["stuck"] == 0, timeout_s=20)
    with RawClient(d.socket_path) as raw:
        raw.hello_begin(job="again")
        reply = raw.call("put", job="again", step=1, rank=0, path="a.bin", size=10)
        assert reply.fields == {"ready": True, "pipe": True}, reply
    # No temp file stays (the last client left an admitted put: its file goes once the
    # daemon sees it gone).
    wait_for(lambda: not list((d.root / "staging" / "shards").glob("*.tmp")), timeout_s=20)
    still_serves(d)


def test_a_reader_forked_off_the_client_does_not_hide_the_daemons_refusal(
        make_daemon: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by attack: with another read end open (a child forked mid-put), the daemon's
    cut-off never showed as EPIPE, and the client waited out its whole timeout before a
    generic Timeout. It now watches the socket and reads the daemon's reason."""
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__CLIENT_MIN_BYTES_PER_S="4MiB",
                                   CKPTDRAIN_LIMITS__CLIENT_RATE_GRACE_S="1.0")
    kept: list[int] = []
    handed_over = pipes.PipeHandOff.handed_over
    splice_some = pipes.PipeHandOff._splice_some

    def like_a_fork(self: pipes.PipeHandOff) -> None:
        kept.append(os.dup(self.read_fd))  # what a forked child would hold
        handed_over(self)

    def slowly(self: pipes.PipeHandOff) -> int:
        time.sleep(0.05)
        view, self._view = self._view, self._view[: self.sent + 4096]
        try:
            return splice_some(self)
        finally:
            self._view = view

    monkeypatch.setattr(pipes.PipeHandOff, "handed_over", like_a_fork)
    monkeypatch.setattr(pipes.PipeHandOff, "_splice_some", slowly)
    try:
        c = d.client(timeout_s=30)
        with pytest.raises(DrainError) as info, c.generation("slow", 1) as gen:
            gen.put("a.bin", os.urandom(64 * MiB))
        # The daemon's reason, not the client's own Timeout after 30 s.
        assert "client_min_bytes_per_s" in str(info.value), info.value
    finally:
        for fd in kept:
            os.close(fd)
    still_serves(d)


def daemon_fds(d: DaemonProcess) -> int:
    assert d.proc is not None
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def test_wedged_pipe_closes_never_hold_up_the_closes_of_other_clients_fds(
        daemon: DaemonProcess) -> None:
    """Found by the second attack: the last close of a pipe whose client holds its lock
    wedged the daemon's two closer threads, and every fd any client passed piled up."""
    with contextlib.ExitStack() as held:
        for _ in range(3):  # more than the closer's threads
            fd = held.enter_context(pipe_lock_held("write"))
            raw = held.enter_context(RawClient(daemon.socket_path))
            assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
            send_fds(raw, wire.encode_message("status", {}), [fd])  # a frame that takes none
            # The daemon's copy is now the last one, unless the daemon closed it first: then
            # this close is the last, and waits (uninterruptibly) for the lock this process
            # holds until the end of the test. In a thread of its own, so that it never wedges
            # the test itself (it did once, under load, and hung the whole run).
            threading.Thread(target=os.close, args=(fd,), daemon=True).start()
            assert raw.reply().kind == "ok"
        before = daemon_fds(daemon)
        with RawClient(daemon.socket_path) as raw:
            assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
            for _ in range(50):
                null = os.open(os.devnull, os.O_RDONLY)
                send_fds(raw, wire.encode_message("status", {}), [null])
                os.close(null)
                assert raw.reply().kind == "ok"
        # Every /dev/null is closed while the three pipes' closes still wait.
        wait_for(lambda: daemon_fds(daemon) <= before, timeout_s=20)
    still_serves(daemon)


def test_with_pipe_handoff_off_no_pipe_is_offered_or_taken(
        make_daemon: Any, spliced: list[tuple[int, int]]) -> None:
    # limits.pipe_handoff = false: for nodes whose local users are not trusted not to wedge
    # a thread on a pipe's lock. Puts go over the socket; a pipe sent anyway is refused.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__PIPE_HANDOFF="false")
    with RawClient(d.socket_path) as raw:
        raw.hello_begin()
        pipe_not_offered(raw, "x.bin")
    saved_over_the_socket(d, "off", spliced)


@contextlib.contextmanager
def read_ends_held(count: int) -> Iterator[list[int]]:
    """``count`` pipes' read ends, each pipe's lock held by a thread of this process (as in
    pipe_lock_held); once passed, this process closes its own copy (taking it out of the
    list), so the daemon's close is the last, and waits for the lock. The locks are let go
    on leaving, and the ends still in the list closed then."""
    opened: list[int] = []
    socks: list[socket.socket] = []
    hogs: list[threading.Thread] = []
    ends: list[int] = []
    try:
        for _ in range(count):
            r, w = os.pipe()
            other = os.open(f"/proc/self/fd/{w}", os.O_WRONLY)
            opened += [w, other]
            a, b = socket.socketpair()
            socks += [a, b]
            hog = threading.Thread(target=lambda a=a, other=other: os.splice(a.fileno(), other, 1))
            hog.start()
            hogs.append(hog)
            ends.append(r)
        for hog in hogs:
            wait_for(lambda hog=hog: in_splice(hog), timeout_s=10)
        yield ends
    finally:
        for b in socks[1::2]:
            b.send(b"z")
        for hog in hogs:
            hog.join(10)
        for fd in opened + ends:
            with contextlib.suppress(OSError):
                os.close(fd)
        for s in socks:
            s.close()


def _pass_last_close(d: DaemonProcess, raw: RawClient, r: int) -> bool:
    """Pass read end ``r`` on a frame that takes no fd, so that the daemon's close of it is
    the last one (which waits for the pipe's lock); False when the daemon hung up. The daemon
    is stopped meanwhile, so that this process's close of its copy comes first (else it is
    the last close, and waits for the lock its own thread holds)."""
    assert d.proc is not None
    d.proc.send_signal(signal.SIGSTOP)
    try:
        send_fds(raw, wire.encode_message("latest", {"job": "j"}), [r])
    except OSError:  # hung up on after its last word
        return False
    finally:
        os.close(r)  # the daemon's is the last close now
        d.proc.send_signal(signal.SIGCONT)
    return True


def test_a_user_holding_the_locks_of_the_pipes_it_passed_is_served_no_more(
        make_daemon: Any) -> None:
    # Found attacking: the daemon closes a pipe a client passes in a thread of its own, as
    # its last close waits for the pipe's lock, which the client can hold. 330 such pipes
    # (passed on frames that take no fd) wedged all 256 of those threads, then both threads
    # that close every other fd, and /dev/null fds passed after them were never closed: the
    # daemon ran out of fds, and every user with it. Now a uid with MAX_PIPE_CLOSES_PER_UID
    # closes waiting is served no more till they end, and past the threads they wait their
    # turn, never in the shared closer.
    d: DaemonProcess = make_daemon()
    assert d.proc is not None
    fds_before = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
    with read_ends_held(MAX_PIPE_CLOSES_PER_UID + 8) as ends:
        with RawClient(d.socket_path) as raw:
            assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
            answers = []
            while ends:
                if not _pass_last_close(d, raw, ends.pop()):
                    break
                try:
                    answers.append(raw.reply())
                except OSError:
                    break
                if answers[-1].kind == "error":
                    break
            refusal = answers[-1]
            assert is_error(refusal, wire.BACKPRESSURE, "holds the lock of a pipe"), answers
            assert refusal.fields["details"]["limit"] == "pipes_held"
            assert len(answers) <= MAX_PIPE_CLOSES_PER_UID + 1, len(answers)
        with pytest.raises(Backpressure, match="holds the lock of a pipe"):
            d.client().status()  # a new connection of the same uid: not served either
    # The locks let go, the closes end, and the uid is served again.
    wait_for(lambda: len(os.listdir(f"/proc/{d.proc.pid}/fd")) <= fds_before + 2)
    assert d.client().status()["node_id"]
    still_serves(d)


def test_the_connections_of_a_user_whose_closes_are_wedged_hold_no_fds_of_the_daemons(
        make_daemon: Any) -> None:
    # Found attacking a shared node: once a uid's closes were wedged (it held the locks of
    # the pipes it passed), each connection it opened after was refused (pipes_held) and its
    # socket's close waited in that uid's line behind them, an fd of the daemon's held open.
    # One user reconnecting in a loop had the daemon at its fd limit within a minute, and
    # every other user's connect timed out. A socket with no fd queued in it is closed at
    # once: its close cannot wait on anything.
    d: DaemonProcess = make_daemon()
    assert d.proc is not None
    with read_ends_held(MAX_PIPE_CLOSES_PER_UID + 2) as ends:
        with RawClient(d.socket_path) as raw:
            assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
            while ends:
                if not _pass_last_close(d, raw, ends.pop()):
                    break
                try:
                    if raw.reply().kind == "error":
                        break
                except OSError:
                    break
        with pytest.raises(Backpressure, match="holds the lock of a pipe"):
            d.client().status()
        before = daemon_fds(d)
        for _ in range(3):  # rounds of connections, each refused as pipes_held
            socks = []
            for _ in range(50):
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(d.socket_path))
                s.sendall(wire.encode_message("hello", {"version": wire.PROTOCOL_VERSION}))
                socks.append(s)
            for s in socks:
                s.settimeout(30)
                assert b"pipes_held" in s.recv(65536)
                s.close()
        # Every one of their sockets is closed while the pipes' closes still wait.
        wait_for(lambda: daemon_fds(d) <= before + 2, timeout_s=20)
    # The locks let go, the pipes' closes end (and the uid is served again).
    wait_for(lambda: daemon_fds(d) < before)
    still_serves(d)


def test_a_connection_refused_with_a_locked_pipe_queued_never_blocks_the_event_loop(
        make_daemon: Any) -> None:
    # Found attacking: a connection's last close drops the fds queued in it unread. A client
    # queued a pipe whose lock it holds behind its connect, and the daemon refused the
    # connection (here at limits.max_clients) and closed it on the event loop, which waited
    # in that close for the lock: every client of the node hung with it.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_CLIENTS="1")
    assert d.proc is not None
    with d.client(timeout_s=10) as first, read_ends_held(1) as ends:
        r = ends.pop()
        assert first.status()["node_id"]  # holds the one connection allowed
        late = socket.socket(socket.AF_UNIX)
        # Stopped, so that the pipe is queued before the daemon accepts (the kernel completes
        # a connect into the listen backlog by itself).
        d.proc.send_signal(signal.SIGSTOP)
        try:
            late.connect(str(d.socket_path))
            late.sendmsg([wire.encode_message("hello", {"version": wire.PROTOCOL_VERSION})],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
            os.close(r)  # the daemon's reference, queued in the connection, is the last
        finally:
            d.proc.send_signal(signal.SIGCONT)
        refused = late.recv(65536)
        assert b"max_clients" in refused
        late.close()
        # The loop goes on while that close waits for the lock.
        assert first.status()["node_id"]
        assert first.latest("nothing") is None


def test_a_frame_with_more_fds_than_taken_never_blocks_the_event_loop(
        make_daemon: Any) -> None:
    # Found attacking the fix above: the daemon received at most 4 fds a message, and the
    # kernel dropped the rest inside recvmsg, on the event loop; a fifth fd, a pipe whose lock
    # its client held, made that drop its last close, and the loop waited for the lock. Every
    # fd a message can carry is received now, and the ones too many are closed off the loop.
    d: DaemonProcess = make_daemon()
    assert d.proc is not None
    nulls = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]
    with d.client(timeout_s=10) as other, read_ends_held(1) as ends:
        r = ends.pop()
        with RawClient(d.socket_path) as raw:
            assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
            d.proc.send_signal(signal.SIGSTOP)  # so that this process's close comes first
            try:
                send_fds(raw, wire.encode_message("status", {}), [*nulls, r])
            finally:
                os.close(r)
                for fd in nulls:
                    os.close(fd)
                d.proc.send_signal(signal.SIGCONT)
            assert is_error(raw.reply(), wire.BAD_REQUEST, "more than 4 file descriptors")
        assert other.status()["node_id"]  # the loop goes on while that close waits



def test_a_uid_is_not_read_from_while_it_holds_too_many_fds_however_many_connections_it_has(
        make_daemon: Any) -> None:
    # Found attacking the per-uid cap on pipe closes: it was checked between requests only.
    # 80 connections of one uid (60 here), each already waiting for its next frame, got a frame
    # with 4 pipes whose locks the uid held, and every one was read and served: 240 fds in
    # the daemon's table, and as many closes waiting, from one user (with 512 connections of
    # 253 fds each, more than the unit's LimitNOFILE). Now a uid holding MAX_FDS_HELD_PER_UID
    # fds is not read from: what it sends stays in its sockets, and it is refused.
    d: DaemonProcess = make_daemon()
    assert d.proc is not None
    connections = 60
    with contextlib.ExitStack() as stack, read_ends_held(4 * connections) as ends:
        raws = [stack.enter_context(RawClient(d.socket_path)) for _ in range(connections)]
        for raw in raws:
            assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        before = daemon_fds(d)
        # Stopped meanwhile, so that this process's close of its copies comes first.
        d.proc.send_signal(signal.SIGSTOP)
        try:
            for raw in raws:
                passed, ends[:4] = ends[:4], []
                send_fds(raw, wire.encode_message("status", {}), passed)
                for fd in passed:
                    os.close(fd)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        answers = []
        for raw in raws:
            try:
                answers.append(raw.reply())
            except OSError:  # hung up on after its last word
                answers.append(None)
        served = sum(1 for a in answers if a is not None and a.kind == "ok")
        refused = [a for a in answers if a is not None and a.kind == "error"]
        assert served <= MAX_FDS_HELD_PER_UID // 4 + 1, answers
        assert refused and all(is_error(a, wire.BACKPRESSURE, "holds the lock of a pipe")
                               and a.fields["details"]["limit"] == "pipes_held"
                               for a in refused), refused
        # At most one message's fds past the cap reached the daemon's fd table.
        assert daemon_fds(d) - before <= MAX_FDS_HELD_PER_UID + 4, daemon_fds(d) - before
    # The locks let go, every close ends, and the uid is served again.
    wait_for(lambda: daemon_fds(d) <= before - connections + 2, timeout_s=20)
    still_serves(d)


def test_the_closes_of_refused_put_fds_are_charged_to_their_uid(make_daemon: Any) -> None:
    # Found attacking the per-uid accounting: a put_fd refused before its hand-off (here: its
    # rank aborted) closed the fd charged to nobody. 600 pipes whose locks the client held,
    # passed that way on one connection, were all served, 604 fds in the daemon's table, and
    # their closes queued where other users' waited. Every close is now charged to an owner.
    d: DaemonProcess = make_daemon()
    with read_ends_held(MAX_PIPE_CLOSES_PER_UID + 8) as ends, RawClient(d.socket_path) as raw:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        shard = {"job": "refused", "step": 1, "rank": 0}
        assert raw.call("begin", **shard, world_size=1).kind == "ok"
        assert raw.call("abort", **shard, reason="to refuse the puts").kind == "ok"
        answers = []
        for i in range(len(ends)):
            r = ends.pop()
            frame = wire.encode_message("put_fd", {**shard, "path": f"p{i}", "size": 10})
            send_fds(raw, frame[:1], [r])  # on the first byte, the rest after our close:
            os.close(r)  # the daemon's close is then the last, and waits for the lock
            raw.sock.sendall(frame[1:])
            try:
                answers.append(raw.reply())
            except OSError:  # hung up on after its last word
                break
            if is_error(answers[-1], wire.BACKPRESSURE, "holds the lock of a pipe"):
                break
        assert is_error(answers[-1], wire.BACKPRESSURE, "holds the lock of a pipe"), answers
        assert len(answers) <= MAX_PIPE_CLOSES_PER_UID + 1, len(answers)
    still_serves(d)
