"""Code run as another user: a forked child that drops to a uid (a real other user: the
kernel reports its credentials to the daemon) and hands back a line of text."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

from ckptdrain.client import GenerationFailed, PermissionDenied


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
