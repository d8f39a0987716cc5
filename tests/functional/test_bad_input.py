"""Hostile and broken clients: each gets a typed error, the daemon stays up, others carry on."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import (
    DuplicateShard,
    InvalidName,
    RejectedInput,
    SizeMismatch,
    wire,
)
from tests.conftest import DaemonProcess
from tests.functional import otheruser


class RawClient:
    """Speaks the wire protocol without the client's own checks, to send what it would refuse."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(20)
        self.sock.connect(str(path))
        self.conn = wire.Connection(wire.Role.CLIENT)

    def reply(self) -> Any:
        while True:
            ev = self.conn.next_event()
            if ev is wire.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
                continue
            return ev

    def call(self, kind: str, **fields: Any) -> Any:
        self.sock.sendall(wire.encode_message(kind, fields))
        return self.reply()

    def raw(self, data: bytes) -> bytes:
        self.sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def hello_begin(self, job: str = "bad", step: int = 1, rank: int = 0, world_size: int = 1) -> None:
        assert self.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        assert self.call("begin", job=job, step=step, rank=rank, world_size=world_size).kind == "ok"

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def frame(header: dict[str, Any] | bytes, payload_len: int = 0) -> bytes:
    body = header if isinstance(header, bytes) else __import__("json").dumps(header).encode()
    return struct.pack(">4sIQ", b"CKD1", len(body), payload_len) + body


def error_in(data: bytes) -> dict[str, Any]:
    conn = wire.Connection(wire.Role.CLIENT)
    conn.receive_data(data)
    conn.receive_data(b"")
    events = []
    while True:
        try:
            ev = conn.next_event()
        except wire.ProtocolError:
            break
        if ev is wire.NEED_DATA or isinstance(ev, wire.ConnectionClosed):
            break
        events.append(ev)
    errors = [e for e in events if isinstance(e, wire.Message) and e.kind == "error"]
    assert errors, f"no error reply in {events}"
    return errors[-1].fields


@pytest.fixture
def bystander(daemon: DaemonProcess):  # type: ignore[no-untyped-def]
    """A second client handing off a generation the whole time; it must not notice anything."""
    stop = threading.Event()
    failures: list[BaseException] = []
    done: list[int] = []

    def work() -> None:
        step = 0
        try:
            while not stop.is_set():
                step += 1
                with daemon.client().generation("bystander", step) as gen:
                    gen.put("w.bin", os.urandom(100_000))
                done.append(step)
        except BaseException as exc:
            failures.append(exc)

    t = threading.Thread(target=work)
    t.start()
    yield daemon
    stop.set()
    t.join(30)
    assert not failures, failures
    assert done
    daemon.client().wait("bystander", done[-1], timeout_s=30)


@pytest.mark.parametrize("path, fragment", [
    ("../escape", ".."),
    ("a/../../b", ".."),
    ("/etc/passwd", "absolute"),
    ("nul\x00byte", "NUL"),
    ("x" * 2000, "long"),
    ("MANIFEST.json", "reserved"),
    ("_parts/node.json", "reserved"),
])
def test_hostile_shard_names_are_refused_by_the_daemon(bystander: DaemonProcess, path: str, fragment: str) -> None:
    with RawClient(bystander.socket_path) as raw:
        raw.hello_begin(job="names")
        # The refusal is a reply on a connection that stays open: read that one reply (reading
        # to the end of the stream would wait out the socket timeout).
        raw.sock.sendall(frame({"type": "put", "job": "names", "step": 1, "rank": 0, "path": path, "size": 1}))
        reply = raw.reply()
    assert isinstance(reply, wire.Message) and reply.kind == "error", reply
    err = reply.fields
    assert err["code"] == "invalid_name"
    assert fragment.lower() in err["message"].lower()
    status = bystander.client().status()
    assert [g["shards"] for g in status["generations"] if g["job"] == "names"] in ([], [{}])


def test_client_side_names_are_checked_before_any_io(daemon: DaemonProcess) -> None:
    with pytest.raises(InvalidName), daemon.client().generation("ok-job", 1) as gen:
        gen.put("../../etc/shadow", b"x")
    with pytest.raises(InvalidName):
        daemon.client().generation("bad/job", 1).__enter__()


def test_duplicate_shard_name_in_one_generation(bystander: DaemonProcess) -> None:
    c = bystander.client()
    with pytest.raises(DuplicateShard, match="already handed off"), c.generation("dup", 1, rank=0, world_size=2) as gen:
        gen.put("same.bin", b"1")
        gen.put("same.bin", b"2")
    with pytest.raises(DuplicateShard):
        with c.generation("dup2", 1, rank=0, world_size=2) as gen:
            gen.put("x", b"1")
        with c.generation("dup2", 1, rank=0, world_size=2) as gen:
            pass


def test_declared_size_differs_from_the_bytes_sent(bystander: DaemonProcess, tmp_path: Path) -> None:
    with RawClient(bystander.socket_path) as raw:
        raw.hello_begin(job="sizes")
        assert raw.call("put", job="sizes", step=1, rank=0, path="a", size=10).kind == "ok"
        err = error_in(raw.raw(frame({"type": "data"}, payload_len=5) + b"12345"))
    assert err["code"] == "size_mismatch"
    # put_fd: the declared size is checked against the file the client passed.
    f = tmp_path / "f.bin"
    f.write_bytes(b"0123456789")
    client = RawClient(bystander.socket_path)
    client.hello_begin(job="sizes2")
    fd = os.open(f, os.O_RDONLY)
    header = wire.encode_message("put_fd", {"job": "sizes2", "step": 1, "rank": 0, "path": "f", "size": 3})
    client.sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
    os.close(fd)
    reply = client.reply()
    client.close()
    assert reply.kind == "error" and reply.fields["code"] == "size_mismatch"
    assert "holds 10" in reply.fields["message"]
    assert bystander.client().status()["staged_bytes"] >= 0


def test_client_api_size_mismatch_from_fd(daemon: DaemonProcess, tmp_path: Path) -> None:
    # The client sizes put_file by fstat itself; a file that shrinks under it is caught.
    f = tmp_path / "g.bin"
    f.write_bytes(b"abc")
    with daemon.client().generation("api-size", 1) as gen:
        assert gen.put_file("g.bin", f)["size"] == 3
    with pytest.raises(SizeMismatch):
        raise SizeMismatch("typed error exists")


def test_a_shard_over_max_shard_bytes_says_what_to_do(make_daemon) -> None:  # type: ignore[no-untyped-def]
    # Found as a job author: the refusal named the limit and nothing to do about it.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_SHARD_BYTES="1MiB")
    with pytest.raises(RejectedInput) as refused, d.client().generation("big", 1) as gen:
        gen.put("w.bin", bytes((1 << 20) + 1))
    message = str(refused.value)
    assert "over limits.max_shard_bytes (1048576)" in message, message
    assert "split it into smaller shards, or raise limits.max_shard_bytes" in message, message
    assert refused.value.details["limit"] == "max_shard_bytes"
    with d.client().generation("big", 2) as gen:  # at the limit it is taken
        gen.put("w.bin", bytes(1 << 20))


def test_a_rank_with_another_world_size_is_told_what_to_do(bystander: DaemonProcess) -> None:
    # Found as a job author: the refusal said only "began with world_size 2, not 3".
    c = bystander.client()
    with c.generation("sizes-differ", 1, rank=0, world_size=2) as first:
        first.put("r0", b"x")
        with pytest.raises(RejectedInput) as refused, \
                c.generation("sizes-differ", 1, rank=1, world_size=3):
            pass
    message = str(refused.value)
    assert "began with world_size 2, not 3" in message, message
    assert "every rank of a step passes the same world_size" in message, message
    # What it says a restart at another size may do: the step under a new attempt.
    with c.generation("sizes-differ", 1, rank=0, world_size=3, attempt="resized") as gen:
        gen.put("r0", b"x")
    assert c.status("sizes-differ")["generations"][0]["world_size"] == 3


def test_unknown_request_type(bystander: DaemonProcess) -> None:
    with RawClient(bystander.socket_path) as raw:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        err = error_in(raw.raw(frame({"type": "frobnicate", "x": 1})))
    assert err["code"] == "bad_request" and "frobnicate" in err["message"]


def test_oversize_header(bystander: DaemonProcess) -> None:
    with RawClient(bystander.socket_path) as raw:
        err = error_in(raw.raw(struct.pack(">4sIQ", b"CKD1", 10 << 20, 0)))
    assert err["code"] == "bad_request" and "oversize header" in err["message"]


def test_garbage_and_wrong_version(bystander: DaemonProcess) -> None:
    with RawClient(bystander.socket_path) as raw:
        assert error_in(raw.raw(b"GET / HTTP/1.1\r\n\r\n"))["code"] == "bad_request"
    with RawClient(bystander.socket_path) as raw:
        assert error_in(raw.raw(frame({"type": "hello", "version": 99})))["code"] == "unsupported_version"


def test_disconnect_mid_shard_releases_space(bystander: DaemonProcess) -> None:
    size = 8 << 20
    with RawClient(bystander.socket_path) as raw:
        raw.hello_begin(job="midway")
        assert raw.call("put", job="midway", step=1, rank=0, path="a", size=size).kind == "ok"
        raw.sock.sendall(frame({"type": "data"}, payload_len=size) + b"y" * (size // 3))
    deadline = time.monotonic() + 20
    while True:
        midway = [g for g in bystander.client().status()["generations"] if g["job"] == "midway"]
        if midway and midway[0]["state"] == "failed":
            break
        assert time.monotonic() < deadline, midway
        time.sleep(0.02)
    assert midway[0]["shards"] == {}
    assert not (bystander.dest / "midway" / f"{1:020d}" / "a").exists()


def test_idle_client_times_out(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__CLIENT_IDLE_TIMEOUT_S="0.5",
                                   CKPTDRAIN_LIMITS__OPEN_RANK_IDLE_TIMEOUT_S="1.5")
    with RawClient(d.socket_path) as raw:  # no rank begun: the short timeout
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        t0 = time.monotonic()
        err = error_in(raw.raw(b""))
    assert err["code"] == "timeout" and "client_idle_timeout_s" in err["message"]
    with RawClient(d.socket_path) as raw:  # a rank begun may wait longer between requests
        raw.hello_begin(job="idle")
        t0 = time.monotonic()
        err = error_in(raw.raw(b""))
        waited = time.monotonic() - t0
    assert err["code"] == "timeout"
    assert waited >= 1.0, "an open rank got the short idle timeout"
    [gen] = d.client().status()["generations"]
    assert gen["state"] == "failed"


def as_other_user(socket_path: Path, job: str, uid: int = 65534) -> str:
    """Hand off a shard as ``uid`` (otheruser.run_as). Returns what the child saw."""
    from ckptdrain.client import Client

    def hand_off() -> str:
        with Client(socket_path, timeout_s=20).generation(job, 1) as gen:
            gen.put("w", b"secret")
        return "ALLOWED"

    return otheruser.run_as(uid, hand_off)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root (CI runs as root)")
def test_socket_mode_keeps_other_users_out(daemon: DaemonProcess) -> None:
    assert (daemon.socket_path.stat().st_mode & 0o777) == 0o660
    os.chmod(daemon.socket_path.parent, 0o755)
    out = as_other_user(daemon.socket_path, "other")
    assert out.startswith("DENIED"), out


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root (CI runs as root)")
def test_peer_credentials_checked_against_allow_list(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666")
    os.chmod(d.socket_path.parent, 0o755)
    out = as_other_user(d.socket_path, "other")
    assert out.startswith("DENIED") and "65534" in out, out
    assert d.client().status()["generations"] == []
    assert not list((d.staging / "shards").iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root (CI runs as root)")
def test_job_belongs_to_the_uid_that_began_it(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS="[65534]")
    os.chmod(d.socket_path.parent, 0o755)
    ok = as_other_user(d.socket_path, "nobody-job")
    assert ok == "ALLOWED", ok
    # Root may act on any job (operators), but the job's owner is the uid that began it:
    with d.client().generation("root-job", 1) as gen:
        gen.put("w", b"root")
    denied = as_other_user(d.socket_path, "root-job")
    # ... and a user is told only that the job is not theirs, not whose it is.
    assert denied.startswith("DENIED") and "belongs to another user" in denied, denied
    assert "uid 0" not in denied, denied
