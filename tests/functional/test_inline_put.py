"""A small shard in one round trip (``put_bytes``), against a real daemon: what it commits,
what a refusal leaves of the conversation, and what a wrong or trickled frame gets."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Backpressure, wire
from ckptdrain.client import channel as channel_module
from tests.conftest import DaemonProcess
from tests.functional.test_bad_input import RawClient, error_in, frame
from tests.functional.test_slots import _rate_limited, read_all


def _put_bytes(raw: RawClient, path: str, data: bytes, **who: Any) -> Any:
    fields = {"job": "inline", "step": 1, "rank": 0, **who, "path": path, "size": len(data)}
    raw.sock.sendall(wire.encode_message("put_bytes", fields, len(data)) + data)
    return raw.reply()


def test_small_shards_go_in_one_round_trip_and_commit_byte_equal(
        daemon: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []
    request = channel_module.Channel.request

    def recording(self: Any, kind: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(kind)
        return request(self, kind, *args, **kwargs)

    monkeypatch.setattr(channel_module.Channel, "request", recording)
    shards = {"small.bin": os.urandom(64 << 10), "empty.bin": b"",
              "limit.bin": os.urandom(wire.INLINE_MAX_BYTES),
              "over.bin": os.urandom(wire.INLINE_MAX_BYTES + 1)}
    with daemon.client() as c:
        with c.generation("inline", 1) as gen:
            sent.clear()
            for path, data in shards.items():
                gen.put(path, data)
            # Up to the limit one frame each; past it, admission first, then the bytes
            # (through a pipe, which this daemon offers: see test_pipe_handoff.py).
            assert sent == ["put_bytes", "put_bytes", "put_bytes", "put", "data_pipe"]
        c.wait("inline", 1, timeout_s=60)
    committed = tmp_path / "dest" / "inline" / f"{1:020d}"
    for path, data in shards.items():
        assert (committed / path).read_bytes() == data


def test_a_refused_put_bytes_leaves_the_conversation_going(daemon: DaemonProcess) -> None:
    with RawClient(daemon.socket_path) as raw:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        # Before begin: refused, and the next request is read as a request.
        early = _put_bytes(raw, "a.bin", b"early")
        assert early.kind == "error" and early.fields["code"] == "bad_request"
        begun = raw.call("begin", job="inline", step=1, rank=0, world_size=2)
        assert begun.kind == "ok" and begun.fields["inline_bytes"] == wire.INLINE_MAX_BYTES
        assert _put_bytes(raw, "a.bin", b"first").kind == "ok"
        again = _put_bytes(raw, "a.bin", b"second")
        assert again.kind == "error" and again.fields["code"] == "duplicate"
        other = _put_bytes(raw, "b.bin", b"not mine", rank=1)
        assert other.kind == "error" and other.fields["code"] == "bad_request"
        assert _put_bytes(raw, "c.bin", b"third").kind == "ok"
        sealed = raw.call("seal", job="inline", step=1, rank=0)
        assert sealed.kind == "ok" and sealed.fields["shards"] == 2
        assert sealed.fields["bytes"] == len(b"first") + len(b"third")


def test_put_bytes_refused_for_room_is_backpressure_and_the_connection_goes_on(
        make_daemon) -> None:  # type: ignore[no-untyped-def]
    d = make_daemon(CKPTDRAIN_LIMITS__MAX_STAGED_BYTES="300KiB",
                    CKPTDRAIN_LIMITS__ON_FULL="reject",
                    CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    chunk = os.urandom(200 << 10)
    with RawClient(d.socket_path) as raw:
        raw.hello_begin(job="inline")
        assert _put_bytes(raw, "a.bin", chunk).kind == "ok"
        full = _put_bytes(raw, "b.bin", chunk)
        assert full.kind == "error" and full.fields["code"] == "backpressure"
        status = raw.call("status")
        assert status.kind == "ok" and status.fields["staged_bytes"] == len(chunk)


def test_put_bytes_of_the_wrong_size_ends_that_connection_only(daemon: DaemonProcess) -> None:
    with RawClient(daemon.socket_path) as raw:
        raw.hello_begin(job="inline")
        header = frame({"type": "put_bytes", "job": "inline", "step": 1, "rank": 0,
                        "path": "a.bin", "size": 10}, payload_len=4)
        err = error_in(raw.raw(header + b"abcd"))
    assert err["code"] == "size_mismatch" and "declares 10 bytes but carries 4" in err["message"]
    with RawClient(daemon.socket_path) as raw:
        raw.hello_begin(job="inline-over")
        over = wire.INLINE_MAX_BYTES + 1
        header = frame({"type": "put_bytes", "job": "inline-over", "step": 1, "rank": 0,
                        "path": "a.bin", "size": over}, payload_len=over)
        err = error_in(raw.raw(header))
    assert err["code"] == "bad_request" and "with 'put' and then its 'data'" in err["message"]
    with daemon.client() as c, c.generation("inline-ok", 1) as gen:
        gen.put("fine.bin", b"still serving")


def test_a_trickled_put_bytes_payload_is_cut_off(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d = _rate_limited(make_daemon)
    size = wire.INLINE_MAX_BYTES
    with RawClient(d.socket_path) as raw:
        raw.hello_begin(job="trickle")
        head = frame({"type": "put_bytes", "job": "trickle", "step": 1, "rank": 0,
                      "path": "a", "size": size}, payload_len=size)
        raw.sock.sendall(head + b"x" * 4096)
        raw.sock.settimeout(0.2)
        got, deadline = b"", time.monotonic() + 30
        while not got:
            assert time.monotonic() < deadline, "a trickled put_bytes kept its connection"
            with contextlib.suppress(OSError):
                raw.sock.sendall(b"x" * 100)
            with contextlib.suppress(TimeoutError, BlockingIOError, ConnectionResetError):
                got = raw.sock.recv(65536)
        got += read_all(raw.sock)
    err = error_in(got)
    assert err["code"] == "timeout" and "client_min_bytes_per_s" in err["message"]
    with d.client() as c:
        assert not [g for g in c.status()["generations"] if g["job"] == "trickle"
                    and g["shards"].get("staged")]


def test_put_bytes_refused_by_a_full_staging_disk_leaves_no_file(
        make_daemon, small_tmpfs: Path) -> None:  # type: ignore[no-untyped-def]
    # The staged file is written in the same thread job as the disk's room is sampled; a
    # sample that refuses it unlinks it before the refusal is answered.
    d: DaemonProcess = make_daemon(CKPTDRAIN_STAGING_DIR=str(small_tmpfs / "staging"),
                                   CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S="1")
    st = os.statvfs(small_tmpfs)
    # Room for the bytes themselves, not for them and the filesystem's reserve (3.2 MiB
    # here, 1.6 MiB of it held in the journal's reserve files: 1.6 MiB still to keep free).
    (small_tmpfs / "someone-else").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - (1 << 20)))
    c = d.client()
    with c.generation("full", 1) as gen, pytest.raises(Backpressure) as info:
        gen.put("b", os.urandom(200 << 10))
    assert info.value.details["limit"] == "staging_filesystem"
    assert os.listdir(small_tmpfs / "staging" / "shards") == []
    (small_tmpfs / "someone-else").unlink()
    with c.generation("full", 2) as gen:
        assert gen.put("b", b"room again")["ack"] == "local"


def test_a_strangers_stalled_put_bytes_is_no_hand_off_to_wait_for_at_stop(
        daemon: DaemonProcess) -> None:
    # Found by attacking it: a put_bytes before any begin counted as a hand-off in flight,
    # so a peer that had only said hello held a stopping daemon for its whole grace period
    # and was then cut off by the rate floor. It is now cancelled at once, as an idle one is.
    with RawClient(daemon.socket_path) as raw:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        size = wire.INLINE_MAX_BYTES
        raw.sock.sendall(frame({"type": "put_bytes", "job": "s", "step": 1, "rank": 0,
                                "path": "a", "size": size}, payload_len=size) + b"x" * 1000)
        status = daemon.client().status()  # the frame is being read by now
        assert status["node_id"]
        daemon.stop(timeout_s=30)
        got = read_all(raw.sock)
    assert b"client_min_bytes_per_s" not in got and b"timeout" not in got
