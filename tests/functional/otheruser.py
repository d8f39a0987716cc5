"""Code run as another user: a forked child that drops to a uid (a real other user: the
kernel reports its credentials to the daemon) and hands back a line of text."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

from ckptdrain.client import Client, DaemonUnavailable, GenerationFailed, PermissionDenied


def start_as(uid: int, fn: Callable[[], str], *, gid: int | None = None,
             groups: tuple[int, ...] = ()) -> tuple[int, int]:
    """``fn()`` in a forked child running as ``uid`` (and ``gid``, default ``uid``, with
    supplementary ``groups``); returns (pid, fd to read its answer from) at once. A refusal
    reads ``DENIED <message>``, a failed generation ``FAILED <message>``, anything else
    unexpected ``ERROR <traceback>``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            try:
                out = fn()
            except PermissionDenied as exc:
                out = f"DENIED {exc}"
            except GenerationFailed as exc:
                out = f"FAILED {exc}"
            except BaseException:
                out = "ERROR " + traceback.format_exc()
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def answer(child: tuple[int, int]) -> str:
    """What a child of :func:`start_as` answered, once it has ended."""
    pid, r = child
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def run_as(uid: int, fn: Callable[[], str], *, gid: int | None = None,
           groups: tuple[int, ...] = ()) -> str:
    """:func:`start_as` and wait for its answer."""
    return answer(start_as(uid, fn, gid=gid, groups=groups))


def serve_as(uid: int, env: Mapping[str, str], log: Path, socket_path: Path,
             timeout_s: float = 30.0) -> int:
    """``ckptdrain serve`` in a forked child running as ``uid`` (a unit's ``User=``), with
    ``env`` as its whole environment and its output in ``log``; returns its pid once it
    answers on ``socket_path``. Forked, not executed, and the daemon's modules imported first:
    the interpreter and its library may sit where another uid cannot reach them (a root-only
    home)."""
    import encodings.idna  # noqa: F401 - the metrics listener's address lookup

    import ckptdrain.daemon.cli_node
    import ckptdrain.daemon.server  # noqa: F401

    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.environ.clear()
            os.environ.update(env)
            from ckptdrain.daemon.cli import main

            code = main(["serve"])
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with Client(socket_path, timeout_s=5) as c:
                c.status()
            return pid
        except DaemonUnavailable:
            pass
        ended = os.waitpid(pid, os.WNOHANG)[0]
        if ended or time.monotonic() > deadline:
            if not ended:
                stop(pid)
            raise RuntimeError(f"daemon as uid {uid} did not come up:\n{log.read_text()}")
        time.sleep(0.05)


def stop(pid: int, timeout_s: float = 30.0) -> int:
    """SIGTERM a child of :func:`serve_as`, SIGKILL after ``timeout_s``; its exit status."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.05)
