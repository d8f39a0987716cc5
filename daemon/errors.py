"""The daemon's error root, and the refusal every request handler raises.

Every error the daemon raises on purpose derives from :class:`DaemonError`; only ``cli.py``
turns them into exit codes. A :class:`RequestError` goes back to the client as a typed error
frame and the daemon carries on.
"""

from __future__ import annotations

from typing import Any


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


class StuckIO(DaemonError):
    """A blocking call (a client's fd on a hung mount, an fsync) outlived ``io_timeout_s``.

    The hand-off fails; the thread stays counted as stuck until the call returns, and the
    resources it holds are released then, by the thread's own clean-up.
    """
