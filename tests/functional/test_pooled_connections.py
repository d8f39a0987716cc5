"""A call on a pooled connection the daemon drops for idleness at that very moment: it goes
again on a new connection, never fails as the daemon's last word to the old one."""

from __future__ import annotations

import select
from typing import Any

from ckptdrain.client import Client, Timeout, wire
from ckptdrain.client.connections import _hung_up_before
from tests.conftest import DaemonProcess
from tests.functional.test_bad_input import RawClient, error_in

IDLE_S = "0.5"


def _dropped_once_checked(client: Client) -> None:
    """Make the client's one pooled connection pass its reuse check and then be dropped by
    the daemon (its idle timeout) before the request goes: the race a caller polling every
    ``limits.client_idle_timeout_s`` meets."""
    [channel] = client._idle
    checked = channel.is_reusable

    def check_then_wait_for_the_drop() -> bool:
        usable = checked()
        # The daemon's last word (then its hang-up) arrives once its idle timer fires.
        poller = select.poll()
        poller.register(channel._sock.fileno(), select.POLLIN)
        assert poller.poll(30_000), "the daemon never dropped the idle connection"
        return usable

    channel.is_reusable = check_then_wait_for_the_drop  # type: ignore[method-assign]


def test_a_call_racing_the_daemons_idle_drop_goes_again_on_a_new_connection(
        make_daemon: Any) -> None:
    # Found attacking: latest() every limits.client_idle_timeout_s raised Timeout ("the daemon
    # closed this connection: client idle for ...") in 12 of 300 calls, and wait() of a
    # committed step raised it too: the pooled connection passed its check just before the
    # daemon's idle timer dropped it, and the daemon's last word was read as the answer.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__CLIENT_IDLE_TIMEOUT_S=IDLE_S)
    with d.client(timeout_s=30) as c:
        with c.generation("job", 1) as gen:
            gen.put("shard", b"bytes")
        assert c.wait("job", 1, timeout_s=30)["committed"]

        _dropped_once_checked(c)
        assert c.latest("job") == 1
        _dropped_once_checked(c)
        assert c.wait("job", 1, timeout_s=30)["committed"]
        _dropped_once_checked(c)
        assert c.status("job")["generations"][0]["state"] == "committed"
        # The dropped connections are not kept: one live connection is pooled.
        assert len(c._idle) == 1 and c._idle[0].is_reusable()


def test_the_idle_last_word_is_told_by_a_field_not_by_its_words(make_daemon: Any) -> None:
    # The client resent a pooled request when the daemon's last word began "the daemon closed
    # this connection": words for people, which a rewording would have turned back into the
    # Timeout above. The daemon marks the drop in ``details.closed``; the client reads that.
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__CLIENT_IDLE_TIMEOUT_S=IDLE_S)
    with RawClient(d.socket_path) as raw:  # nothing of a request came: it may go again
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        idle = error_in(raw.raw(b""))
    assert idle["code"] == "timeout" and idle["details"] == {"closed": "idle"}
    with RawClient(d.socket_path) as raw:  # a frame begun, then nothing: it was read in part
        assert raw.call("hello", version=wire.PROTOCOL_VERSION).kind == "welcome"
        stalled = error_in(raw.raw(wire.encode_message("latest", {"job": "j"})[:10]))
    assert stalled["code"] == "timeout" and stalled["details"] == {"closed": "stalled"}

    assert _hung_up_before(Timeout("reworded", details=idle["details"]))
    assert not _hung_up_before(Timeout(stalled["message"], details=stalled["details"]))
    # A daemon from before the field sent the words alone: still taken as its idle drop.
    assert _hung_up_before(Timeout(idle["message"]))
