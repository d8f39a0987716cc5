"""Notifier against a real datagram socket standing in for systemd; listen_fds with sockets
really inherited from systemd's own socket activator (systemd-socket-activate)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.daemon.systemd import Notifier, SocketActivationError, listen_fds

RECV_TIMEOUT_S = 5.0


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A SOCK_DGRAM socket bound where systemd's NOTIFY_SOCKET would be."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(RECV_TIMEOUT_S)
    try:
        yield path, sock
    finally:
        sock.close()


def _fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().split("\n"))


def test_each_message_arrives_as_one_datagram(notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled

    assert notifier.ready()
    assert sock.recv(4096) == b"READY=1"
    assert notifier.status("draining 3 shards")
    assert sock.recv(4096) == b"STATUS=draining 3 shards"
    assert notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert notifier.stopping("journalling in-flight work")
    assert _fields(sock.recv(4096)) == {"STOPPING": "1", "STATUS": "journalling in-flight work"}


def test_reloading_carries_monotonic_usec(notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    Notifier({"NOTIFY_SOCKET": path}).reloading("reloading config")
    fields = _fields(sock.recv(4096))
    assert fields["RELOADING"] == "1"
    assert fields["MONOTONIC_USEC"].isdigit()
    assert fields["STATUS"] == "reloading config"


def test_status_cannot_inject_a_second_assignment(
    notify_socket: tuple[str, socket.socket],
) -> None:
    path, sock = notify_socket
    Notifier({"NOTIFY_SOCKET": path}).status("job x\nREADY=1")
    assert _fields(sock.recv(4096)) == {"STATUS": "job x READY=1"}


def test_abstract_socket_address() -> None:
    name = f"ckptdrain-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(RECV_TIMEOUT_S)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(4096) == b"READY=1"


def test_unset_notify_socket_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    assert notifier.watchdog_interval_s() is None


def test_unreachable_socket_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert notifier.ready() is False
    assert "cannot notify systemd" in caplog.text


def test_watchdog_interval_is_half_the_timeout() -> None:
    assert Notifier({"WATCHDOG_USEC": "60000000"}).watchdog_interval_s() == 30.0
    mine = {"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_interval_s() == 30.0


@pytest.mark.parametrize(
    "env",
    [
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "garbage"},
        {"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"},  # armed for another process
    ],
)
def test_watchdog_off(env: dict[str, str]) -> None:
    assert Notifier(env).watchdog_interval_s() is None


def test_listen_fds_not_activated_unsets_nothing_else() -> None:
    env = {"PATH": "/bin"}
    assert listen_fds(env) == []
    assert env == {"PATH": "/bin"}


def test_listen_fds_for_another_pid_is_ignored_and_unset() -> None:
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "ckptdrain.socket"}
    assert listen_fds(env) == []
    assert env == {}


# The child runs listen_fds() on what it inherited and reports, as JSON, what it found.
CHILD = textwrap.dedent(
    """
    import json, os, socket, sys
    from ckptdrain.daemon.systemd import SocketActivationError, listen_fds
    try:
        socks = listen_fds()
    except SocketActivationError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(0)
    report = {
        "env_left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
        "sockets": [
            {"fd": s.fileno(), "family": s.family.name, "type": s.type.name,
             "name": s.getsockname(), "inheritable": s.get_inheritable()}
            for s in socks
        ],
    }
    if socks:
        # Serve one connection to prove the socket is the listening one the parent connects to.
        conn, _ = socks[0].accept()
        conn.sendall(b"hello from fd %d" % socks[0].fileno())
        conn.close()
    print(json.dumps(report))
    """
)

ACTIVATE = shutil.which("systemd-socket-activate")
needs_activate = pytest.mark.skipif(
    ACTIVATE is None, reason="systemd-socket-activate missing: apt-get install systemd"
)


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}


@needs_activate
def test_listen_fds_takes_the_socket_systemd_passes(tmp_path: Path) -> None:
    assert ACTIVATE is not None
    sock_path = str(tmp_path / "ckptdrain.sock")
    proc = subprocess.Popen(
        [ACTIVATE, "--listen", sock_path, sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(),
    )
    try:
        # systemd-socket-activate binds before it forks, but it starts the child only on the
        # first connection; retry the connect until the socket exists.
        greeting = _connect_and_read(sock_path)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, err.decode()
    report = json.loads(out)
    assert report["env_left"] == []
    assert report["sockets"] == [
        {
            "fd": 3,
            "family": "AF_UNIX",
            "type": "SOCK_STREAM",
            "name": sock_path,
            "inheritable": False,
        }
    ]
    assert greeting == b"hello from fd 3"


def _connect_and_read(path: str) -> bytes:
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(20)
                client.connect(path)
                chunks = []
                while chunk := client.recv(4096):
                    chunks.append(chunk)
                return b"".join(chunks)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@needs_activate
def test_listen_fds_rejects_a_datagram_socket(tmp_path: Path) -> None:
    assert ACTIVATE is not None
    sock_path = str(tmp_path / "dgram.sock")
    proc = subprocess.Popen(
        [ACTIVATE, "--datagram", "--listen", sock_path, sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(),
    )
    try:
        _send_datagram_until_started(sock_path)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, err.decode()
    error = json.loads(out)["error"]
    assert "not a Unix stream socket" in error
    assert "ListenStream=" in error


def _send_datagram_until_started(path: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as client:
                client.sendto(b"wake", path)
                return
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_listen_fds_rejects_a_bad_count() -> None:
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "many"}
    with pytest.raises(SocketActivationError, match="LISTEN_FDS"):
        listen_fds(env)
    assert env == {}
