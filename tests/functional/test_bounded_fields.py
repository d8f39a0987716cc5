"""Every field is bounded at the wire: an out-of-range value is one typed ``bad_request``, the
connection stays usable (docs/protocol.md), and the daemon serves on. Each test is a finding
of the hostile-client campaign against the daemon."""

from __future__ import annotations

import pytest

from ckptdrain.client import RejectedInput, wire
from tests.conftest import DaemonProcess
from tests.functional.test_bad_input import RawClient, frame
from tests.functional.test_failure_boundary import still_serves


def unchecked(raw: RawClient, kind: str, **fields: object) -> object:
    """Send what the client's own checks would refuse to encode."""
    raw.sock.sendall(frame({"type": kind, **fields}))
    return raw.reply()


def test_step_2_to_the_63_through_the_official_client(daemon: DaemonProcess) -> None:
    # The protocol allowed steps up to 10**19 - 1; the journal stores int64: OverflowError.
    c = daemon.client()
    with pytest.raises(RejectedInput, match="out of range"), c.generation("big", 2**63) as gen:
        gen.put("a", b"x")
    with c.generation("big", 2**63 - 1) as gen:
        gen.put("a", b"x")
    c.wait("big", 2**63 - 1, timeout_s=30)
    still_serves(daemon)


def test_step_2_to_the_63_on_the_wire_is_a_bad_request_and_the_connection_goes_on(
    daemon: DaemonProcess,
) -> None:
    with RawClient(daemon.socket_path) as raw:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        reply = unchecked(raw, "begin", job="big", step=2**63, rank=0, world_size=1)
        assert reply.kind == "error" and reply.fields["code"] == wire.BAD_REQUEST, reply
        assert raw.call("status").kind == "ok"
    still_serves(daemon)


def test_a_400_digit_timeout(daemon: DaemonProcess) -> None:
    # OverflowError in the wire check (math.isfinite of an int with no float).
    with pytest.raises(RejectedInput, match="timeout_s"):
        daemon.client().wait("j", 1, timeout_s=10**400)
    header = ('{"type": "wait", "job": "j", "step": 1, "timeout_s": 1' + "0" * 400 + "}").encode()
    assert len(header) > 400
    with RawClient(daemon.socket_path) as raw:
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        raw.sock.sendall(frame(header))
        reply = raw.reply()
        assert reply.kind == "error" and reply.fields["code"] == wire.BAD_REQUEST, reply
        assert "timeout_s" in reply.fields["message"]
        assert raw.call("status").kind == "ok"
    still_serves(daemon)
    assert "Traceback" not in daemon.log()


def test_an_invalid_name_on_a_put_leaves_the_connection_usable(daemon: DaemonProcess) -> None:
    # protocol.md: after an error reply the connection stays usable; a bad name closed it.
    with RawClient(daemon.socket_path) as raw:
        raw.hello_begin(job="names")
        shard = {"job": "names", "step": 1, "rank": 0}
        raw.sock.sendall(frame({"type": "put", **shard, "path": "../escape", "size": 2}))
        reply = raw.reply()
        assert reply.kind == "error" and reply.fields["code"] == wire.INVALID_NAME, reply
        assert raw.call("put", **shard, path="fine.bin", size=2).fields == {"ready": True,
                                                                           "pipe": True}
        raw.sock.sendall(wire.encode_message("data", {}, 2) + b"ok")
        assert raw.reply().kind == "ok"
        assert raw.call("seal", **shard).kind == "ok"
    daemon.client().wait("names", 1, timeout_s=30)
    assert (daemon.dest / "names" / f"{1:020d}" / "fine.bin").read_bytes() == b"ok"


def test_a_reason_of_65400_characters_is_refused_at_the_wire(daemon: DaemonProcess) -> None:
    # Stored unbounded, it broke status for good (and survived a restart).
    with RawClient(daemon.socket_path) as raw:
        raw.hello_begin(job="reasons")
        shard = {"job": "reasons", "step": 1, "rank": 0}
        reply = unchecked(raw, "abort", **shard, reason="r" * 65_400)
        assert reply.kind == "error" and reply.fields["code"] == wire.BAD_REQUEST, reply
        assert "over the limit of 1000" in reply.fields["message"]
        assert raw.call("abort", **shard, reason="short").kind == "ok"
    assert daemon.client().status()


def test_world_size_over_the_configured_maximum(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__MAX_WORLD_SIZE="8")
    c = d.client()
    with (pytest.raises(RejectedInput, match="max_world_size"),
          c.generation("wide", 1, rank=0, world_size=9) as gen):
        gen.put("a", b"x")
    with c.generation("wide", 2, rank=0, world_size=1) as gen:
        gen.put("a", b"x")
    c.wait("wide", 2, timeout_s=30)
