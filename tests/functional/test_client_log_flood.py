"""A client's own errors cannot flood the daemon's log.

Found with the ``hostile`` benchmark's fuzzers: one process sending malformed frames made the
daemon write about 1000 log lines a second (175 KB/s), one per frame. Under systemd, journald
rate-limits a unit as a whole (10000 lines in 30 s by default) and then drops its lines, the
daemon's own warnings with the flood. Now a client's errors log through one bucket per uid
(the first ``USER_LOG_BURST`` lines, then one a second, each saying how many were held back),
and ``ckptdrain_client_errors_total`` counts every one of them.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import time
import urllib.request
from typing import Any

from ckptdrain.client import wire
from ckptdrain.daemon.logs import USER_LOG_BURST, USER_LOG_INTERVAL_S
from tests.conftest import DaemonProcess

EVENTS = ("client_protocol_error", "request_refused", "client_dropped")
MALFORMED = 300


def send_malformed(path: str) -> None:
    """One connection, one frame with the wrong magic: the daemon says why and hangs up."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(path)
        s.sendall(b"XXXX" + struct.pack(">IQ", 2, 0) + b"{}")
        while s.recv(65536):
            pass


def _frame(header: dict[str, object]) -> bytes:
    """A frame the client library would refuse to send (it checks names first)."""
    body = json.dumps(header).encode()
    return struct.pack(">4sIQ", wire.MAGIC, len(body), 0) + body


def _logged(d: DaemonProcess) -> list[str]:
    return [line for line in d.log().splitlines()
            if any(f"event={event} " in line for event in EVENTS)]


def _client_errors(d: DaemonProcess, event: str) -> float:
    with urllib.request.urlopen(d.client().status()["metrics"], timeout=10) as r:
        text = r.read().decode()
    match = re.search(rf'^ckptdrain_client_errors_total\{{event="{event}"\}} (\S+)$', text,
                      re.MULTILINE)
    assert match, text
    return float(match[1])


def test_a_flood_of_malformed_frames_is_counted_but_not_all_logged(make_daemon: Any) -> None:
    # The uid's error allowance off: this floods as fast as it can to test the log's bound
    # (test_client_error_allowance.py tests the allowance).
    daemon: DaemonProcess = make_daemon(CKPTDRAIN_LIMITS__CLIENT_ERRORS_PER_S="0")
    path = str(daemon.socket_path)
    started = time.monotonic()
    for _ in range(MALFORMED):
        send_malformed(path)
    # Refused requests too, in one conversation that goes on after each.
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(path)
        conn = wire.Connection(wire.Role.CLIENT)
        s.sendall(wire.encode_message("hello", {"version": wire.PROTOCOL_VERSION}))
        refused = 0
        for _ in range(100):
            s.sendall(_frame({"type": "begin", "job": "../up", "step": 1, "rank": 0,
                              "world_size": 1}))
            while True:
                event = conn.next_event()
                if event is wire.NEED_DATA:
                    conn.receive_data(s.recv(65536))
                    continue
                assert isinstance(event, wire.Message), event
                if event.kind == "error":
                    refused += 1
                    break
    elapsed = time.monotonic() - started

    assert _client_errors(daemon, "client_protocol_error") == MALFORMED
    assert refused == 100
    lines = _logged(daemon)
    # The burst, then one a second: the code before logged all 400.
    allowed = USER_LOG_BURST + int(elapsed / USER_LOG_INTERVAL_S) + 1
    assert 0 < len(lines) <= allowed, (len(lines), allowed)

    # The next line logged says how many were held back since the last one.
    deadline = time.monotonic() + 30
    while not any("suppressed=" in line for line in _logged(daemon)):
        assert time.monotonic() < deadline, _logged(daemon)[-5:]
        send_malformed(path)
        time.sleep(0.05)
    held = sum(int(m[1]) for line in _logged(daemon) for m in [re.search(r"suppressed=(\d+)", line)]
               if m)
    assert held >= MALFORMED + 100 - allowed

    # The daemon carried on, and a good client is served.
    with daemon.client().generation("after-flood", 1) as gen:
        gen.put("a.bin", b"x" * 1000)
    daemon.client().wait("after-flood", 1, timeout_s=30)


def test_a_user_beginning_and_aborting_jobs_in_a_loop_floods_neither_log_nor_destination(
        daemon: DaemonProcess) -> None:
    # Found attacking the daemon as a second user: each begin + abort wrote an error line
    # (with the client's 1000-character reason) and a failure record at the destination, for
    # a generation no other node waited on: about 330 lines a second, and 4350 files in
    # one run.
    started = time.monotonic()
    with daemon.client() as c:
        for i in range(200):
            with c.generation(f"churn-{i}", 1, rank=0, world_size=1) as gen:
                gen.abort("x" * 1000)
    elapsed = time.monotonic() - started
    failed = [line for line in daemon.log().splitlines() if "event=generation_failed " in line]
    assert 0 < len(failed) <= USER_LOG_BURST + int(elapsed / USER_LOG_INTERVAL_S) + 1
    assert all("level=warning" in line for line in failed), failed[:2]
    assert not [p for p in daemon.dest.rglob("*") if p.is_file()]
    statuses = {g["state"] for g in daemon.client().status()["generations"]
                if g["job"].startswith("churn-")}
    assert statuses == {"failed"}
