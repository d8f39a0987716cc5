"""The daemon's socket path appears only once it listens: a client (or a script waiting for
the daemon) that finds the path can connect, never "connection refused" from a daemon that is
still starting (seen as a flaky start in tests/functional/test_small_shards.py)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from ckptdrain.daemon import listener
from ckptdrain.daemon.config import Config


def test_the_path_appears_only_once_the_socket_listens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run" / "ckptdrain.sock"
    config = Config(socket=path)
    seen_before_listen: list[bool] = []
    real_listen = socket.socket.listen

    def listen(self: socket.socket, backlog: int = 0) -> None:
        seen_before_listen.append(path.exists())
        real_listen(self, backlog)

    monkeypatch.setattr(socket.socket, "listen", listen)
    sock = listener.bind(config, None)
    try:
        assert seen_before_listen == [False]
        assert stat.S_IMODE(os.stat(path).st_mode) == config.access.mode_int
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(path))  # listens: no refusal
        probe.close()
        assert sorted(p.name for p in path.parent.iterdir()) == ["ckptdrain.sock"]
    finally:
        sock.close()


def test_a_path_too_long_for_a_temporary_name_is_bound_in_place(tmp_path: Path) -> None:
    room = listener._SUN_PATH_MAX - 1 - len(os.fsencode(tmp_path)) - 1
    path = tmp_path / ("s" * (room - 2))  # fits, but not with ".<name>.<pid>"
    sock = listener.bind(Config(socket=path), None)
    try:
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    finally:
        sock.close()
