"""Structured logs: one ``key=value`` line per event, journald-aware, secrets masked.

A line looks like::

    ts=2025-01-31T12:00:00.123Z level=info event=generation_committed job=llama step=1200

Under systemd (``$JOURNAL_STREAM`` names our stderr) the timestamp is replaced by a ``<6>``
syslog priority prefix: journald stamps the time itself and files the line at that priority.

:class:`OncePerCause` keeps a persistent fault (a destination down for an hour) from logging
the same cause thousands of times: it logs the first occurrence, then at most once per interval,
and reports how many it held back.
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import json
import logging
import math
import os
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "LEVELS",
    "KeyValueFormatter",
    "OncePerCause",
    "format_fields",
    "log_event",
    "per_user",
    "setup_logging",
]

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

# syslog priorities (sd-daemon(3)): journald reads a leading "<N>" as the line's priority.
_SYSLOG_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}

# Keys whose values are never written, whatever they hold.
SECRET_KEY_PATTERNS = (
    "*secret*",
    "*token*",
    "*password*",
    "*passwd*",
    "*authorization*",
    "aws_*key*",
)
REDACTED = "***"

# Libraries that log a line per HTTP request at debug; they stay at INFO or above even when
# the daemon runs at debug, or a single drain would bury everything else.
_CHATTY_LOGGERS = ("botocore", "aiobotocore", "s3transfer", "urllib3", "asyncio")

_EVENT_ATTR = "ckptdrain_event"
_FIELDS_ATTR = "ckptdrain_fields"


def _level_number(level: str | int) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str) and level.lower() in LEVELS:
        return LEVELS[level.lower()]
    raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")


def _level_name(levelno: int) -> str:
    for name, number in LEVELS.items():
        if number == levelno:
            return name
    return logging.getLevelName(levelno).lower()


def _is_secret(key: str) -> bool:
    low = key.lower()
    return any(fnmatch.fnmatchcase(low, pattern) for pattern in SECRET_KEY_PATTERNS)


def _redact_url(text: str) -> str:
    if "@" not in text or "://" not in text:
        return text
    try:
        parts = urlsplit(text)
        if parts.username is None and parts.password is None:
            return text
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:
        return text
    return urlunsplit(parts._replace(netloc=f"{REDACTED}@{host}"))


def _redact(value: Any) -> Any:
    """Nested values with secret keys and URL credentials masked."""
    if isinstance(value, Mapping):
        return {
            str(k): REDACTED if _is_secret(str(k)) else _redact(v) for k, v in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        return [_redact(v) for v in value]
    if isinstance(value, str):
        return _redact_url(value)
    return value


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        # Microsecond precision is plenty for durations, and keeps lines short.
        return repr(round(value, 6)) if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return _redact_url(value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, BaseException):
        text = str(value)
        return f"{type(value).__name__}: {text}" if text else type(value).__name__
    if isinstance(value, Mapping | list | tuple | set | frozenset):
        return json.dumps(_redact(value), separators=(",", ":"), default=str, ensure_ascii=False)
    return _redact_url(str(value))


def _quote(text: str) -> str:
    # logfmt: a value needs quotes only where a reader would split it (spaces, "=") or could
    # not tell it from a quoted one; JSON values without spaces stay readable unquoted.
    if text and not text.startswith('"') and not any(
        ch.isspace() or ch == "=" or not ch.isprintable() for ch in text
    ):
        return text
    return json.dumps(text, ensure_ascii=False)


def _key(key: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch in "_.-" else "_" for ch in key)
    return cleaned or "_"


def format_fields(fields: Mapping[str, Any]) -> str:
    """``k=v k2="v 2"`` in the given order: values quoted when they hold spaces, ``=`` or
    quotes; secret-named keys written as ``***``."""
    parts = []
    for key, value in fields.items():
        text = REDACTED if _is_secret(key) else _text(value)
        parts.append(f"{_key(key)}={_quote(text)}")
    return " ".join(parts)


def log_event(
    logger: logging.Logger,
    level: str | int,
    event: str,
    *,
    exc_info: bool | BaseException = False,
    **fields: Any,
) -> None:
    """Log one event as one line: ``level=info event=<event> k=v ...``. With ``exc_info`` the
    exception and its traceback are added as ``error=`` and ``traceback=`` (still one line)."""
    _emit(logger, level, event, fields, exc_info=exc_info, stacklevel=3)


def _emit(
    logger: logging.Logger,
    level: str | int,
    event: str,
    fields: dict[str, Any],
    *,
    exc_info: bool | BaseException,
    stacklevel: int,
) -> None:
    levelno = _level_number(level)
    if not logger.isEnabledFor(levelno):
        return
    # The plain message is what other handlers (pytest's caplog, a root handler someone else
    # installed) see; our formatter rebuilds the line from the structured attributes.
    message = format_fields({"event": event, **fields})
    logger.log(
        levelno,
        message,
        exc_info=exc_info,
        extra={_EVENT_ATTR: event, _FIELDS_ATTR: fields},
        stacklevel=stacklevel,
    )


class KeyValueFormatter(logging.Formatter):
    """Formats every record, ours or a library's, as one ``key=value`` line."""

    def __init__(self, *, journald: bool = False) -> None:
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        head: dict[str, Any] = {"level": _level_name(record.levelno)}
        event = getattr(record, _EVENT_ATTR, None)
        if event is not None:
            head["event"] = event
            fields = dict(getattr(record, _FIELDS_ATTR, {}) or {})
        else:
            # A plain logging call (ours or a library's): keep its text as one field.
            head["event"] = "log"
            fields = {"logger": record.name, "msg": record.getMessage()}
        if record.exc_info and record.exc_info[1] is not None:
            fields.setdefault("error", record.exc_info[1])
            fields["traceback"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            fields["traceback"] = record.exc_text
        line = format_fields({**head, **fields})
        if self.journald:
            return f"<{_SYSLOG_PRIORITY.get(record.levelno, 6)}>{line}"
        stamp = _dt.datetime.fromtimestamp(record.created, tz=_dt.UTC)
        return f"ts={stamp.strftime('%Y-%m-%dT%H:%M:%S')}.{stamp.microsecond // 1000:03d}Z {line}"


def _journald_stream(stream: TextIO, env: Mapping[str, str]) -> bool:
    """True when ``$JOURNAL_STREAM`` is set and, where it can be checked, names ``stream``
    (a child whose stderr was redirected inherits the variable but is not talking to journald)."""
    value = env.get("JOURNAL_STREAM")
    if not value:
        return False
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return True
    try:
        st = os.fstat(fd)
    except OSError:
        return True
    return value == f"{st.st_dev}:{st.st_ino}"


_installed: logging.Handler | None = None


def setup_logging(
    level: str,
    *,
    stream: TextIO | None = None,
    journald: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Send every log record to ``stream`` (default stderr) as one ``key=value`` line.

    Safe to call again (SIGHUP changes ``log_level``): the handler installed earlier is
    replaced, never duplicated. ``journald`` defaults to detecting ``$JOURNAL_STREAM``.
    """
    global _installed
    levelno = _level_number(level)
    target = sys.stderr if stream is None else stream
    if journald is None:
        journald = _journald_stream(target, os.environ if env is None else env)
    handler = logging.StreamHandler(target)
    handler.setFormatter(KeyValueFormatter(journald=journald))
    root = logging.getLogger()
    if _installed is not None:
        root.removeHandler(_installed)
        _installed.close()
    root.addHandler(handler)
    root.setLevel(levelno)
    _installed = handler
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(levelno, logging.INFO))


# What a user's own doing logs (a client's malformed frames, refused requests and hang-ups; a
# generation its job aborted) goes through one bucket per uid: the first USER_LOG_BURST lines,
# then one a second, each saying how many were held back. One looping or hostile client
# otherwise wrote about 1000 lines a second, and journald's per-unit rate limit then drops
# the daemon's own lines along with the flood.
USER_LOG_BURST = 20
USER_LOG_INTERVAL_S = 1.0


def per_user() -> OncePerCause:
    """A bucket for lines a user's own doing causes (see USER_LOG_BURST), keyed by uid."""
    return OncePerCause(USER_LOG_INTERVAL_S, burst=USER_LOG_BURST)


@dataclass
class _Cause:
    stamp: float  # when ``tokens`` was last brought up to date
    tokens: float  # occurrences that may log now, at most the burst
    pending: int = 0  # suppressed since the last one logged
    reported: int = 0  # suppressed before the most recent logged occurrence


class OncePerCause:
    """Rate-limit log lines per cause: the first ``burst`` occurrences log, then at most one
    per ``interval_s`` (a token bucket per cause); each logged line can report how many were
    suppressed before it.

    ``clock`` is injectable so tests never sleep; ``max_causes`` bounds the memory held (the
    least recently seen cause is forgotten first, and simply logs again when it recurs).
    """

    def __init__(
        self,
        interval_s: float = 60.0,
        *,
        burst: int = 1,
        clock: Callable[[], float] = time.monotonic,
        max_causes: int = 1024,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0 (got {interval_s})")
        if burst < 1:
            raise ValueError(f"burst must be >= 1 (got {burst})")
        if max_causes < 1:
            raise ValueError(f"max_causes must be >= 1 (got {max_causes})")
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._max_causes = max_causes
        self._causes: OrderedDict[str, _Cause] = OrderedDict()

    def should_log(self, cause_key: str) -> bool:
        """True for the first ``burst`` occurrences of ``cause_key``, then once per interval."""
        now = self._clock()
        state = self._causes.get(cause_key)
        if state is None:
            while len(self._causes) >= self._max_causes:
                self._causes.popitem(last=False)
            self._causes[cause_key] = _Cause(stamp=now, tokens=self.burst - 1)
            return True
        self._causes.move_to_end(cause_key)
        refill = self.burst if self.interval_s == 0 else (now - state.stamp) / self.interval_s
        state.tokens, state.stamp = min(self.burst, state.tokens + refill), now
        # The tolerance: a refill summed from several calls may land a hair below 1.
        if state.tokens >= 1 - 1e-9:
            state.tokens = max(0.0, state.tokens - 1)
            state.reported, state.pending = state.pending, 0
            return True
        state.pending += 1
        return False

    def suppressed(self, cause_key: str) -> int:
        """How many occurrences were held back before the last one :meth:`should_log` allowed."""
        state = self._causes.get(cause_key)
        return state.reported if state else 0

    def pending(self, cause_key: str) -> int:
        """How many occurrences have been held back since the last one logged."""
        state = self._causes.get(cause_key)
        return state.pending if state else 0

    def reset(self, cause_key: str) -> None:
        """Forget a cause (it cleared up), so its next occurrence logs at once."""
        self._causes.pop(cause_key, None)

    def log_event(
        self,
        logger: logging.Logger,
        level: str | int,
        event: str,
        *,
        cause: str,
        **fields: Any,
    ) -> bool:
        """:func:`log_event` if ``cause`` may log now, adding ``suppressed=N`` when some were
        held back; returns whether it logged."""
        if not self.should_log(cause):
            return False
        count = self.suppressed(cause)
        if count:
            fields["suppressed"] = count
        _emit(logger, level, event, fields, exc_info=False, stacklevel=3)
        return True
