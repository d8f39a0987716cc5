"""The SIGHUP reload: apply what can change while running (``[limits]``, ``log_level``, the
drain's pace) and name every other changed key as needing a restart (they name sockets,
directories and destinations in use).

A config that does not load is logged (``reload_failed``) and ignored: the daemon keeps
running as it was. Found attacking, and why it is built as it is:

- The file is read in a thread of its own, within ``limits.io_timeout_s``: read on the loop, a
  config that was a FIFO froze every client and the stop; read in the data plane, each such
  reload took one of the hand-offs' threads for good. A read that has not returned (a hung
  mount) fails every later reload at once rather than leaving another thread behind.
  configload reads only a regular file, without blocking on its open, up to 1 MiB.
- A reload waits for the daemon to be ready: during start-up it skipped the staging disk's
  clamp on ``max_staged_bytes``, and systemd heard ``READY=1`` before the socket was bound.
- Whatever it raises ends in one ``reload_failed`` line, and systemd hears ``READY=1`` after
  the ``RELOADING=1`` it was sent, unless the daemon is stopping by then.
- The drain's rate is set only when it changed: every reload let a paced drain through.

Reloads run one at a time, in the order the signals came.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ckptdrain.daemon import startup
from ckptdrain.daemon.errors import ConfigError, DaemonError, StartupError
from ckptdrain.daemon.logs import log_event, setup_logging

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger("ckptdrain.daemon")

_T = TypeVar("_T")


class ReadStuck(DaemonError):
    """The config's read did not return within limits.io_timeout_s."""


class Reloads:
    """The daemon's reloads, one at a time in the order the signals came."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self._one_at_a_time = asyncio.Lock()
        self._reading = threading.Event()  # set while a read's thread has not returned
        # What `status` and the metrics say of the last reload: why it failed (None: it did
        # not, or none came yet), and the keys changed since the start that wait for a
        # restart. Logged only, a failed reload or a destination change left the operator
        # believing the file's config applied (found attacking).
        self.failed: str | None = None
        self.needs_restart: list[str] = []

    async def run(self) -> None:
        d = self.d
        async with self._one_at_a_time:
            await d.ready.wait()
            if d.stopping:
                return
            d.notifier.reloading("reloading limits")
            try:
                await self._reload()
                self.failed = None
            except (ConfigError, StartupError) as exc:
                self.failed = str(exc)
                log_event(log, logging.ERROR, "reload_failed", error=str(exc))
            except ReadStuck as exc:
                self.failed = str(exc)
                log_event(log, logging.ERROR, "reload_failed", error=str(exc),
                          action="the daemon runs on with its old config")
            except Exception as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                log_event(log, logging.ERROR, "reload_failed", exc_info=True,
                          error=f"{type(exc).__name__}: {exc}; the daemon runs on with its old "
                                "config (the traceback says where)")
                d.metrics.internal_error("background")
            finally:
                if not d.stopping:
                    d.notifier.ready(d.status_line())

    def _source(self) -> str:
        return (self.d.config_path or os.environ.get("CKPTDRAIN_CONFIG")
                or "the embedded default")

    async def _read(self) -> Config:
        from ckptdrain.daemon.configload import load_config

        if self._reading.is_set():
            raise ReadStuck(f"the last read of {self._source()} has not returned yet (a hung "
                            "mount?)")
        limit = self.d.config.limits.io_timeout_s
        reading = _in_own_thread(self._reading, load_config, self.d.config_path)
        try:
            async with asyncio.timeout(limit):
                return await asyncio.shield(reading)  # its thread goes on: never cancelled
        except TimeoutError:
            raise ReadStuck(f"reading {self._source()} took more than limits.io_timeout_s = "
                            f"{limit:g} s (a hung mount?)") from None

    async def _reload(self) -> None:
        from ckptdrain.daemon.configload import with_limits_from

        d = self.d
        loaded = await self._read()
        restart = startup.needs_restart(startup.changed_keys(d.loaded_config, loaded))
        self.needs_restart = list(restart)
        try:
            new = with_limits_from(d.config, loaded)
        except ConfigError as exc:
            if not restart:
                raise
            # The file's limits fit its own keys, not the running ones (ack = "memory" running,
            # the file's ack = "local" and max_memory_bytes = 0): said so, not the merge's own
            # fix, which told the operator to do what the file already did (found attacking).
            them = "it" if len(restart) == 1 else "them"
            raise ConfigError(exc.key, "the file's [limits] do not fit the "
                              f"{', '.join(restart)} the daemon runs with until a restart "
                              f"(only a restart applies {them}); restart the daemon to apply "
                              "the file") from None
        # The drain's pace is a limit too: an operator slows or frees it without a restart.
        new = new.model_copy(update={"drain": new.drain.model_copy(update={
            "max_bandwidth_bytes_per_s": loaded.drain.max_bandwidth_bytes_per_s})})
        free_bytes, _ = d.staging_free
        # From the refresh loop's last sample: a reload never waits on the staging disk.
        capacity = free_bytes + d.admission.staged.used - d.staging_reserve
        # With the disk's size, as at start: a disk someone else filled is full for now, not
        # too small. Without it every reload failed while the staging filesystem had under
        # 16 MiB free, in just the incident where an operator reloads (found attacking).
        fitted = startup.fit_staged_limit(new, capacity, d.staging_size)
        clamped_from = startup.clamped_from(new, fitted)
        new = fitted
        rate_changed = (new.drain.max_bandwidth_bytes_per_s
                        != d.config.drain.max_bandwidth_bytes_per_s)
        d.config = new
        d.scheduler.config = new
        d.staged_limit_clamped_from = clamped_from
        d.admission.set_limits(new)
        # One pump thread per connection, as at start: a reload admitting more connections
        # than the data plane has pumps left the ones beyond waiting for a thread.
        d.dataplane.grow_pumps(new.limits.max_clients)
        if rate_changed:
            d.scheduler.set_bandwidth(new.drain.max_bandwidth_bytes_per_s)
        setup_logging(new.log_level)
        # The drain's pace too: an operator who slowed or freed it sees it took.
        applied: dict[str, Any] = {"max_staged_bytes": new.limits.max_staged_bytes,
                                   "on_full": new.limits.on_full,
                                   "log_level": new.log_level,
                                   "max_bandwidth_bytes_per_s":
                                       new.drain.max_bandwidth_bytes_per_s}
        if restart:
            log_event(log, logging.WARNING, "reloaded", **applied, needs_restart=restart,
                      action=f"restart the daemon to apply {', '.join(restart)}; until then it "
                      "runs with the old values")
        else:
            log_event(log, logging.INFO, "reloaded", **applied)


def _in_own_thread(busy: threading.Event, fn: Callable[..., _T], *args: Any
                   ) -> asyncio.Future[_T]:
    """``fn(*args)`` in a thread of its own, ``busy`` set until it returns: a call that never
    returns holds no pool's thread, and the process's exit does not wait for it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, exc: BaseException | None) -> None:
        if done.done():
            return  # given up on
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: _T | None = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:
            error = exc
        finally:
            busy.clear()
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    busy.set()
    threading.Thread(target=run, name="ckptdrain-reload", daemon=True).start()
    # Retrieved whether or not anyone still waits: no "exception never retrieved" later.
    done.add_done_callback(lambda f: f.cancelled() or f.exception())
    return done
