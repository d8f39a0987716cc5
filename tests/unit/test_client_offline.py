"""The blocking client against a tiny fake daemon: a real Unix socket, a thread per connection,
and a SERVER-role wire Connection. The real daemon's tests are in tests/functional/."""

from __future__ import annotations

import array
import contextlib
import gc
import os
import shutil
import socket
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ckptdrain.client import (
    Backpressure,
    Client,
    DaemonUnavailable,
    DrainError,
    DuplicateShard,
    GenerationFailed,
    InvalidName,
    NotFound,
    PermissionDenied,
    RejectedInput,
    Timeout,
    UnsupportedVersion,
    daemonsocket,
    wire,
)
from ckptdrain.client import channel as channel_module
from ckptdrain.client.wire import Connection, Message, Role

JOIN_TIMEOUT_S = 10.0


@dataclass
class Received:
    kind: str
    fields: dict[str, Any]
    payload: bytes | None = None  # put: the payload bytes
    fd_data: bytes | None = None  # put_fd / put_memfd: the bytes read through the passed fd
    fd_is_memfd: bool = False


# What a responder returns: reply bytes, or one of these.
CLOSE = "close"  # close the connection without a reply
SILENT = "silent"  # never reply (the client must time out)
Responder = Callable[[Connection, Received], "bytes | str"]


def default_responder(conn: Connection, msg: Received) -> bytes | str:
    if msg.kind == "hello":
        return conn.send("welcome", {"version": wire.PROTOCOL_VERSION, "node_id": "fake-node"})
    return conn.send("ok", {"kind": msg.kind})


class FakeDaemon:
    """Accepts connections on a Unix socket and answers each request via ``responder``."""

    def __init__(self, path: str, responder: Responder = default_responder) -> None:
        self.path = path
        self.responder = responder
        self.received: list[Received] = []
        self.connections = 0
        # put kind -> (code, message): refuse it at the header and close without reading it.
        self.refuse_early: dict[str, tuple[str, str]] = {}
        # Kinds after whose reply the daemon closes the connection; `closed` is set when it has.
        self.close_after: set[str] = set()
        self.closed = threading.Event()
        self.ended = threading.Semaphore(0)  # released once per connection the daemon saw end
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(16)
        self._listener.settimeout(0.05)
        self._spawn(self._accept_loop)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._socks.append(sock)
            self._spawn(self._serve, sock)

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(Role.SERVER)
        fds: deque[int] = deque()
        current: Received | None = None
        payload = bytearray()
        sock.settimeout(JOIN_TIMEOUT_S)
        try:
            while True:
                event = conn.next_event()
                if event is wire.NEED_DATA:
                    data, ancdata, _flags, _addr = sock.recvmsg(
                        1 << 16, socket.CMSG_SPACE(4 * array.array("i").itemsize)
                    )
                    for level, kind, cdata in ancdata:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            fds.extend(array.array("i", cdata[: len(cdata) - len(cdata) % 4]))
                    conn.receive_data(data)
                    continue
                if isinstance(event, wire.ConnectionClosed):
                    return
                if isinstance(event, wire.PayloadChunk):
                    payload += event.data
                    continue
                if isinstance(event, wire.PayloadEnd):
                    assert current is not None
                    current.payload = bytes(payload)
                    payload.clear()
                    msg = current
                elif isinstance(event, Message):
                    msg = Received(event.kind, event.fields)
                    if wire.needs_fd(event.kind):
                        fd = fds.popleft()
                        try:
                            msg.fd_data = os.pread(fd, os.fstat(fd).st_size, 0)
                            msg.fd_is_memfd = os.readlink(f"/proc/self/fd/{fd}").startswith(
                                "/memfd:"
                            )
                        finally:
                            os.close(fd)
                    if event.kind in self.refuse_early:
                        self.received.append(msg)
                        code, text = self.refuse_early[event.kind]
                        sock.sendall(conn.send_error(code, text))
                        return
                    if wire.takes_payload(event.kind):
                        current = msg
                        continue
                self.received.append(msg)
                reply = self.responder(conn, msg)
                if reply == CLOSE:
                    return
                if reply == SILENT:
                    # Hold the connection open, answering nothing, until the client goes away.
                    while sock.recv(1 << 16):
                        pass
                    return
                assert isinstance(reply, bytes)
                sock.sendall(reply)
                if msg.kind in self.close_after:
                    sock.close()
                    self.closed.set()
                    return
        except (OSError, wire.ProtocolError):
            return
        finally:
            for fd in fds:
                os.close(fd)
            sock.close()
            self.ended.release()

    def kinds(self) -> list[str]:
        return [r.kind for r in self.received]

    def stop(self) -> None:
        self._stopping.set()
        self._listener.close()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(JOIN_TIMEOUT_S)
            assert not thread.is_alive(), "fake daemon thread did not stop"


@pytest.fixture
def sockdir() -> Iterator[str]:
    # Short on purpose: AF_UNIX paths are limited to 107 bytes, pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="ckd-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(sockdir: str) -> Iterator[FakeDaemon]:
    fake = FakeDaemon(os.path.join(sockdir, "d.sock"))
    yield fake
    fake.stop()


@pytest.fixture
def client(daemon: FakeDaemon) -> Iterator[Client]:
    with Client(daemon.path, timeout_s=10.0, connect_timeout_s=10.0) as c:
        yield c


# --- socket path and input checks, no daemon --------------------------------------------------


def test_default_socket_path_prefers_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTDRAIN_SOCKET", "/somewhere/ck.sock")
    assert daemonsocket.default_socket_path() == "/somewhere/ck.sock"
    assert Client().socket_path == "/somewhere/ck.sock"


@pytest.mark.skipif(os.path.exists("/run/ckptdrain.sock"), reason="a system daemon is installed")
def test_default_socket_path_falls_back_to_a_per_user_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CKPTDRAIN_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert daemonsocket.default_socket_path() == f"/run/user/1234/ckptdrain-{os.getuid()}.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert daemonsocket.default_socket_path() == f"/tmp/ckptdrain-{os.getuid()}.sock"


def test_bad_input_fails_before_any_io(sockdir: str) -> None:
    c = Client(os.path.join(sockdir, "nobody-listens.sock"))
    with pytest.raises(InvalidName, match="'/'"):
        c.generation("a/b", 1)
    with pytest.raises(RejectedInput, match="step"):
        c.generation("job", -1)
    with pytest.raises(RejectedInput, match="rank 2 is out of range"):
        c.generation("job", 1, rank=2, world_size=2)
    with pytest.raises(RejectedInput, match="ack"):
        c.generation("job", 1, ack="disk")
    with pytest.raises(InvalidName):
        c.wait("..", 1)
    with pytest.raises(RejectedInput, match="timeout_s"):
        c.wait("job", 1, timeout_s=-1)
    with pytest.raises(InvalidName):
        c.latest("")
    with pytest.raises(RejectedInput, match="timeout_s"):
        Client(c.socket_path, timeout_s=float("nan"))
    # Found attacking: a client timeout of 0 (taken for "no timeout") was accepted, and every
    # call raised Timeout saying the daemon "may be overloaded or hung".
    for zero in ({"timeout_s": 0}, {"connect_timeout_s": 0.0}):
        with pytest.raises(RejectedInput, match="above 0"):
            Client(c.socket_path, **zero)
    gen = c.generation("job", 1)
    with pytest.raises(InvalidName, match="absolute"):
        gen.put("/etc/passwd", b"x")
    with pytest.raises(InvalidName, match=r"'\.\.'"):
        gen.put_file("../x", "/etc/hostname")
    with pytest.raises(RejectedInput, match="begin the generation first"):
        gen.put("ok.bin", b"x")


def test_missing_socket_is_daemon_unavailable_and_says_what_to_do(sockdir: str) -> None:
    path = os.path.join(sockdir, "missing.sock")
    with Client(path) as c, pytest.raises(DaemonUnavailable) as info:
        c.status()
    message = str(info.value)
    assert path in message and "ckptdrain serve" in message and "CKPTDRAIN_SOCKET" in message
    with pytest.raises(DaemonUnavailable, match="no socket there"):
        Client(path).generation("job", 1).__enter__()


def test_socket_nobody_listens_on_is_daemon_unavailable(sockdir: str) -> None:
    path = os.path.join(sockdir, "stale.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, as after a daemon crash
    with pytest.raises(DaemonUnavailable, match="nothing is listening"):
        Client(path).status()


def test_a_path_that_is_no_socket_is_named_as_what_it_is(sockdir: str) -> None:
    # Found as a new operator: `--socket` naming the config file (or a directory) said
    # "nothing is listening on it; start it with `ckptdrain serve`", of a running daemon.
    config = os.path.join(sockdir, "ckptdrain.toml")
    with open(config, "w") as f:
        f.write("")
    for path, what in ((config, "a file"), (sockdir, "a directory")):
        with pytest.raises(DaemonUnavailable) as info:
            Client(path).status()
        message = str(info.value)
        assert f"it is {what}, not a socket" in message, message
        assert "`socket` in its config" in message and "ckptdrain serve" not in message


def test_connect_errors_map_to_typed_errors() -> None:
    denied = channel_module.connect_error("/run/x.sock", PermissionError(13, "Permission denied"))
    assert isinstance(denied, PermissionDenied) and "/run/x.sock" in denied.message
    late = channel_module.connect_error("/run/x.sock", TimeoutError("timed out"))
    assert isinstance(late, Timeout)
    other = channel_module.connect_error("/run/x.sock", OSError(99, "Cannot assign"))
    assert isinstance(other, DaemonUnavailable) and "Cannot assign" in other.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root connects to any socket regardless of its mode")
def test_socket_without_permission_is_permission_denied(daemon: FakeDaemon) -> None:
    os.chmod(daemon.path, 0o000)
    with pytest.raises(PermissionDenied, match="not allowed to connect"):
        Client(daemon.path).status()


# --- generations --------------------------------------------------------------------------------


def test_generation_hands_off_bytes_files_fds_and_memfds_then_seals(
    daemon: FakeDaemon, client: Client, sockdir: str
) -> None:
    payload = bytearray(os.urandom(3 << 20))  # bigger than the socket buffer
    file_path = os.path.join(sockdir, "optim.bin")
    with open(file_path, "wb") as f:
        f.write(b"optimizer state" * 1000)
    memfd = os.memfd_create("shard")
    os.write(memfd, b"memory tier")
    plain_fd = os.open(file_path, os.O_RDONLY)
    try:
        with client.generation("llama-70b", 1200, rank=1, world_size=2, ack="memory") as gen:
            assert gen.node_id == "fake-node"
            # put returns the answer to the data frame: the shard is safe.
            assert gen.put("model/rank1.pt", payload) == {"kind": "data"}
            assert gen.put("empty.bin", b"") == {"kind": "data"}
            assert gen.put("ints.bin", array.array("i", [1, 2, 3])) == {"kind": "data"}
            assert gen.put_file("optim/rank1.pt", file_path) == {"kind": "put_fd"}
            gen.put_file("optim/by-fd.pt", plain_fd)
            gen.put_file("memory/rank1.bin", memfd)
        os.fstat(plain_fd)  # an fd the caller passed stays open
    finally:
        os.close(plain_fd)
        os.close(memfd)
    ident = {"job": "llama-70b", "step": 1200, "rank": 1}
    assert daemon.kinds() == [
        "hello", "begin", "put", "data", "put", "data", "put", "data",
        "put_fd", "put_fd", "put_memfd", "seal",
    ]  # fmt: skip
    r = daemon.received
    assert r[0].fields["version"] == wire.PROTOCOL_VERSION
    assert r[1].fields == {**ident, "world_size": 2, "ack": "memory"}
    assert r[2].fields == {**ident, "path": "model/rank1.pt", "size": len(payload)}
    assert r[3].payload == bytes(payload)
    assert r[4].fields["size"] == 0 and r[5].payload == b""
    assert r[6].fields["size"] == 12
    assert r[7].payload == array.array("i", [1, 2, 3]).tobytes()
    assert r[8].fd_data == b"optimizer state" * 1000 and not r[8].fd_is_memfd
    assert r[8].fields == {**ident, "path": "optim/rank1.pt", "size": 15000}
    assert r[9].fd_data == b"optimizer state" * 1000
    assert r[10].fd_data == b"memory tier" and r[10].fd_is_memfd
    assert r[11].fields == ident
    assert daemon.connections == 1


def test_default_ack_is_left_to_the_daemon(daemon: FakeDaemon, client: Client) -> None:
    with client.generation("job", 3):
        pass
    assert daemon.received[1].fields == {"job": "job", "step": 3, "rank": 0, "world_size": 1}
    assert daemon.kinds() == ["hello", "begin", "seal"]


def test_an_exception_in_the_block_aborts_and_propagates(
    daemon: FakeDaemon, client: Client
) -> None:
    with pytest.raises(ValueError, match="boom"), client.generation("job", 3) as gen:
        gen.put("a.bin", b"abc")
        raise ValueError("boom")
    assert daemon.kinds() == ["hello", "begin", "put", "data", "abort"]
    assert daemon.received[-1].fields["reason"] == "ValueError: boom"


def test_a_failing_abort_never_masks_the_original_exception(
    daemon: FakeDaemon, client: Client
) -> None:
    daemon.responder = lambda conn, msg: (
        CLOSE if msg.kind == "abort" else default_responder(conn, msg)
    )
    with pytest.raises(KeyError), client.generation("job", 3):
        raise KeyError("original")
    assert daemon.kinds()[-1] == "abort"


def test_a_dead_connection_inside_the_block_surfaces_once_and_fails_the_rest(
    daemon: FakeDaemon, client: Client
) -> None:
    daemon.responder = lambda conn, msg: (
        CLOSE if msg.kind == "put" else default_responder(conn, msg)
    )
    with pytest.raises(DaemonUnavailable, match="closed the connection"):  # noqa: SIM117
        with client.generation("job", 3) as gen:
            try:
                gen.put("a.bin", b"abc")
            finally:
                with pytest.raises(GenerationFailed, match="save the checkpoint again"):
                    gen.put("b.bin", b"abc")


def test_error_replies_become_typed_errors_and_keep_the_generation_usable(
    daemon: FakeDaemon, client: Client
) -> None:
    def respond(conn: Connection, msg: Received) -> bytes | str:
        if msg.kind == "put" and msg.fields["path"] == "dup.bin":
            return conn.send_error("duplicate", "dup.bin was already handed off")
        if msg.kind == "put" and msg.fields["path"] == "full.bin":
            return conn.send_error("backpressure", "staging full", {"retry_after_s": 2.5})
        return default_responder(conn, msg)

    daemon.responder = respond
    with client.generation("job", 3) as gen:
        with pytest.raises(DuplicateShard, match="already handed off"):
            gen.put("dup.bin", b"x")
        with pytest.raises(Backpressure) as info:
            gen.put("full.bin", b"y" * 100)
        assert info.value.retry_after_s == 2.5
        gen.put("fine.bin", b"z")
    # A refused put sends no bytes; the next one goes through on the same connection.
    assert daemon.kinds() == ["hello", "begin", "put", "put", "put", "data", "seal"]
    assert daemon.received[5].payload == b"z"
    assert daemon.connections == 1


def test_begin_refused_raises_and_leaves_nothing_open(daemon: FakeDaemon, client: Client) -> None:
    def respond(conn: Connection, msg: Received) -> bytes | str:
        if msg.kind == "begin":
            return conn.send_error("permission_denied", "job belongs to uid 1000")
        return default_responder(conn, msg)

    daemon.responder = respond
    with pytest.raises(PermissionDenied, match="uid 1000"), client.generation("job", 3):
        pytest.fail("the block must not run")  # pragma: no cover
    assert daemon.kinds() == ["hello", "begin"]


def test_a_shard_refused_while_it_is_sent_reports_the_daemons_reason(
    daemon: FakeDaemon, client: Client
) -> None:
    # As a daemon whose staging disk fills mid-shard: it answers and closes, unread bytes and all.
    daemon.refuse_early["data"] = ("backpressure", "staging is full; retry later")
    big = bytes(32 << 20)  # far more than the socket buffers hold: the send hits EPIPE
    with pytest.raises(Backpressure, match="staging is full"):  # noqa: SIM117
        with client.generation("job", 3) as gen:
            gen.put("big.bin", big)
    assert daemon.kinds() == ["hello", "begin", "put", "data"]


def test_generation_cannot_be_reused_after_it_ends(daemon: FakeDaemon, client: Client) -> None:
    gen = client.generation("job", 3)
    with gen:
        pass
    with pytest.raises(RejectedInput, match="already sealed"):
        gen.put("a.bin", b"x")
    with pytest.raises(RejectedInput, match="already begun"):
        gen.__enter__()


def test_put_rejects_non_contiguous_data_and_put_file_rejects_non_files(
    daemon: FakeDaemon, client: Client, sockdir: str
) -> None:
    with client.generation("job", 3) as gen:
        with pytest.raises(RejectedInput, match="contiguous"):
            gen.put("a.bin", memoryview(b"abcdef")[::2])
        with pytest.raises(RejectedInput, match="bytes-like"):
            not_bytes: Any = "text"
            gen.put("a.bin", not_bytes)
        with pytest.raises(RejectedInput, match="regular file"):
            gen.put_file("a.bin", sockdir)
        with pytest.raises(RejectedInput, match="cannot open"):
            gen.put_file("a.bin", os.path.join(sockdir, "missing"))
    assert daemon.kinds() == ["hello", "begin", "seal"]


# --- other calls ------------------------------------------------------------------------------


def test_wait_latest_status_retry_share_one_connection(daemon: FakeDaemon, client: Client) -> None:
    def respond(conn: Connection, msg: Received) -> bytes | str:
        if msg.kind == "latest":
            generation = 1200 if msg.fields["job"] == "known" else None
            return conn.send("ok", {"generation": generation})
        if msg.kind == "status":
            return conn.send("ok", {"jobs": {"known": {"oldest_undrained_age_s": 1.5}}})
        return default_responder(conn, msg)

    daemon.responder = respond
    assert client.wait("known", 1200, timeout_s=60) == {"kind": "wait"}
    assert client.latest("known") == 1200
    assert client.latest("fresh") is None
    assert client.status() == {"jobs": {"known": {"oldest_undrained_age_s": 1.5}}}
    assert client.retry("known", 1200) == {"kind": "retry"}
    assert daemon.kinds() == ["hello", "wait", "latest", "latest", "status", "retry"]
    assert daemon.received[1].fields == {"job": "known", "step": 1200, "timeout_s": 60.0}
    assert daemon.connections == 1


def test_error_replies_on_calls_are_typed(daemon: FakeDaemon, client: Client) -> None:
    def respond(conn: Connection, msg: Received) -> bytes | str:
        if msg.kind == "wait":
            return conn.send_error("timeout", "generation 5 not committed after 1 s")
        if msg.kind == "latest":
            return conn.send_error("not_found", "no job 'x'")
        if msg.kind == "retry":
            return conn.send_error("generation_failed", "rank 3 aborted")
        return default_responder(conn, msg)

    daemon.responder = respond
    with pytest.raises(Timeout, match="not committed"):
        client.wait("x", 5, timeout_s=1)
    with pytest.raises(NotFound):
        client.latest("x")
    with pytest.raises(GenerationFailed, match="aborted"):
        client.retry("x", 5)
    assert isinstance(client.status(), dict)
    assert daemon.connections == 1  # error replies leave the connection usable


def test_a_daemon_that_never_answers_times_out(daemon: FakeDaemon) -> None:
    daemon.responder = lambda conn, msg: (
        SILENT if msg.kind == "status" else default_responder(conn, msg)
    )
    with Client(daemon.path, timeout_s=0.2) as c:
        with pytest.raises(Timeout, match="did not finish 'status'") as timed_out:
            c.status()
        # Rounded, and pointing at the daemon's log, not at the call that just timed out.
        assert "within 0.2 s" in timed_out.value.message
        assert "hung" in timed_out.value.message and "journalctl" in timed_out.value.message
        assert "ckptdrain status" not in timed_out.value.message
        c.timeout_s = 10.0  # the next connection gets room to answer on a loaded machine
        assert c.latest("job") is None  # a fresh connection: the broken one was dropped
    assert daemon.connections == 2


def test_a_connection_dropped_mid_request_fails_only_that_request(
    daemon: FakeDaemon, client: Client
) -> None:
    dropped = threading.Event()

    def respond(conn: Connection, msg: Received) -> bytes | str:
        if msg.kind == "status" and not dropped.is_set():
            dropped.set()
            return CLOSE
        return default_responder(conn, msg)

    daemon.responder = respond
    assert client.latest("job") is None
    with pytest.raises(DaemonUnavailable, match="closed the connection without a reply"):
        client.status()
    assert client.status() == {"kind": "status"}
    assert daemon.connections == 2


def test_an_idle_connection_the_daemon_closed_is_replaced_silently(
    daemon: FakeDaemon, client: Client
) -> None:
    daemon.close_after.add("latest")  # as a daemon dropping an idle client would
    assert client.latest("job") is None
    assert daemon.closed.wait(JOIN_TIMEOUT_S)
    assert client.status() == {"kind": "status"}
    assert daemon.connections == 2


def test_version_mismatch_is_unsupported_version(daemon: FakeDaemon) -> None:
    daemon.responder = lambda conn, msg: conn.send("welcome", {"version": 99, "node_id": "n"})
    with pytest.raises(UnsupportedVersion, match="version 99"):
        Client(daemon.path).status()
    daemon.responder = lambda conn, msg: conn.send_error("unsupported_version", "daemon speaks 2")
    with pytest.raises(UnsupportedVersion, match="daemon speaks 2"):
        Client(daemon.path).status()


def test_garbage_from_the_daemon_is_a_drain_error(daemon: FakeDaemon) -> None:
    daemon.responder = lambda conn, msg: b"HTTP/1.1 400 Bad Request\r\n\r\n"
    with pytest.raises(DrainError, match=r"invalid reply to 'hello'.*bad magic"):
        Client(daemon.path).status()


def test_a_closed_client_refuses_new_work(daemon: FakeDaemon) -> None:
    c = Client(daemon.path)
    assert c.status() == {"kind": "status"}
    c.close()
    with pytest.raises(RejectedInput, match="closed"):
        c.status()


def test_a_client_dropped_without_close_closes_its_pooled_connection(daemon: FakeDaemon) -> None:
    c = Client(daemon.path)
    assert c.status() == {"kind": "status"}
    del c
    gc.collect()
    # The daemon sees EOF: the pooled socket was closed (no ResourceWarning, no leaked fd).
    assert daemon.ended.acquire(timeout=JOIN_TIMEOUT_S)


def test_a_full_listen_backlog_is_waited_out_not_taken_for_no_daemon(tmp_path: Any) -> None:
    # Found attacking the daemon with a connect flood: a Unix socket's connect with a timeout
    # fails at once with EAGAIN while the listen backlog is full, and every other user's
    # client raised DaemonUnavailable ("Resource temporarily unavailable") meanwhile.
    path = str(tmp_path / "backlog.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    filler.connect(path)  # the backlog holds one: full now
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1)
    with pytest.raises(BlockingIOError):
        probe.connect(path)  # what the client's connect meets
    probe.close()

    def busy_daemon() -> None:
        # Busy for a moment, then it accepts the connection ahead and the client's.
        threading.Event().wait(0.3)
        first, _ = listener.accept()
        first.close()
        sock, _ = listener.accept()
        with sock:
            conn = Connection(Role.SERVER)
            while (event := conn.next_event()) is wire.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            assert isinstance(event, Message) and event.kind == "hello"
            sock.sendall(conn.send("welcome", {"version": wire.PROTOCOL_VERSION, "node_id": "n"}))
            sock.recv(1)  # until the client closes

    server = threading.Thread(target=busy_daemon, daemon=True)
    server.start()
    try:
        channel = channel_module.Channel.open(path, timeout_s=5, connect_timeout_s=5)
        assert channel.node_id == "n"
        channel.close()
    finally:
        filler.close()
        server.join(JOIN_TIMEOUT_S)
        listener.close()
    assert not server.is_alive()


def test_the_connect_and_the_hello_share_one_connect_timeout(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found attacking: a connect that waited out a full backlog gave the hello a fresh
    # connect_timeout_s, and Channel.open took twice as long as it was told.
    path = str(tmp_path / "slow.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    filler.connect(path)
    let_go = threading.Event()
    hello_timeouts: list[float] = []
    request = channel_module.Channel.request

    def spy(self: Any, kind: str, fields: Any, **kw: Any) -> Any:
        if kind == "hello":
            hello_timeouts.append(kw["timeout_s"])
        return request(self, kind, fields, **kw)

    monkeypatch.setattr(channel_module.Channel, "request", spy)

    def daemon_that_never_answers() -> None:
        let_go.wait(0.6)  # the backlog stays full at least this long
        first, _ = listener.accept()
        first.close()
        sock, _ = listener.accept()
        with sock:
            let_go.wait(JOIN_TIMEOUT_S)  # and the hello is never answered

    server = threading.Thread(target=daemon_that_never_answers, daemon=True)
    server.start()
    try:
        with pytest.raises(Timeout):
            channel_module.Channel.open(path, timeout_s=5, connect_timeout_s=1.0)
    finally:
        let_go.set()
        filler.close()
        server.join(JOIN_TIMEOUT_S)
        listener.close()
    # The connect took at least 0.6 s of the 1.0: the hello had what was left, not 1.0.
    [hello_timeout] = hello_timeouts
    assert hello_timeout <= 0.4, hello_timeout


@pytest.mark.parametrize("bad", [-1, 1.5, "1GiB", True, None])
def test_a_memfd_pool_size_that_is_no_byte_count_is_refused(bad: object) -> None:
    with pytest.raises(RejectedInput, match="memfd_pool_bytes"):
        Client("/nonexistent.sock", memfd_pool_bytes=bad)  # type: ignore[arg-type]


def test_a_pickled_client_keeps_its_memfd_pool_size() -> None:
    import pickle

    c = Client("/nonexistent.sock", memfd_pool_bytes=12345)
    assert pickle.loads(pickle.dumps(c))._memfds.max_idle_bytes == 12345
    c.close()
