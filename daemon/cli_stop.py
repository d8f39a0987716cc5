"""How a command of the CLI stops on a signal: cleaned up behind it, once.

SIGINT (Ctrl-C), SIGTERM (``kill``, ``timeout``, a batch system's time limit) and SIGHUP (a
closed terminal or ssh session) cancel the command's task from inside its event loop: its
cleanup runs (a restore's temp files and the files it created go), and the command ends with
128 + the signal's number. A second signal while it cleans up is ignored. Found attacking
restore: killed outright by SIGTERM or SIGHUP it left partial files behind; a
KeyboardInterrupt raised from a signal handler inside a loop callback could leave an
executor's future unresolved, which the cleanup then awaited for good; and a second Ctrl-C
cancelled the cleanup itself. A signal the process was started ignoring (SIGINT for a shell
script's background job, SIGHUP under ``nohup``) stays ignored.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

from ckptdrain.daemon.errors import DaemonError

T = TypeVar("T")

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SAID = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}


class Stopped(DaemonError):
    """The command was stopped by a signal, and cleaned up first."""

    def __init__(self, signum: int) -> None:
        super().__init__(_SAID.get(signal.Signals(signum), f"stopped by signal {signum}"))
        self.code = 128 + signum


async def stoppable(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` as this task; a stopping signal cancels it (once) and raises Stopped
    once its cleanup is done."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    caught: list[int] = []

    def stop(signum: int) -> None:
        if not caught:
            caught.append(signum)
            task.cancel()

    installed = []
    for signum in STOPPING:
        if signal.getsignal(signum) is signal.SIG_IGN:
            continue
        loop.add_signal_handler(signum, stop, signum)
        installed.append(signum)
    try:
        return await coro
    except asyncio.CancelledError:
        if caught:
            raise Stopped(caught[0]) from None
        raise
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
            if caught:
                # The command is ending: a second Ctrl-C during the interpreter's shutdown
                # (joining the executor's threads) printed a KeyboardInterrupt traceback.
                signal.signal(signum, signal.SIG_IGN)
