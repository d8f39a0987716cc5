"""The daemon's error root, and the refusal every request handler raises.

Every error the daemon raises on purpose derives from :class:`DaemonError`; only ``cli.py``
turns them into exit codes. A :class:`RequestError` goes back to the client as a typed error
frame and the daemon carries on.
"""

from __future__ import annotations

import errno
from typing import Any

from ckptdrain.client import wire
from ckptdrain.client.manifest import ManifestError, NewerFormat


class DaemonError(Exception):
    """Root of the daemon's own errors."""


class RequestError(DaemonError):
    """An expected refusal: sent to the client as a typed error; the daemon carries on."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}


class ConfigError(DaemonError):
    """The configuration is wrong. ``key`` is the dotted key (``limits.max_staged_bytes``), the
    file path or the environment variable at fault; ``reason`` says what is wrong and the fix.
    (Here, not in config.py, so that catching it loads no pydantic: cli.py catches it for
    every command, and most never load the configuration.)"""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class StartupError(DaemonError):
    """The environment does not let the daemon start; ``key`` is the config key to look at."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class OperatorNeeded(DaemonError):
    """What stops the start is something only an operator can mend (a damaged journal): the
    CLI exits 78, as for a bad configuration, so that systemd does not restart it every few
    seconds for good (``RestartPreventExitStatus=78``), each start failing the same way."""


class DiskFull(StartupError):
    """A filesystem the daemon must write to start (``staging_dir``: its lock, its journal)
    is full for now, another user's files most likely. Not a configuration error: the same
    start succeeds once there is room, so the CLI exits 75 (EX_TEMPFAIL), which
    ``Restart=on-failure`` retries, where 78 would leave the node without a daemon until an
    operator came."""


class StuckIO(DaemonError):
    """A blocking call (a client's fd on a hung mount, an fsync) outlived ``io_timeout_s``.

    The hand-off fails; the thread stays counted as stuck until the call returns, and the
    resources it holds are released then, by the thread's own clean-up.
    """


# What a system call fails with when this process or the node runs short, not because of the
# file or the request: it passes once others close theirs (drained, retried, or refused as
# backpressure; never a generation's end nor a client's fault).
RUN_OUT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def descriptors_short(what: str) -> RequestError:
    """The refusal of a request the daemon could not serve for want of file descriptors (its
    RLIMIT_NOFILE, or the node's): retryable, as any backpressure."""
    return RequestError(wire.BACKPRESSURE, f"{what}: the daemon is short of file descriptors "
                        "(its RLIMIT_NOFILE, or the node's file table); retry shortly, and if "
                        "it persists raise LimitNOFILE or lower limits.max_clients",
                        {"limit": "file_descriptors", "retry_after_s": 1.0})


def one_line(text: str) -> str:
    """``text`` on one line, its control and formatting characters escaped (``\\n``,
    ``\\x1b``, ``\\u202e``): an error may carry someone else's text (a client's exception, an S3
    server's message), and a newline or a terminal escape in it forged lines of ``status`` or
    broke the one line an expected failure is, and reached the user's terminal raw (found
    attacking)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def destination_error(job: str, step: int | None, exc: BaseException) -> RequestError:
    what = f"step {step} of job {job!r}" if step is not None else f"job {job!r}"
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, NewerFormat):  # not damage: `verify` would say the same
        return RequestError(wire.DESTINATION, f"{what} was committed by a newer ckptdrain at "
                            f"the destination ({detail}); upgrade this node's daemon")
    if isinstance(exc, ManifestError):
        return RequestError(wire.DESTINATION, f"the manifest of {what} at the destination is "
                            f"damaged: {detail}; run `ckptdrain verify` on it")
    return RequestError(wire.DESTINATION, f"could not read {what} at the destination: {detail}; "
                        "check the destination and retry")
