"""A uid flooding the daemon with malformed frames is held to ``limits.client_errors_per_s``.

Found with the ``hostile`` benchmark: 21 fuzzing threads, each reconnecting as soon as the
daemon hung up on its malformed frame, made the daemon accept, answer and close about 800
connections a second, and a well-behaved client's p99 hand-off doubled (15.3 ms against 7.8
alone). Each of a uid's malformed or refused frames now draws on an allowance (a burst, then a
rate); a uid over it has its next frames wait before they are read: a new connection's first,
or the one after a refused frame. Its connections already past that, and other uids, are not
held.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ckptdrain.client import Client, wire
from tests.conftest import DaemonProcess, wait_for
from tests.functional import otheruser
from tests.functional.test_client_log_flood import send_malformed

OTHER_UID = 65534
FLOOD = 4  # the burst (3) and one more: 20 s of debt at 0.05 a second


def _welcomed(s: socket.socket) -> bool:
    """Whether the daemon answered the ``hello`` already sent on ``s`` before its timeout."""
    conn = wire.Connection(wire.Role.CLIENT)
    while True:
        event = conn.next_event()
        if event is wire.NEED_DATA:
            try:
                data = s.recv(65536)
            except TimeoutError:
                return False
            conn.receive_data(data)
            continue
        return isinstance(event, wire.Message) and event.kind == "welcome"


def _held_back(client: Client) -> float:
    with urllib.request.urlopen(client.status()["metrics"], timeout=10) as r:
        text = r.read().decode()
    match = re.search(r"^ckptdrain_client_held_back_total (\S+)$", text, re.MULTILINE)
    assert match, text
    return float(match[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root (CI runs as root)")
def test_a_uid_flooding_malformed_frames_waits_and_no_one_else_does(make_daemon: Any,
                                                                    tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[limits]\nclient_errors_per_s = 0.05\nclient_error_burst = 3\n")
    d: DaemonProcess = make_daemon(start=False, CKPTDRAIN_CONFIG=str(config),
                                   CKPTDRAIN_ACCESS__SOCKET_MODE="0666",
                                   CKPTDRAIN_ACCESS__ALLOWED_UIDS=f"[{OTHER_UID}]")
    d.start()
    os.chmod(d.socket_path.parent, 0o755)
    path = str(d.socket_path)
    bystander = d.client(timeout_s=10)
    bystander.status()  # connected before the flood

    def flood() -> str:
        for _ in range(FLOOD):
            send_malformed(path)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(wire.encode_message("hello", {"version": wire.PROTOCOL_VERSION}))
            s.settimeout(1.5)
            first = "WELCOMED" if _welcomed(s) else "HELD"
            s.settimeout(30)  # until the parent's reload lets it go
            then = "WELCOMED" if _welcomed(s) else "STILL HELD"
        return f"{first} {then}"

    child = otheruser.start_as(OTHER_UID, flood)
    wait_for(lambda: _held_back(bystander) >= 1, timeout_s=30)
    # Root's connection open before the flood, and a new one, are served at once.
    assert bystander.status()["generations"] == []
    with d.client(timeout_s=5).generation("bystander", 1) as gen:
        gen.put("a.bin", b"x" * 1000)
    d.client().wait("bystander", 1, timeout_s=30)
    assert "event=client_held_back" in d.log() and f"uid={OTHER_UID}" in d.log()
    # Raising the limit lets the held connection go (looked at again every second).
    config.write_text("[limits]\nclient_errors_per_s = 0\n")
    os.kill(d.pid, signal.SIGHUP)
    assert otheruser.answer(child) == "HELD WELCOMED"
    bystander.close()


def test_refused_frames_on_one_connection_draw_on_the_allowance_too(make_daemon: Any) -> None:
    d: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__CLIENT_ERRORS_PER_S="0.05",
                                   CKPTDRAIN_LIMITS__CLIENT_ERROR_BURST="3")
    # Connected before the flood: the same uid's new connections will be held.
    observer = d.client(timeout_s=10)
    observer.status()
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(d.socket_path))
        s.sendall(wire.encode_message("hello", {"version": wire.PROTOCOL_VERSION}))
        assert _welcomed(s)
        conn = wire.Connection(wire.Role.CLIENT)
        bad = b'{"type": "begin", "job": "../up", "step": 1, "rank": 0, "world_size": 1}'
        frame = struct.pack(">4sIQ", wire.MAGIC, len(bad), 0) + bad
        for _ in range(FLOOD):
            s.sendall(frame)
            while (event := conn.next_event()) is wire.NEED_DATA:
                conn.receive_data(s.recv(65536))
            assert isinstance(event, wire.Message) and event.kind == "error", event
        # The frame after the fourth refusal waits: not answered while the debt lasts.
        s.sendall(frame)
        s.settimeout(1.5)
        with pytest.raises(TimeoutError):
            s.recv(65536)
    assert _held_back(observer) == 1
    observer.close()
