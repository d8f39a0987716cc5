"""The SIGHUP reload: apply what can change while running (``[limits]``, ``log_level``, the
drain's pace) and name every other changed key as needing a restart (they name sockets,
directories and destinations in use).

A config that does not load is logged (``reload_failed``) and ignored: the daemon keeps
running as it was. The file is read in the data plane, within ``limits.io_timeout_s``: read
on the loop, a config that was a FIFO, or on a hung mount, froze every client and the stop
(found attacking). Whatever else goes wrong ends in that one line too, and systemd always
hears ``READY=1`` after the ``RELOADING=1`` it was sent (found attacking: a ``~user`` that
does not exist raised past the handler, and the unit was left reloading). Reloads run one at
a time, in the order the signals came.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ckptdrain.daemon import startup
from ckptdrain.daemon.errors import ConfigError, StartupError, StuckIO
from ckptdrain.daemon.logs import log_event, setup_logging

if TYPE_CHECKING:
    from ckptdrain.daemon.config import Config
    from ckptdrain.daemon.server import Daemon

log = logging.getLogger("ckptdrain.daemon")

class Reloads:
    """The daemon's reloads, one at a time in the order the signals came."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self._one_at_a_time = asyncio.Lock()

    async def run(self) -> None:
        d = self.d
        async with self._one_at_a_time:
            d.notifier.reloading("reloading limits")
            try:
                await _reload(d)
            except (ConfigError, StartupError) as exc:
                log_event(log, logging.ERROR, "reload_failed", error=str(exc))
            except StuckIO:
                log_event(log, logging.ERROR, "reload_failed",
                          error=f"reading {d.config_path} took more than limits.io_timeout_s "
                                f"= {d.dataplane.timeout_s:g} s (a FIFO, or a hung mount?); "
                                "the daemon runs on with its old config")
            except Exception as exc:
                log_event(log, logging.ERROR, "reload_failed", exc_info=True,
                          error=f"{type(exc).__name__}: {exc}; the daemon runs on with its old "
                                "config (the traceback says where)")
                d.metrics.internal_error("background")
            finally:
                d.notifier.ready(d.status_line())


async def _reload(d: Daemon) -> None:
    from ckptdrain.daemon.configload import load_config, with_limits_from

    loaded: Config = await d.dataplane.call(load_config, d.config_path)
    new = with_limits_from(d.config, loaded)
    # The drain's pace is a limit too: an operator slows or frees it without a restart.
    new = new.model_copy(update={"drain": new.drain.model_copy(update={
        "max_bandwidth_bytes_per_s": loaded.drain.max_bandwidth_bytes_per_s})})
    restart = startup.needs_restart(startup.changed_keys(d.loaded_config, loaded))
    free_bytes, _ = d.staging_free
    # From the refresh loop's last sample: a reload never waits on the staging disk.
    capacity = free_bytes + d.admission.staged.used - d.staging_reserve
    if free_bytes or d.staging_reserve:  # none yet: a reload during start-up
        new = startup.fit_staged_limit(new, capacity)
    d.config = new
    d.scheduler.config = new
    d.admission.set_limits(new)
    d.scheduler.set_bandwidth(new.drain.max_bandwidth_bytes_per_s)
    setup_logging(new.log_level)
    # The drain's pace too: an operator who slowed or freed it sees it took.
    applied: dict[str, Any] = {"max_staged_bytes": new.limits.max_staged_bytes,
                               "on_full": new.limits.on_full,
                               "log_level": new.log_level,
                               "max_bandwidth_bytes_per_s": new.drain.max_bandwidth_bytes_per_s}
    if restart:
        log_event(log, logging.WARNING, "reloaded", **applied, needs_restart=restart,
                  action=f"restart the daemon to apply {', '.join(restart)}; until then it "
                  "runs with the old values")
    else:
        log_event(log, logging.INFO, "reloaded", **applied)
